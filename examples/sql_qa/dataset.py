"""Questions over a SQLite shop database, with gold answers computed by SQL.

    python examples/sql_qa/dataset.py --out train.jsonl --n 2000 --seed 0

builds the database (``--db``, default ``shop_db<db_seed>.sqlite`` next to ``--out``;
its rows depend only on ``--db-seed``) and writes JSONL rows ``{"prompt": ..., "label": ...}``
where ``label`` is the JSON text ``{"answer": "<gold answer>", "db": "<absolute db path>"}``.
The agent opens the database named in the label, so each row is self-contained; keep the
database file at that path (or point the ``SQL_QA_DB`` environment variable at a copy).
"""

from __future__ import annotations

import argparse
import json
import random
import sqlite3
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# Loaded by path (OpenRLHF): put examples/common and this folder on sys.path (examples/README.md).
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(_HERE.parent / "common"), str(_HERE)) if p not in sys.path]

from jsonl import write_jsonl  # noqa: E402
from shop_db import SCHEMA, YEARS, build_database  # noqa: E402
from sql_tool import MAX_ROWS, make_tools  # noqa: E402
from tool_protocol import render_instructions  # noqa: E402

MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]


@dataclass(frozen=True)
class Question:
    """A question, the template and parameters it came from, and its gold answer (as text)."""

    template: str
    params: tuple
    text: str
    answer: str


@dataclass(frozen=True)
class _Facts:
    cities: list[str]
    customers: list[str]
    products: list[str]
    categories: list[str]


# Each template draws parameters and returns (parameters, question, SQL, SQL parameters,
# unique); ``unique`` asks for a check that the SQL's best row is not tied (the question
# is skipped and redrawn if it is).
_Template = Callable[[random.Random, _Facts], tuple[tuple, str, str, tuple, bool]]


def _customers_in_city(rng, facts):
    city = rng.choice(facts.cities)
    sql = "SELECT COUNT(*) FROM customers WHERE city = ?"
    return (city,), f"How many customers live in {city}?", sql, (city,), False


def _orders_by_customer(rng, facts):
    name = rng.choice(facts.customers)
    return (
        (name,),
        f"How many orders has the customer {name} placed, counting orders of every status?",
        "SELECT COUNT(*) FROM orders o JOIN customers c ON c.id = o.customer_id WHERE c.name = ?",
        (name,),
        False,
    )


def _delivered_units(rng, facts):
    product = rng.choice(facts.products)
    return (
        (product,),
        f"How many units of the product {product} have been delivered in total, "
        f"counting the quantities in orders whose status is 'delivered'?",
        "SELECT COALESCE(SUM(oi.quantity), 0) FROM order_items oi JOIN orders o ON o.id = oi.order_id "
        "JOIN products p ON p.id = oi.product_id WHERE p.name = ? AND o.status = 'delivered'",
        (product,),
        False,
    )


def _city_revenue(rng, facts):
    city, year = rng.choice(facts.cities), rng.choice(YEARS)
    return (
        (city, year),
        f"What was the total revenue in dollars from delivered orders placed in {year} by customers living in "
        f"{city}? The revenue of an order line is its quantity times the product's price.",
        "SELECT COALESCE(SUM(oi.quantity * p.price), 0) FROM order_items oi JOIN orders o ON o.id = oi.order_id "
        "JOIN products p ON p.id = oi.product_id JOIN customers c ON c.id = o.customer_id "
        "WHERE c.city = ? AND o.status = 'delivered' AND substr(o.order_date, 1, 4) = ?",
        (city, str(year)),
        False,
    )


def _priciest_in_category(rng, facts):
    category = rng.choice(facts.categories)
    return (
        (category,),
        f"What is the name of the most expensive product in the {category} category?",
        "SELECT name, price FROM products WHERE category = ? ORDER BY price DESC LIMIT 2",
        (category,),
        True,
    )


def _distinct_buyers(rng, facts):
    product = rng.choice(facts.products)
    return (
        (product,),
        f"How many different customers have ordered the product {product}, counting orders of every status?",
        "SELECT COUNT(DISTINCT o.customer_id) FROM order_items oi JOIN orders o ON o.id = oi.order_id "
        "JOIN products p ON p.id = oi.product_id WHERE p.name = ?",
        (product,),
        False,
    )


def _orders_in_month(rng, facts):
    year, month = rng.choice(YEARS), rng.randint(1, 12)
    return (
        (year, month),
        f"How many orders were placed in {MONTHS[month - 1]} {year}?",
        "SELECT COUNT(*) FROM orders WHERE order_date LIKE ?",
        (f"{year:04d}-{month:02d}-%",),
        False,
    )


def _top_spender(rng, facts):
    year = rng.choice(YEARS)
    return (
        (year,),
        f"Which customer spent the most money on delivered orders placed in {year}? Give the customer's name.",
        "SELECT c.name, SUM(oi.quantity * p.price) AS spent FROM order_items oi JOIN orders o ON o.id = oi.order_id "
        "JOIN products p ON p.id = oi.product_id JOIN customers c ON c.id = o.customer_id "
        "WHERE o.status = 'delivered' AND substr(o.order_date, 1, 4) = ? GROUP BY c.id ORDER BY spent DESC LIMIT 2",
        (str(year),),
        True,
    )


