"""Arithmetic word problems for the calculator task.

Each problem is a short story (shopping, travel, sharing, savings, ...) needing 2-4
integer operations. Its answer is computed directly in Python and its solution is also
kept as a calculator expression, so the two can be checked against each other.

``--level basic`` gives one-operation problems instead (two numbers, ``+``, ``-`` or ``*``,
in the order the story states them): the level a very small model can learn to solve, used
by the CPU demo so that GRPO starts from a policy that succeeds part of the time.

    python examples/arithmetic_calculator/dataset.py --out train.jsonl --n 2000 --seed 0 [--level basic]

writes JSONL rows ``{"prompt": ..., "label": "<integer answer>"}``.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# Loaded by path (OpenRLHF): put examples/common and this folder on sys.path (examples/README.md).
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(_HERE.parent / "common"), str(_HERE)) if p not in sys.path]

from calculator_tool import TOOLS  # noqa: E402
from jsonl import write_jsonl  # noqa: E402
from tool_protocol import render_instructions  # noqa: E402

NAMES = ["Maya", "Leo", "Priya", "Tomas", "Aiko", "Omar", "Lena", "Kofi", "Sofia", "Ravi", "Elena", "Jonas"]
ITEMS = [("notebook", "notebooks"), ("pen", "pens"), ("apple", "apples"), ("sandwich", "sandwiches"),
         ("ticket", "tickets"), ("candle", "candles"), ("mug", "mugs"), ("scarf", "scarves")]
VEHICLES = ["bus", "train", "car", "ferry", "truck"]
STUDENT_GROUPS = ["classes", "teams", "tables", "scout troops"]
MONTHS_OF_SAVING = ["weeks", "months"]


@dataclass(frozen=True)
class Problem:
    """One word problem: its text, a calculator expression solving it, and the answer."""

    template: str
    question: str
    expression: str
    answer: int


def _count(n: int, singular: str, plural: str) -> str:
    return f"{n} {singular if n == 1 else plural}"


def _shopping_change(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    (one_a, many_a), (one_b, many_b) = rng.sample(ITEMS, 2)
    qa, pa, qb, pb = rng.randint(2, 9), rng.randint(2, 15), rng.randint(2, 9), rng.randint(1, 12)
    cost = qa * pa + qb * pb
    bill = next(b for b in (20, 50, 100, 200, 500) if b >= cost)
    question = (
        f"{name} buys {qa} {many_a} at ${pa} each and {qb} {many_b} at ${pb} each. "
        f"{name} pays with a ${bill} bill. How many dollars of change does {name} get?"
    )
    return Problem("shopping_change", question, f"{bill} - ({qa} * {pa} + {qb} * {pb})", bill - cost)


def _travel_distance(rng: random.Random) -> Problem:
    vehicle = rng.choice(VEHICLES)
    s1, h1, s2, h2 = rng.randint(30, 90), rng.randint(2, 6), rng.randint(30, 90), rng.randint(1, 5)
    question = (
        f"A {vehicle} travels at {s1} km per hour for {h1} hours, "
        f"then at {s2} km per hour for {_count(h2, 'hour', 'hours')}. "
        "How many kilometres does it travel in total?"
    )
    return Problem("travel_distance", question, f"{s1} * {h1} + {s2} * {h2}", s1 * h1 + s2 * h2)


def _sharing(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    trays, per_tray = rng.randint(3, 12), rng.choice([12, 16, 18, 20, 24, 30])
    groups = rng.choice([3, 4, 5, 6, 8])
    group_word = rng.choice(STUDENT_GROUPS)
    total = trays * per_tray
    # Keep a number that leaves the rest divisible by the number of groups.
    kept = total % groups + groups * rng.randint(1, (total // groups) // 3)
    question = (
        f"{name} bakes {trays} trays of {per_tray} cookies. {name} keeps {kept} cookies and shares the rest "
        f"equally among {groups} {group_word}. How many cookies does each of the {group_word} get?"
    )
    return Problem("sharing", question, f"({trays} * {per_tray} - {kept}) / {groups}", (total - kept) // groups)


def _savings(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    period = rng.choice(MONTHS_OF_SAVING)
    start, per, count = rng.randint(0, 300), rng.randint(5, 60), rng.randint(3, 12)
    spend = rng.randint(10, start + per * count)
    question = (
        f"{name} has ${start}. {name} saves ${per} every {period[:-1]} for {count} {period}, "
        f"then spends ${spend} on a bicycle. How many dollars does {name} have left?"
    )
    return Problem("savings", question, f"{start} + {per} * {count} - {spend}", start + per * count - spend)


def _full_boxes(rng: random.Random) -> Problem:
    rows, plants, per_plant = rng.randint(3, 15), rng.randint(4, 20), rng.randint(3, 12)
    box = rng.choice([6, 8, 10, 12, 25])
    question = (
        f"A farm has {rows} rows of tomato plants with {plants} plants in each row. Every plant gives "
        f"{per_plant} tomatoes. The tomatoes are packed into boxes of {box}. How many boxes can be filled completely?"
    )
    expression = f"{rows} * {plants} * {per_plant} // {box}"
    return Problem("full_boxes", question, expression, rows * plants * per_plant // box)


def _leftover(rng: random.Random) -> Problem:
    packs, per_pack, students = rng.randint(3, 30), rng.choice([6, 10, 12, 24]), rng.randint(7, 40)
    question = (
        f"A school orders {packs} packs of {per_pack} pencils. The pencils are shared among {students} students so "
        "that everyone gets the same number and as many as possible. How many pencils are left over?"
    )
    return Problem("leftover", question, f"({packs} * {per_pack}) % {students}", (packs * per_pack) % students)


def _tickets(rng: random.Random) -> Problem:
    adults, children = rng.randint(1, 4), rng.randint(1, 6)
    adult_price, child_price = rng.randint(12, 40), rng.randint(5, 20)
    total = adults * adult_price + children * child_price
    coupon = rng.randint(1, total // 4)
    question = (
        f"A museum charges ${adult_price} per adult and ${child_price} per child. "
        f"A family of {_count(adults, 'adult', 'adults')} and {_count(children, 'child', 'children')} "
        f"uses a coupon worth ${coupon} off the total. How many dollars do they pay?"
    )
    return Problem(
        "tickets", question, f"{adults} * {adult_price} + {children} * {child_price} - {coupon}", total - coupon
    )


def _fuel_cost(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    distance, per_100, price = rng.choice(range(50, 601, 50)), rng.randint(4, 12), rng.randint(1, 3)
    question = (
        f"{name}'s car uses {per_100} litres of fuel per 100 km. {name} drives to a town {distance} km away and back "
        f"again. Fuel costs ${price} per litre. How many dollars does the fuel for the round trip cost?"
    )
    # 2 * distance is a multiple of 100, so the cost is a whole number.
    return Problem(
        "fuel_cost", question, f"2 * {distance} * {per_100} / 100 * {price}", 2 * distance * per_100 // 100 * price
    )


def _wages(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    hours, days, rate, bonus = rng.randint(3, 9), rng.randint(4, 22), rng.randint(9, 35), rng.randint(0, 200)
    question = (
        f"{name} works {hours} hours a day for {days} days and earns ${rate} per hour, plus a ${bonus} bonus. "
        f"How many dollars does {name} earn in total?"
    )
    return Problem("wages", question, f"{hours} * {days} * {rate} + {bonus}", hours * days * rate + bonus)


def _doubling(rng: random.Random) -> Problem:
    start, hours, removed = rng.randint(2, 50), rng.randint(3, 12), rng.randint(0, 20)
    removed = min(removed, start * 2**hours)
    question = (
        f"A colony of {start} bacteria doubles in size every hour. After {hours} hours, a scientist removes "
        f"{removed} bacteria for a test. How many bacteria are left?"
    )
    return Problem("doubling", question, f"{start} * 2 ** {hours} - {removed}", start * 2**hours - removed)


# The basic level: one operation on two numbers, each template with its own two numbers
# (the person and the item vary). A ~1M-parameter model picks the operation from the
# template's words within its build budget, but not a number from where it stands in the
# prompt, nor from a word that fixes it (measured: held-out greedy reward at chance level,
# 0.10-0.28, after 600-1500 SFT steps with 2-3 values per number, in story positions, at a
# fixed distance from the prompt's end, or fixed by the item and the name).
BASIC_NUMBERS = {"gets_more": (12, 3), "gives_away": (20, 5), "boxes_of": (6, 4)}


def _basic_numbers(rng: random.Random, template: str) -> tuple[str, str, int, int]:
    name = rng.choice(NAMES)
    one, many = rng.choice(ITEMS)
    return (name, many, *BASIC_NUMBERS[template])


def _gets_more(rng: random.Random) -> Problem:
    name, many, a, b = _basic_numbers(rng, "gets_more")
    question = f"{name} has {a} {many} and buys {b} more. How many {many} does {name} have now?"
    return Problem("gets_more", question, f"{a} + {b}", a + b)


def _gives_away(rng: random.Random) -> Problem:
    name, many, a, b = _basic_numbers(rng, "gives_away")
    question = f"{name} has {a} {many} and gives away {b}. How many {many} does {name} have left?"
    return Problem("gives_away", question, f"{a} - {b}", a - b)


def _boxes_of(rng: random.Random) -> Problem:
    name, many, a, b = _basic_numbers(rng, "boxes_of")
    question = f"{name} buys {a} boxes of {b} {many}. How many {many} does {name} buy?"
    return Problem("boxes_of", question, f"{a} * {b}", a * b)


BASIC_TEMPLATES: dict[str, Callable[[random.Random], Problem]] = {
    "gets_more": _gets_more,
    "gives_away": _gives_away,
    "boxes_of": _boxes_of,
}

TEMPLATES: dict[str, Callable[[random.Random], Problem]] = {
    "shopping_change": _shopping_change,
    "travel_distance": _travel_distance,
    "sharing": _sharing,
    "savings": _savings,
    "full_boxes": _full_boxes,
    "leftover": _leftover,
    "tickets": _tickets,
    "fuel_cost": _fuel_cost,
    "wages": _wages,
    "doubling": _doubling,
}

PROMPT_TEMPLATE = """Solve the following math word problem. Use the calculator tool for the arithmetic.

