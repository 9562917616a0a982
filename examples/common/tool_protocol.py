"""The tool-call protocol shared by the example tasks.

A model turn calls a tool by writing::

    <tool_call>{"name": "calculator", "arguments": {"expression": "2 * (3 + 4)"}}</tool_call>

and ends the episode with ``<answer>...</answer>``. One tool call per turn: a turn with
several is refused with an error observation (none of them runs). Text inside
``<think>...</think>`` is reasoning, never an action, and an ``<answer>`` tag counts only
outside ``<think>`` and outside tool calls. The environment replies to every
non-final turn with text wrapped in ``<tool_response>...</tool_response>``: the tool's
output, or an ``Error: ...`` line that names what was wrong, so a policy can recover
instead of the rollout crashing.

This module has no third-party imports (agents load it by path inside OpenRLHF's
rollout actors, and tests load it without torch).
"""

from __future__ import annotations

import json
import math
import os
import re
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"

# Tool output longer than this is cut, so one call cannot flood the context window.
MAX_RESPONSE_CHARS = 4000

# How feedback is appended after a model turn. "plain" suits plain-text prompts (the
# default); "chatml" closes the turn the way Qwen-style chat templates render a tool
# result, for prompts built with --data.apply_chat_template (the model's <|im_end|> is
# already in the token stream when the turn ended with EOS). Chosen with the
# TOOL_FEEDBACK_FORMAT environment variable, read when this module is imported.
FEEDBACK_TEMPLATES = {
    "plain": "\n<tool_response>\n{text}\n</tool_response>\n",
    "chatml": "\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
}
FEEDBACK_FORMAT = os.environ.get("TOOL_FEEDBACK_FORMAT", "plain")
if FEEDBACK_FORMAT not in FEEDBACK_TEMPLATES:
    raise ValueError(
        f"TOOL_FEEDBACK_FORMAT={FEEDBACK_FORMAT!r} is not one of: {', '.join(FEEDBACK_TEMPLATES)}"
    )

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


class ToolCallError(Exception):
    """A problem with a tool call; its message is shown to the model verbatim."""