def _cancelled_in_city(rng, facts):
    city = rng.choice(facts.cities)
    return (
        (city,),
        f"How many orders placed by customers living in {city} were cancelled?",
        "SELECT COUNT(*) FROM orders o JOIN customers c ON c.id = o.customer_id "
        "WHERE c.city = ? AND o.status = 'cancelled'",
        (city,),
        False,
    )


def _top_signup_city(rng, facts):
    year = rng.choice((2019, 2020, 2021, 2022, 2023))
    return (
        (year,),
        f"In which city do the most customers live among those who signed up in {year}?",
        "SELECT city, COUNT(*) AS n FROM customers WHERE signup_year = ? GROUP BY city ORDER BY n DESC LIMIT 2",
        (year,),
        True,
    )


TEMPLATES: dict[str, _Template] = {
    "customers_in_city": _customers_in_city,
    "orders_by_customer": _orders_by_customer,
    "delivered_units": _delivered_units,
    "city_revenue": _city_revenue,
    "priciest_in_category": _priciest_in_category,
    "distinct_buyers": _distinct_buyers,
    "orders_in_month": _orders_in_month,
    "top_spender": _top_spender,
    "cancelled_in_city": _cancelled_in_city,
    "top_signup_city": _top_signup_city,
}

PROMPT_TEMPLATE = """Answer the question about an online shop by querying its SQLite database.

Database schema:
{schema}
{instructions}

The database is read-only, each call runs one SELECT statement, and at most {max_rows} rows are shown.
Answer with just the value: a number (for example <answer>42</answer>) or a name (for example <answer>Oslo</answer>).

Question: {question}
"""


def default_db_path(db_seed: int = 0) -> Path:
    """Where :func:`generate` puts the database when no path is given."""
    return Path(tempfile.gettempdir()) / "war_openrlhf_examples" / f"shop_db{db_seed}.sqlite"


def _answer_text(value) -> str:
    return str(int(value)) if isinstance(value, (int, float)) and float(value).is_integer() else str(value)


def sample_questions(db_path: str | Path, n: int, seed: int) -> list[Question]:
    """``n`` questions over the database at ``db_path``, answered by SQL (distinct while possible)."""
    conn = sqlite3.connect(Path(db_path).resolve().as_uri() + "?mode=ro", uri=True)
    try:
        facts = _Facts(
            cities=[r[0] for r in conn.execute("SELECT DISTINCT city FROM customers ORDER BY city")],
            customers=[r[0] for r in conn.execute("SELECT name FROM customers ORDER BY id")],
            products=[r[0] for r in conn.execute("SELECT name FROM products ORDER BY id")],
            categories=[r[0] for r in conn.execute("SELECT DISTINCT category FROM products ORDER BY category")],
        )
        rng = random.Random(seed)
        names = sorted(TEMPLATES)
        rng.shuffle(names)
        questions: list[Question] = []
        seen: set[str] = set()
        for i in range(n):
            question = None
            # Start at this row's template; move on to the next if it has no usable question.
            for offset in range(len(names)):
                template = names[(i + offset) % len(names)]
                for _attempt in range(50):
                    params, text, sql, sql_params, unique = TEMPLATES[template](rng, facts)
                    rows = conn.execute(sql, sql_params).fetchall()
                    if unique and (not rows or (len(rows) > 1 and rows[0][1] == rows[1][1])):
                        continue  # tied or empty: the question would have no single answer
                    question = Question(template, params, text, _answer_text(rows[0][0]))
                    if text not in seen:
                        break
                if question is not None and question.text not in seen:
                    break
            if question is None:
                raise RuntimeError("no template produced an unambiguous question")
            seen.add(question.text)
            questions.append(question)
        return questions
    finally:
        conn.close()


def make_prompt(question: str, db_path: str | Path) -> str:
    return PROMPT_TEMPLATE.format(
        schema=SCHEMA,
        instructions=render_instructions(make_tools(db_path)),
        max_rows=MAX_ROWS,
        question=question,
    )


def generate(n: int, seed: int, db_path: str | Path | None = None, db_seed: int = 0) -> list[dict]:
    """Build the database (``db_seed``) at ``db_path`` and return ``n`` rows ``{"prompt", "label"}``."""
    path = build_database(db_path if db_path is not None else default_db_path(db_seed), db_seed)
    return [
        {"prompt": make_prompt(q.text, path), "label": json.dumps({"answer": q.answer, "db": str(path)})}
        for q in sample_questions(path, n, seed)
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output JSONL file")
    parser.add_argument("--n", type=int, default=1000, help="number of questions")
    parser.add_argument("--seed", type=int, default=0, help="seed of the questions")
    parser.add_argument("--db-seed", type=int, default=0, help="seed of the database rows")
    parser.add_argument("--db", default=None, help="database file (default: shop_db<db_seed>.sqlite next to --out)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    db_path = Path(args.db) if args.db else out.resolve().parent / f"shop_db{args.db_seed}.sqlite"
    rows = generate(args.n, args.seed, db_path=db_path, db_seed=args.db_seed)
    write_jsonl(out, rows)
    print(f"wrote {len(rows)} questions to {out} (database: {db_path.resolve()})")


if __name__ == "__main__":
    main()