{instructions}

The final answer is a single integer, for example <answer>42</answer>.

Problem: {question}
"""


LEVELS = {"word": TEMPLATES, "basic": BASIC_TEMPLATES}


def _templates(level: str) -> dict[str, Callable[[random.Random], Problem]]:
    if level not in LEVELS:
        raise ValueError(f"level: must be one of {', '.join(LEVELS)}, got {level!r}")
    return LEVELS[level]


def sample_problems(n: int, seed: int, level: str = "word") -> list[Problem]:
    """``n`` problems of ``level`` drawn round-robin over its templates (in a seed-shuffled order)."""
    templates = _templates(level)
    rng = random.Random(seed)
    names = sorted(templates)
    rng.shuffle(names)
    return [templates[names[i % len(names)]](rng) for i in range(n)]


# The basic level's prompt: the same protocol in two lines. A very small model learns to
# find the problem's numbers in a prompt of ~60 tokens far sooner than among the ~370 of
# the full tool instructions (attention starts spread over every position).
BASIC_PROMPT_TEMPLATE = """Use the calculator: <tool_call>{{"name": "calculator", "arguments": {{"expression": "..."}}}}</tool_call>
Then answer with one integer: <answer>...</answer>

Problem: {question}
"""


def make_prompt(question: str, level: str = "word") -> str:
    if _templates(level) is BASIC_TEMPLATES:
        return BASIC_PROMPT_TEMPLATE.format(question=question)
    return PROMPT_TEMPLATE.format(instructions=render_instructions(TOOLS), question=question)


def generate(n: int, seed: int, level: str = "word") -> list[dict]:
    """``n`` rows ``{"prompt", "label"}``; the same (n, seed, level) always gives the same rows."""
    return [{"prompt": make_prompt(p.question, level), "label": str(p.answer)}
            for p in sample_problems(n, seed, level)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output JSONL file")
    parser.add_argument("--n", type=int, default=1000, help="number of problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--level", choices=sorted(LEVELS), default="word",
                        help="word: 2-4 operation word problems; basic: one operation on two numbers")
    args = parser.parse_args(argv)
    rows = generate(args.n, args.seed, args.level)
    out = Path(args.out)
    write_jsonl(out, rows)
    print(f"wrote {len(rows)} problems to {out}")


if __name__ == "__main__":
    main()