@dataclass(frozen=True)
class Param:
    """One argument of a tool: its JSON name, Python type, a description and an example value for the prompt."""

    name: str
    type: type
    description: str
    example: Any = "..."


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: ``fn(**arguments) -> str``.

    ``fn`` raises :class:`ToolCallError` for bad input it detects itself; any other
    exception is still caught by :func:`handle_action` and reported as an error.
    """

    name: str
    description: str
    params: tuple[Param, ...]
    fn: Callable[..., str] = field(compare=False, repr=False)

    def example_arguments(self) -> dict[str, Any]:
        return {p.name: p.example for p in self.params}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ActionOutcome:
    """What one model turn amounted to.

    kind is ``"answer"`` (episode over; ``answer`` holds the text), ``"tool"`` (a tool ran;
    ``feedback`` holds its wrapped output), ``"error"`` (a malformed or failing tool call;
    ``feedback`` names the problem) or ``"none"`` (neither a tool call nor an answer).
    """

    kind: str
    feedback: str = ""
    answer: str | None = None
    tool_name: str | None = None


def _tag_body(text: str, open_tag: str, close_tag: str) -> str | None:
    """Body of the first ``open_tag ... close_tag`` in ``text``.

    A missing close tag is tolerated (the body runs to the end of the text) because a
    stop string such as ``</tool_call>`` is usually cut from the generated text.
    """
    start = text.find(open_tag)
    if start < 0:
        return None
    start += len(open_tag)
    end = text.find(close_tag, start)
    return text[start:] if end < 0 else text[start:end]


def _without(text: str, open_tag: str, close_tag: str) -> str:
    """``text`` with every ``open_tag ... close_tag`` span removed (an unclosed one runs to the end)."""
    out, pos = [], 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            out.append(text[pos:])
            return "".join(out)
        out.append(text[pos:start])
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            return "".join(out)
        pos = end + len(close_tag)


def visible_action(text: str) -> str:
    """The part of a turn that acts: without its ``<think>`` spans."""
    return _without(text, THINK_OPEN, THINK_CLOSE)


def extract_answer(text: str) -> str | None:
    """The stripped text inside the first ``<answer>`` tag outside ``<think>`` and outside tool
    calls, or None when there is none."""
    outside = _without(visible_action(text), TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
    body = _tag_body(outside, ANSWER_OPEN, ANSWER_CLOSE)
    return None if body is None else body.strip()


def extract_tool_call(text: str) -> str | None:
    """The raw body of the first ``<tool_call>`` tag outside ``<think>``, or None when there is none."""
    return _tag_body(visible_action(text), TOOL_CALL_OPEN, TOOL_CALL_CLOSE)


def count_tool_calls(text: str) -> int:
    """How many ``<tool_call>`` tags the turn has outside ``<think>``."""
    return visible_action(text).count(TOOL_CALL_OPEN)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return _JSON_TYPES.get(type(value), type(value).__name__)


def parse_tool_call(raw: str, tools: Mapping[str, Tool]) -> ToolCall:
    """Validate the JSON body of a tool call against ``tools``; raise ToolCallError if bad."""
    try:
        payload = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ToolCallError(
            f"the tool call is not valid JSON ({exc.msg} at position {exc.pos}); expected "
            '{"name": "<tool name>", "arguments": {...}}'
        ) from None
    except RecursionError:
        raise ToolCallError("the tool call JSON is nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4,300 digits (Python's int limit)
        raise ToolCallError(f"the tool call JSON has a value Python cannot read ({str(exc)[:120]})") from None
    if not isinstance(payload, dict):
        raise ToolCallError(f"the tool call must be a JSON object, got {_type_name(payload)}")
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallError('the tool call needs a "name" string naming the tool')
    if name not in tools:
        raise ToolCallError(f"unknown tool {name!r}; available tools: {', '.join(sorted(tools))}")
    tool = tools[name]
    unexpected_keys = sorted(set(payload) - {"name", "arguments"})
    if unexpected_keys:
        raise ToolCallError(f"unexpected key(s) in the tool call: {', '.join(unexpected_keys)}")
    if "arguments" not in payload:
        raise ToolCallError(f'the call to {name} has no "arguments" object')
    arguments = payload["arguments"]
    if not isinstance(arguments, dict):
        raise ToolCallError(f'"arguments" of {name} must be a JSON object, got {_type_name(arguments)}')

    declared = {p.name: p for p in tool.params}
    unknown = sorted(set(arguments) - set(declared))
    if unknown:
        raise ToolCallError(
            f"{name} got unexpected argument(s) {', '.join(unknown)}; it takes: {', '.join(declared)}"
        )
    for param in tool.params:
        if param.name not in arguments:
            raise ToolCallError(f"{name} is missing the required argument {param.name!r}")
        value = arguments[param.name]
        # bool is a subclass of int in Python but not an integer in JSON.
        if (isinstance(value, bool) and param.type is not bool) or not isinstance(value, param.type):
            raise ToolCallError(
                f"argument {param.name!r} of {name} must be a {_JSON_TYPES.get(param.type, param.type.__name__)}, "
                f"got {_type_name(value)}"
            )
    return ToolCall(name=name, arguments=dict(arguments))


def truncate(text: str, limit: int = MAX_RESPONSE_CHARS) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [truncated {len(text) - limit} characters]"


def wrap_response(text: str) -> str:
    """Environment feedback as appended to the context after a model turn (see FEEDBACK_TEMPLATES)."""
    return FEEDBACK_TEMPLATES[FEEDBACK_FORMAT].format(text=truncate(text))


def handle_action(action_text: str, tools: Sequence[Tool] | Mapping[str, Tool]) -> ActionOutcome:
    """Interpret one model turn: answer, tool call (run it), malformed call, or neither.

    Never raises: every failure (of the call, of the tool, of this function) becomes an
    ``Error: ...`` observation.
    """
    try:
        return _handle_action(action_text, tools)
    except Exception as exc:  # noqa: BLE001 - the contract: an observation, never an exception
        return ActionOutcome(kind="error", feedback=wrap_response(f"Error: the turn could not be handled "
                                                                  f"({type(exc).__name__}: {str(exc)[:200]})"))


def _handle_action(action_text: str, tools: Sequence[Tool] | Mapping[str, Tool]) -> ActionOutcome:
    by_name = tools if isinstance(tools, Mapping) else {t.name: t for t in tools}
    answer = extract_answer(action_text)
    if answer is not None:
        return ActionOutcome(kind="answer", answer=answer)

    calls = count_tool_calls(action_text)
    if calls > 1:
        return ActionOutcome(kind="error", feedback=wrap_response(
            f"Error: {calls} tool calls in one turn; make one call per turn and wait for its result "
            "(none of them was run)"))
    raw = extract_tool_call(action_text)
    if raw is None:
        example = next(iter(by_name.values()), None)
        call = (
            json.dumps({"name": example.name, "arguments": example.example_arguments()})
            if example is not None
            else '{"name": "<tool name>", "arguments": {...}}'
        )
        hint = (
            f"Error: no tool call or answer found. Call a tool with {TOOL_CALL_OPEN}{call}{TOOL_CALL_CLOSE} "
            f"or give the final answer as {ANSWER_OPEN}...{ANSWER_CLOSE}."
        )
        return ActionOutcome(kind="none", feedback=wrap_response(hint))

    try:
        call = parse_tool_call(raw.strip(), by_name)
    except ToolCallError as exc:
        return ActionOutcome(kind="error", feedback=wrap_response(f"Error: {exc}"))

    try:
        output = by_name[call.name].fn(**call.arguments)
    except ToolCallError as exc:
        return ActionOutcome(kind="error", feedback=wrap_response(f"Error: {exc}"), tool_name=call.name)
    except Exception as exc:  # a tool bug must not kill the rollout
        return ActionOutcome(
            kind="error",
            feedback=wrap_response(f"Error: {call.name} failed: {type(exc).__name__}: {exc}"),
            tool_name=call.name,
        )
    return ActionOutcome(kind="tool", feedback=wrap_response(str(output)), tool_name=call.name)


@dataclass
class EpisodeStats:
    """Per-trajectory counters, reported as OpenRLHF ``extra_logs``.

    OpenRLHF keeps only the last step's ``extra_logs``, so the counts are cumulative, and
    the keys are the same at every step so that they batch across trajectories.
    """

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    no_action_turns: int = 0
    answered: bool = False

    def record(self, outcome: ActionOutcome) -> None:
        self.turns += 1
        if outcome.kind == "answer":
            self.answered = True
        elif outcome.kind == "none":
            self.no_action_turns += 1
        else:
            self.tool_calls += 1
            self.tool_errors += outcome.kind == "error"

    def logs(self) -> dict[str, float]:
        return {
            "turns": float(self.turns),
            "tool_calls": float(self.tool_calls),
            "tool_errors": float(self.tool_errors),
            "no_action_turns": float(self.no_action_turns),
            "answered": float(self.answered),
        }


def render_instructions(tools: Sequence[Tool]) -> str:
    """The part of a prompt that explains the tools and the call/answer format."""
    lines = ["You can use the following tools:"]
    for tool in tools:
        signature = ", ".join(f"{p.name}: {_JSON_TYPES.get(p.type, p.type.__name__)}" for p in tool.params)
        lines.append(f"- {tool.name}({signature}): {tool.description}")
        for p in tool.params:
            lines.append(f"    {p.name}: {p.description}")
    first = tools[0]
    lines += [
        "",
        "To call a tool, write one JSON object inside tool_call tags, for example:",
        f"{TOOL_CALL_OPEN}{json.dumps({'name': first.name, 'arguments': first.example_arguments()})}{TOOL_CALL_CLOSE}",
        "Make at most one tool call per turn, then stop and wait: the result comes back inside "
        "<tool_response>...</tool_response>.",
        f"When you know the final answer, write it inside answer tags: {ANSWER_OPEN}...{ANSWER_CLOSE}",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Answer normalization shared by the rewards.

_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_ARTICLES_RE = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def parse_number(text: str) -> float | None:
    """The single finite number in ``text`` ("$1,250", "42 km", "-3.5"), or None if there is not exactly one."""
    cleaned = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text.strip())
    found = _NUMBER_RE.findall(cleaned)
    if len(found) != 1:
        return None
    value = float(found[0])
    return value if math.isfinite(value) else None  # "1e999" must not equal everything


def normalize_text(text: str) -> str:
    """SQuAD-style normalization: lower case, no punctuation, no articles, single spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES_RE.sub(" ", text)
    return " ".join(text.split())


def numbers_equal(a: float, b: float) -> bool:
    """Equal up to float rounding (relative 1e-6); never true for inf or nan."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return False
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


def step_result(outcome, states: dict, stats, reward) -> dict:
    """The dict an OpenRLHF ``AgentInstance.step`` returns for one handled action: the episode
    ends with ``reward(answer, label)`` on an answer, else the tool's output (or error) goes back."""
    import torch

    stats.record(outcome)
    if outcome.kind == "answer":
        score, feedback, done = reward(outcome.answer, states["label"]), "", True
    else:
        score, feedback, done = 0.0, outcome.feedback, False
    return {
        "rewards": torch.tensor(score),
        "scores": torch.tensor(score),
        "environment_feedback": feedback,
        "done": done,
        "sampling_params": states.get("sampling_params", None),
        "extra_logs": stats.logs(),
    }
