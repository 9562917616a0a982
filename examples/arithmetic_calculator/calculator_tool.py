"""A calculator that evaluates arithmetic expressions safely.

The model's text is never passed to ``eval``: it is parsed with ``ast`` and only
numbers, ``+ - * / // % **``, unary signs and parentheses are evaluated. Sizes are
capped (expression length, exponent, result magnitude) so that no expression can
stall a rollout worker or exhaust its memory.
"""

from __future__ import annotations

import ast
import math
import operator
import sys
from pathlib import Path

# Loaded by path (OpenRLHF): put examples/common and this folder on sys.path (examples/README.md).
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(_HERE.parent / "common"), str(_HERE)) if p not in sys.path]

from tool_protocol import Param, Tool, ToolCallError  # noqa: E402

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
# Integer results (and intermediate values) are limited to this many bits, about 1e308,
# the range of a float.
MAX_RESULT_BITS = 1024

_BINARY_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_OP_SYMBOLS = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.MatMult: "@",
    ast.BitAnd: "&",
    ast.BitOr: "|",
    ast.BitXor: "^",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.Invert: "~",
    ast.Not: "not",
}

Number = int | float


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


def _check_size(value: Number) -> Number:
    if isinstance(value, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise CalculatorError("the result is too large or undefined")
    elif abs(value).bit_length() > MAX_RESULT_BITS:
        raise CalculatorError("a number in the calculation is too large (limit about 1e308)")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {format_number(exponent)} is too large (limit {MAX_EXPONENT})")
    # Refuse before computing: the result of int ** int has about bits(base) * exponent bits.
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if (abs(base).bit_length() - 1) * exponent > MAX_RESULT_BITS:
            raise CalculatorError("the power is too large (limit about 1e308)")
    try:
        return base**exponent
    except ZeroDivisionError:
        raise CalculatorError("division by zero (zero to a negative power)") from None
    except OverflowError:
        raise CalculatorError("the power is too large (limit about 1e308)") from None


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalculatorError(f"only numbers are allowed, found {value!r}")
        return _check_size(value)
    if isinstance(node, ast.BinOp):
        op = type(node.op)
        if op not in _BINARY_OPS:
            raise CalculatorError(f"operator {_OP_SYMBOLS.get(op, op.__name__)} is not supported")
        left, right = _eval(node.left), _eval(node.right)
        if op is ast.Pow:
            return _check_size(_power(left, right))
        try:
            return _check_size(_BINARY_OPS[op](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large (limit about 1e308)") from None
    if isinstance(node, ast.UnaryOp):
        op = type(node.op)
        if op not in _UNARY_OPS:
            raise CalculatorError(f"operator {_OP_SYMBOLS.get(op, op.__name__)} is not supported")
        return _UNARY_OPS[op](_eval(node.operand))
    if isinstance(node, ast.Name):
        raise CalculatorError(f"names are not allowed (found {node.id!r}); use only numbers and operators")
    if isinstance(node, ast.Call):
        raise CalculatorError("function calls are not allowed; use only numbers and operators")
    if isinstance(node, ast.Attribute):
        raise CalculatorError("attribute access is not allowed; use only numbers and operators")
    raise CalculatorError(f"unsupported syntax ({type(node).__name__}); use only numbers, + - * / // % ** and ()")


def safe_eval(expression: str) -> Number:
    """Evaluate an arithmetic expression; raise CalculatorError for anything else."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be a string")
    text = expression.strip()
    if not text:
        raise CalculatorError("the expression is empty")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is too long ({len(text)} characters, limit {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"invalid syntax: {exc.msg}") from None
    except (ValueError, MemoryError, RecursionError) as exc:
        raise CalculatorError(f"invalid expression: {exc}") from None
    try:
        return _eval(tree.body)
    except RecursionError:
        raise CalculatorError("the expression is nested too deeply") from None


def format_number(value: Number) -> str:
    """Render a result: integral floats without ".0" (10 / 2 -> "5"), others shortest-exact."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def calculator(expression: str) -> str:
    """The ``calculator`` tool: the value of ``expression``, or a ToolCallError saying why not."""
    try:
        return format_number(safe_eval(expression))
    except CalculatorError as exc:
        raise ToolCallError(f"calculator: {exc}") from None


TOOLS = (
    Tool(
        name="calculator",
        description="Evaluates an arithmetic expression and returns its value.",
        params=(
            Param(
                "expression",
                str,
                f"numbers with + - * / // % ** and parentheses, at most {MAX_EXPRESSION_CHARS} characters",
                example="(12 + 8) * 3",
            ),
        ),
        fn=calculator,
    ),
)
