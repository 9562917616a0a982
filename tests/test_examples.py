"""Tests of the tool-use example tasks under examples/: datasets, tools, rewards and agents.

The example files are loaded by path, the way OpenRLHF loads ``--train.agent_func_path``
files; helper modules are registered under their file names so that the agents' own
imports find the same module objects.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import re
import sqlite3
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TASKS = ("arithmetic_calculator", "sql_qa", "doc_lookup")


def _load(path: Path, name: str):
    """Import the file at ``path`` as module ``name`` (reusing it if already imported from there)."""
    module = sys.modules.get(name)
    if module is not None and Path(getattr(module, "__file__", "")).resolve() == path.resolve():
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


protocol = _load(EXAMPLES / "common" / "tool_protocol.py", "tool_protocol")
calc = _load(EXAMPLES / "arithmetic_calculator" / "calculator_tool.py", "calculator_tool")
shop_db = _load(EXAMPLES / "sql_qa" / "shop_db.py", "shop_db")
sql_tool = _load(EXAMPLES / "sql_qa" / "sql_tool.py", "sql_tool")
kb_corpus = _load(EXAMPLES / "doc_lookup" / "kb_corpus.py", "kb_corpus")
kb_search = _load(EXAMPLES / "doc_lookup" / "kb_search.py", "kb_search")
DATASETS = {t: _load(EXAMPLES / t / "dataset.py", f"example_{t}_dataset") for t in TASKS}
AGENTS = {t: _load(EXAMPLES / t / "agent.py", f"example_{t}_agent") for t in TASKS}
ar_ds, sql_ds, dl_ds = (DATASETS[t] for t in TASKS)


@pytest.fixture(autouse=True)
def _plain_feedback(monkeypatch):
    """The expected observations below use the default feedback format, whatever the environment says."""
    monkeypatch.setattr(protocol, "FEEDBACK_FORMAT", "plain")


def tool_call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class Episode:
    """Drives one AgentInstance through reset/step with hand-written actions."""

    def __init__(self, task: str, row: dict):
        self.row = row
        self.agent = AGENTS[task].AgentInstance()
        self.sampling_params = SimpleNamespace(max_tokens=64, logprobs=None)
        reset = asyncio.run(self.agent.reset({"observation": row["prompt"], "label": row["label"]}))
        self.observation = reset["observation"]

    def step(self, action: str) -> dict:
        result = asyncio.run(
            self.agent.step(
                {
                    "observation_text": self.observation,
                    "action_text": action,
                    "label": self.row["label"],
                    "sampling_params": self.sampling_params,
                }
            )
        )
        assert set(result) == {"rewards", "scores", "environment_feedback", "done", "sampling_params", "extra_logs"}
        assert isinstance(result["rewards"], torch.Tensor) and isinstance(result["scores"], torch.Tensor)
        assert result["sampling_params"] is self.sampling_params
        assert all(isinstance(v, float) for v in result["extra_logs"].values())
        self.observation += action + result["environment_feedback"]
        return result


@pytest.fixture(scope="module")
def shop(tmp_path_factory):
    """A database and 60 question rows over it."""
    db = tmp_path_factory.mktemp("sql_qa") / "shop.sqlite"
    rows = sql_ds.generate(60, seed=3, db_path=db)
    return db, rows


@pytest.fixture(scope="module")
def any_rows(shop):
    return {
        "arithmetic_calculator": ar_ds.generate(3, seed=0),
        "sql_qa": shop[1][:3],
        "doc_lookup": dl_ds.generate(3, seed=0),
    }


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------- the shared protocol
def test_answer_and_tool_call_extraction():
    assert protocol.extract_answer("so <answer> 42 </answer> done") == "42"
    assert protocol.extract_answer("<answer>42") == "42"  # a stop string may cut the close tag
    assert protocol.extract_answer("no tags") is None
    raw = protocol.extract_tool_call('x <tool_call>{"name": "a"}</tool_call> <tool_call>{"b": 1}</tool_call>')
    assert raw == '{"name": "a"}'
    assert protocol.extract_tool_call('<tool_call>{"name": "a"}') == '{"name": "a"}'


@pytest.mark.parametrize(
    "body, message",
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"', "not valid JSON"),
        ("[1, 2]", "must be a JSON object, got array"),
        ('{"arguments": {"expression": "1"}}', 'needs a "name"'),
        ('{"name": "eval", "arguments": {"expression": "1"}}', "unknown tool 'eval'; available tools: calculator"),
        ('{"name": "calculator"}', 'no "arguments"'),
        ('{"name": "calculator", "arguments": "1+1"}', '"arguments" of calculator must be a JSON object, got string'),
        ('{"name": "calculator", "arguments": {}}', "missing the required argument 'expression'"),
        ('{"name": "calculator", "arguments": {"expression": 7}}', "must be a string, got integer"),
        ('{"name": "calculator", "arguments": {"expression": true}}', "must be a string, got boolean"),
        ('{"name": "calculator", "arguments": {"expression": null}}', "must be a string, got null"),
        ('{"name": "calculator", "arguments": {"expression": "1", "x": 2}}', "unexpected argument(s) x"),
        ('{"name": "calculator", "arguments": {"expression": "1"}, "id": 3}', "unexpected key(s) in the tool call: id"),
    ],
)
def test_malformed_tool_calls_are_named(body, message):
    with pytest.raises(protocol.ToolCallError) as info:
        protocol.parse_tool_call(body, {t.name: t for t in calc.TOOLS})
    assert message in str(info.value)
    outcome = protocol.handle_action(f"<tool_call>{body}</tool_call>", calc.TOOLS)
    assert outcome.kind == "error" and "Error: " in outcome.feedback and message in outcome.feedback


def test_a_crashing_tool_becomes_an_error_observation():
    def broken(x: str) -> str:
        raise RuntimeError("disk on fire")

    tools = [protocol.Tool("broken", "always fails", (protocol.Param("x", str, "anything"),), broken)]
    outcome = protocol.handle_action(tool_call("broken", x="1"), tools)
    assert outcome.kind == "error" and "broken failed: RuntimeError: disk on fire" in outcome.feedback


def test_answer_takes_precedence_and_long_output_is_truncated():
    both = tool_call("calculator", expression="1+1") + "<answer>2</answer>"
    assert protocol.handle_action(both, calc.TOOLS).kind == "answer"
    tools = [protocol.Tool("big", "long output", (), lambda: "x" * 10_000)]
    outcome = protocol.handle_action('<tool_call>{"name": "big", "arguments": {}}</tool_call>', tools)
    assert outcome.kind == "tool" and "[truncated 6000 characters]" in outcome.feedback
    assert len(outcome.feedback) < protocol.MAX_RESPONSE_CHARS + 100


def test_chatml_feedback_format(monkeypatch):
    monkeypatch.setattr(protocol, "FEEDBACK_FORMAT", "chatml")
    outcome = protocol.handle_action(tool_call("calculator", expression="6 * 7"), calc.TOOLS)
    assert outcome.feedback == (
        "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_normalization():
    assert protocol.parse_number("$1,250") == 1250 and protocol.parse_number("42 km") == 42
    assert protocol.parse_number("-3.5") == -3.5 and protocol.parse_number("3 + 4") is None
    assert protocol.parse_number("1e999") is None and not protocol.numbers_equal(float("inf"), 5.0)
    assert protocol.parse_number("1,250,000") == 1_250_000
    assert protocol.normalize_text("  The Ada  QUIST. ") == "ada quist"
    assert protocol.normalize_text("48,200") == "48200"


# ---------------------------------------------------------------- datasets: rows, determinism, CLI
@pytest.mark.parametrize("task", TASKS)
def test_dataset_is_deterministic(task, tmp_path):
    module = DATASETS[task]
    kwargs = {"db_path": tmp_path / "shop.sqlite"} if task == "sql_qa" else {}
    first, again = module.generate(30, seed=5, **kwargs), module.generate(30, seed=5, **kwargs)
    other = module.generate(30, seed=6, **kwargs)
    assert first == again
    assert first != other
    for row in first:
        assert set(row) == {"prompt", "label"} and isinstance(row["prompt"], str) and isinstance(row["label"], str)
        assert "<tool_call>" in row["prompt"] and "<answer>" in row["prompt"]
        assert "<|im_start|>" not in row["prompt"]  # plain text, no chat template
    assert len({row["prompt"] for row in first}) >= 25


@pytest.mark.parametrize("task", TASKS)
def test_dataset_cli_writes_generate_rows(task, tmp_path):
    out = tmp_path / "rows.jsonl"
    subprocess.run(
        [sys.executable, str(EXAMPLES / task / "dataset.py"), "--out", str(out), "--n", "7", "--seed", "2"],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    kwargs = {"db_path": tmp_path / "shop_db0.sqlite"} if task == "sql_qa" else {}
    assert rows == DATASETS[task].generate(7, seed=2, **kwargs)


# ---------------------------------------------------------------- arithmetic_calculator
def test_arithmetic_labels_are_correct():
    problems = ar_ds.sample_problems(400, seed=11)
    rows = ar_ds.generate(400, seed=11)
    assert {p.template for p in problems} == set(ar_ds.TEMPLATES)
    for problem, row in zip(problems, rows):
        assert row["label"] == str(problem.answer) and problem.question in row["prompt"]
        # Three independent computations agree: the template's Python, our evaluator, Python's eval.
        assert calc.safe_eval(problem.expression) == problem.answer == eval(problem.expression)
        assert problem.answer >= 0
        # The expression only uses the story's numbers (plus 2 for "and back"/doubling and 100 for "per 100 km").
        story_numbers = set(re.findall(r"\d+", problem.question))
        assert set(re.findall(r"\d+", problem.expression)) - {"2", "100"} <= story_numbers
        n_ops = len(re.findall(r"\*\*|//|[-+*/%]", problem.expression))
        assert 2 <= n_ops <= 4, problem


def test_arithmetic_basic_level_is_one_operation_in_story_order_with_a_short_prompt():
    problems = ar_ds.sample_problems(300, seed=3, level="basic")
    rows = ar_ds.generate(300, seed=3, level="basic")
    assert {p.template for p in problems} == set(ar_ds.BASIC_TEMPLATES)
    for problem, row in zip(problems, rows):
        assert row["label"] == str(problem.answer) and problem.question in row["prompt"]
        assert calc.safe_eval(problem.expression) == problem.answer == eval(problem.expression) >= 0
        a, op, b = problem.expression.split()
        assert op in "+-*" and (int(a), int(b)) == ar_ds.BASIC_NUMBERS[problem.template]
        assert re.findall(r"\d+", problem.question) == [a, b]  # the numbers as the story states them
        assert "<tool_call>" in row["prompt"] and len(row["prompt"]) < len(ar_ds.make_prompt(problem.question)) / 3
    assert ar_ds.generate(5, seed=3) != ar_ds.generate(5, seed=3, level="basic")
    with pytest.raises(ValueError, match="level: must be one of"):
        ar_ds.generate(1, seed=0, level="hard")


_LEAF = st.one_of(
    st.integers(0, 1000).map(str),
    st.floats(0, 1000, allow_nan=False, allow_infinity=False).map(lambda x: repr(round(x, 3))),
    st.tuples(st.integers(0, 20), st.integers(0, 4)).map(lambda be: f"{be[0]} ** {be[1]}"),
)
_EXPRESSIONS = st.recursive(
    _LEAF,
    lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from(["+", "-", "*", "/", "//", "%"]), inner).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"
        ),
        inner.map(lambda e: f"-({e})"),
    ),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(_EXPRESSIONS)
def test_safe_eval_matches_python_eval(expression):
    try:
        expected = eval(expression)
    except ZeroDivisionError:
        with pytest.raises(calc.CalculatorError, match="division by zero"):
            calc.safe_eval(expression)
        return
    got = calc.safe_eval(expression)
    assert type(got) is type(expected)
    assert got == expected or (got != got and expected != expected)


@pytest.mark.parametrize(
    "expression, message",
    [
        ("__import__('os')", "function calls are not allowed"),
        ("__import__('os').system('true')", "function calls are not allowed"),
        ("(1).__class__", "attribute access is not allowed"),
        ("x + 1", "names are not allowed (found 'x')"),
        ("abs(-3)", "function calls are not allowed"),
        ("2 ** 1000", "exponent 1000 is too large"),
        ("9 ** 9 ** 9", "exponent 387420489 is too large"),
        ("10 ** 10 ** 10", "exponent 10000000000 is too large"),
        ("99 ** 99 * 99 ** 99 * 99 ** 99 * 99 ** 99", "too large"),
        ("1e400", "too large"),
        ("1 / 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("7 % 0", "division by zero"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("1j * 2", "only numbers are allowed"),
        ("[1, 2]", "unsupported syntax (List)"),
        ("1 if 2 else 3", "unsupported syntax (IfExp)"),
        ("lambda: 1", "unsupported syntax (Lambda)"),
        ("1 < 2", "unsupported syntax (Compare)"),
        ("6 & 3", "operator & is not supported"),
        ("~5", "operator ~ is not supported"),
        ("import os", "invalid syntax"),
        ("", "empty"),
        ("1+" * 150 + "1", "too long"),
    ],
)
def test_calculator_refuses_unsafe_or_huge_expressions(expression, message):
    with pytest.raises(calc.CalculatorError) as info:
        calc.safe_eval(expression)
    assert message in str(info.value)


def test_calculator_formats_results():
    assert calc.calculator("10 / 4") == "2.5" and calc.calculator("10 / 2") == "5"
    assert calc.calculator("-(2 + 3) * 4") == "-20" and calc.calculator("2 ** 10 // 3 % 7") == "5"


def test_arithmetic_episode():
    problem = ar_ds.sample_problems(1, seed=4)[0]
    row = ar_ds.generate(1, seed=4)[0]
    episode = Episode("arithmetic_calculator", row)
    result = episode.step(f"I'll compute it. {tool_call('calculator', expression=problem.expression)}")
    assert not result["done"] and result["rewards"].item() == 0.0
    assert result["environment_feedback"] == f"\n<tool_response>\n{problem.answer}\n</tool_response>\n"
    result = episode.step(f"The answer is <answer>{problem.answer}</answer>")
    assert result["done"] and result["rewards"].item() == 1.0 and result["scores"].item() == 1.0
    assert result["environment_feedback"] == ""
    assert result["extra_logs"] == {
        "turns": 2.0, "tool_calls": 1.0, "tool_errors": 0.0, "no_action_turns": 0.0, "answered": 1.0,
    }

    wrong = Episode("arithmetic_calculator", row).step(f"<answer>{problem.answer + 1}</answer>")
    assert wrong["done"] and wrong["rewards"].item() == 0.0


def test_arithmetic_reward():
    reward = AGENTS["arithmetic_calculator"].reward
    assert reward("1250", "1250") == reward("$1,250", "1250") == reward(" 1250.0 dollars", "1250") == 1.0
    assert reward("1251", "1250") == reward("", "1250") == reward("1250 or 1260", "1250") == 0.0
    assert reward("1e999", "1250") == reward("nan", "1250") == 0.0


def test_calculator_errors_reach_the_model():
    episode = Episode("arithmetic_calculator", ar_ds.generate(1, seed=0)[0])
    result = episode.step(tool_call("calculator", expression="__import__('os').system('echo hi')"))
    assert not result["done"] and "Error: calculator: function calls are not allowed" in result["environment_feedback"]
    assert result["extra_logs"]["tool_errors"] == 1.0


# ---------------------------------------------------------------- sql_qa
def _python_answer(question, tables) -> str:
    """The answer recomputed in Python from the raw table rows (no SQL)."""
    customers = {c[0]: c for c in tables["customers"]}  # id -> (id, name, city, signup_year)
    products = {p[0]: p for p in tables["products"]}  # id -> (id, name, category, price)
    orders = {o[0]: o for o in tables["orders"]}  # id -> (id, customer_id, date, status)
    items = tables["order_items"]  # (order_id, product_id, quantity)
    by_name = {c[1]: c[0] for c in customers.values()}
    product_id = {p[1]: p[0] for p in products.values()}

    def unique_best(counter: Counter) -> str:
        (best, n), *rest = counter.most_common()
        assert not rest or rest[0][1] < n, "the dataset must not ask about a tie"
        return best

    t, p = question.template, question.params
    if t == "customers_in_city":
        value = sum(c[2] == p[0] for c in customers.values())
    elif t == "orders_by_customer":
        value = sum(o[1] == by_name[p[0]] for o in orders.values())
    elif t == "delivered_units":
        value = sum(q for o, pid, q in items if pid == product_id[p[0]] and orders[o][3] == "delivered")
    elif t == "city_revenue":
        value = sum(
            q * products[pid][3]
            for o, pid, q in items
            if orders[o][3] == "delivered"
            and orders[o][2].startswith(f"{p[1]}-")
            and customers[orders[o][1]][2] == p[0]
        )
    elif t == "priciest_in_category":
        value = unique_best(Counter({pr[1]: pr[3] for pr in products.values() if pr[2] == p[0]}))
    elif t == "distinct_buyers":
        value = len({orders[o][1] for o, pid, _ in items if pid == product_id[p[0]]})
    elif t == "orders_in_month":
        value = sum(o[2].startswith(f"{p[0]}-{p[1]:02d}-") for o in orders.values())
    elif t == "top_spender":
        spent = Counter()
        for o, pid, q in items:
            if orders[o][3] == "delivered" and orders[o][2].startswith(f"{p[0]}-"):
                spent[customers[orders[o][1]][1]] += q * products[pid][3]
        value = unique_best(spent)
    elif t == "cancelled_in_city":
        value = sum(o[3] == "cancelled" and customers[o[1]][2] == p[0] for o in orders.values())
    elif t == "top_signup_city":
        value = unique_best(Counter(c[2] for c in customers.values() if c[3] == p[0]))
    else:
        raise AssertionError(f"no Python check for template {t}")
    return str(value)


def test_sql_labels_match_python_over_the_rows(shop):
    db, rows = shop
    tables = {name: shop_db.read_table(db, name) for name in shop_db.TABLES}
    assert [len(tables[t]) for t in ("customers", "products", "orders")] == [60, 40, 250]
    assert 250 <= len(tables["order_items"]) <= 1000
    questions = sql_ds.sample_questions(db, 200, seed=9)
    assert {q.template for q in questions} == set(sql_ds.TEMPLATES)
    for q in questions:
        assert q.answer == _python_answer(q, tables), q
    for row in rows:
        label = json.loads(row["label"])
        assert set(label) == {"answer", "db"} and Path(label["db"]) == db.resolve()


def test_sql_database_is_deterministic(tmp_path):
    a = shop_db.build_database(tmp_path / "a.sqlite", seed=1)
    b = shop_db.build_database(tmp_path / "b.sqlite", seed=1)
    c = shop_db.build_database(tmp_path / "c.sqlite", seed=2)
    for table in shop_db.TABLES:
        assert shop_db.read_table(a, table) == shop_db.read_table(b, table)
    assert shop_db.read_table(a, "orders") != shop_db.read_table(c, "orders")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.sqlite", "b.sqlite", "c.sqlite"]  # no temp files left


def test_sql_episode(shop):
    db, rows = shop
    questions = sql_ds.sample_questions(db, 60, seed=3)
    index, question = next((i, q) for i, q in enumerate(questions) if q.template == "customers_in_city")
    row = rows[index]
    assert question.text in row["prompt"]
    episode = Episode("sql_qa", row)
    city = question.params[0]
    result = episode.step(tool_call("execute_sql", query=f"SELECT COUNT(*) AS n FROM customers WHERE city = '{city}'"))
    assert not result["done"]
    assert result["environment_feedback"] == f"\n<tool_response>\nn\n{question.answer}\n(1 row)\n</tool_response>\n"
    result = episode.step(f"<answer>{question.answer}</answer>")
    assert result["done"] and result["rewards"].item() == 1.0

    wrong = Episode("sql_qa", row).step(f"<answer>{int(question.answer) + 1}</answer>")
    assert wrong["done"] and wrong["rewards"].item() == 0.0


def test_sql_reward_for_names_and_numbers(shop):
    db, _ = shop
    reward = AGENTS["sql_qa"].reward
    name_label = json.dumps({"answer": "Nordvik Kettle", "db": str(db)})
    assert reward("nordvik kettle.", name_label) == 1.0 and reward("Nordvik", name_label) == 0.0
    number_label = json.dumps({"answer": "4936", "db": str(db)})
    assert reward("$4,936", number_label) == reward("4936.0", number_label) == 1.0
    assert reward("4937", number_label) == 0.0
    with pytest.raises(ValueError, match="label must be JSON"):
        reward("1", "not json")


def test_sql_rows_are_capped_and_errors_are_observations(shop):
    db, rows = shop
    episode = Episode("sql_qa", rows[0])
    feedback = episode.step(tool_call("execute_sql", query="SELECT * FROM order_items"))["environment_feedback"]
    lines = feedback.strip().splitlines()
    assert lines[1] == "order_id | product_id | quantity" and len(lines) == 1 + 1 + sql_tool.MAX_ROWS + 1 + 1
    assert "only the first 20 rows are shown" in feedback
    result = episode.step(tool_call("execute_sql", query="SELECT * FROM flights"))
    assert not result["done"] and "Error: SQL error: no such table: flights" in result["environment_feedback"]
    endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
    result = episode.step(tool_call("execute_sql", query=endless))
    assert "ran too long and was stopped" in result["environment_feedback"]
    assert result["extra_logs"]["tool_errors"] == 2.0


DESTRUCTIVE = [
    ("DROP TABLE customers", "DROP statements are refused"),
    ("DELETE FROM orders", "DELETE statements are refused"),
    ("delete from orders where id > 0", "DELETE statements are refused"),
    ("INSERT INTO customers VALUES (999, 'Eve', 'Oslo', 2024)", "INSERT statements are refused"),
    ("UPDATE products SET price = 0", "UPDATE statements are refused"),
    ("ATTACH DATABASE '/tmp/evil.sqlite' AS evil", "ATTACH statements are refused"),
    ("SELECT 1; DROP TABLE customers", "multiple statements are not allowed"),
    ("SELECT * FROM orders; DELETE FROM orders;", "multiple statements are not allowed"),
    ("WITH x AS (SELECT 1) DELETE FROM orders", "the query contains DELETE"),
    ("WITH x AS (SELECT 1) REPLACE INTO products VALUES (1, 'x', 'y', 1)", "the query contains REPLACE INTO"),
    ("PRAGMA journal_mode = DELETE", "PRAGMA statements are refused"),
    ("CREATE TABLE t (x)", "CREATE statements are refused"),
    ("ALTER TABLE customers ADD COLUMN x", "ALTER statements are refused"),
    ("VACUUM", "VACUUM statements are refused"),
    ("SELECT 'a'; -- ok\nDROP TABLE orders", "multiple statements are not allowed"),
]


@pytest.mark.parametrize("query, message", DESTRUCTIVE)
def test_sql_destructive_statements_are_refused(shop, query, message):
    db, rows = shop
    before = _sha256(db)
    tables_before = {t: shop_db.read_table(db, t) for t in shop_db.TABLES}
    result = Episode("sql_qa", rows[0]).step(tool_call("execute_sql", query=query))
    assert not result["done"] and result["rewards"].item() == 0.0
    assert "Error: " in result["environment_feedback"] and message in result["environment_feedback"]
    assert _sha256(db) == before
    assert {t: shop_db.read_table(db, t) for t in shop_db.TABLES} == tables_before


def test_sql_connection_itself_cannot_write(shop):
    """Even a statement that slipped past the up-front check could not change the file."""
    db, _ = shop
    before = _sha256(db)
    conn = sql_tool.connect_read_only(db)
    try:
        for statement in ("DELETE FROM orders", "DROP TABLE customers", "PRAGMA user_version = 7",
                          "SELECT load_extension('x')"):
            with pytest.raises(sqlite3.DatabaseError):
                conn.execute(statement)
    finally:
        conn.close()
    assert _sha256(db) == before


def test_sql_strings_and_comments_do_not_trip_the_check(shop):
    db, _ = shop
    out = sql_tool.run_query(db, "SELECT 'DROP TABLE x; --' AS s -- trailing comment")
    assert out == "s\nDROP TABLE x; --\n(1 row)"
    assert sql_tool.run_query(db, "/* count */ SELECT COUNT(*) FROM products;") == "COUNT(*)\n40\n(1 row)"


def test_sql_missing_database_is_an_observation(shop, tmp_path):
    _, rows = shop
    label = json.dumps({"answer": "1", "db": str(tmp_path / "gone.sqlite")})
    episode = Episode("sql_qa", {"prompt": rows[0]["prompt"], "label": label})
    result = episode.step(tool_call("execute_sql", query="SELECT 1"))
    assert not result["done"] and "database file not found" in result["environment_feedback"]


# ---------------------------------------------------------------- doc_lookup
def test_doc_lookup_corpus():
    corpus = kb_corpus.build_corpus()
    assert len(corpus) == 200 and len({a.doc_id for a in corpus}) == 200 and len({a.title for a in corpus}) == 200
    assert Counter(a.kind for a in corpus) == {"city": 70, "company": 60, "product": 70}
    for article in corpus:
        for fact in article.facts:
            assert fact.answer in article.text and article.title in fact.question


# How each fact is read back from an article's text, independently of the generator's records.
FACT_PATTERNS = {
    ("city", "founded"): r"founded in (\d+)",
    ("city", "founder"): r"founded in \d+ by ([^,.]+),",
    ("city", "mayor"): r"current mayor of [^.]+ is ([^.]+)\.",
    ("city", "province"): r"in the province of ([^.]+)\.",
    ("city", "population"): r"population of ([\d,]+)\.",
    ("city", "festival_month"): r"Every year in (\w+) ",
    ("company", "founded"): r"founded in (\d+)",
    ("company", "founder"): r"founded in \d+ by ([^.]+)\.",
    ("company", "ceo"): r"chief executive is ([^.]+)\.",
    ("company", "headquarters"): r"headquartered in ([^.]+)\.",
    ("company", "employees"): r"employs ([\d,]+) people",
    ("product", "maker"): r"made by ([^.]+)\.",
    ("product", "released"): r"released in (\d+)",
    ("product", "price"): r"price of (\d+) credits",
    ("product", "weight"): r"weighs (\d+) grams",
    ("product", "color"): r"sold only in ([^.]+)\.",
    ("product", "designer"): r"lead designer of [^.]+ was ([^.]+)\.",
}


def test_doc_lookup_labels_come_from_the_right_article():
    corpus = {a.doc_id: a for a in kb_corpus.build_corpus()}
    questions = dl_ds.sample_questions(300, seed=1)
    assert len({q.text for q in questions}) == 300
    for q, row in zip(questions, dl_ds.generate(300, seed=1)):
        article = corpus[q.doc_id]
        assert row["label"] == q.answer and q.text in row["prompt"] and article.title in q.text
        matches = re.findall(FACT_PATTERNS[(article.kind, q.attribute)], article.text)
        assert matches == [q.answer], (q, article.text)


def test_search_recalls_the_answer_document_for_every_question():
    kb = kb_search.knowledge_base()
    questions = dl_ds.all_questions()
    assert len(questions) == 1140
    ranks = []
    for q in questions:
        ids = [hit.doc_id for hit in kb.index.search(q.text, k=kb_search.TOP_K)]
        assert q.doc_id in ids, q
        ranks.append(ids.index(q.doc_id))
    assert sum(r == 0 for r in ranks) / len(ranks) > 0.95


def test_search_and_open_tools():
    kb = kb_search.knowledge_base()
    article = kb_corpus.build_corpus()[17]
    results = kb.search(article.title).splitlines()
    assert 1 <= len(results) <= kb_search.TOP_K and results[0].startswith(f"1. {article.doc_id} | {article.title} | ")
    assert kb.open(article.doc_id) == f"{article.doc_id}: {article.title}\n\n{article.text}"
    assert kb.open(f"  {article.doc_id.upper()} ") == kb.open(article.doc_id)
    assert kb.search("zzzz qqqq").startswith("No articles matched")
    with pytest.raises(protocol.ToolCallError, match="unknown doc_id 'doc-999'"):
        kb.open("doc-999")
    with pytest.raises(protocol.ToolCallError, match="query is empty"):
        kb.search("   ")


def test_doc_lookup_episode():
    question = dl_ds.sample_questions(1, seed=8)[0]
    row = dl_ds.generate(1, seed=8)[0]
    episode = Episode("doc_lookup", row)
    result = episode.step(tool_call("search", query=question.text))
    assert not result["done"] and question.doc_id in result["environment_feedback"]
    result = episode.step(tool_call("open", doc_id=question.doc_id))
    assert not result["done"] and question.answer in result["environment_feedback"]
    result = episode.step(f"<answer>{question.answer.upper()}</answer>")
    assert result["done"] and result["rewards"].item() == 1.0
    assert result["extra_logs"]["tool_calls"] == 2.0 and result["extra_logs"]["turns"] == 3.0

    wrong = Episode("doc_lookup", row).step("<answer>Nobody Knows</answer>")
    assert wrong["done"] and wrong["rewards"].item() == 0.0


def test_doc_lookup_unknown_id_is_an_observation():
    episode = Episode("doc_lookup", dl_ds.generate(1, seed=0)[0])
    result = episode.step(tool_call("open", doc_id="doc-999"))
    assert not result["done"] and "Error: open: unknown doc_id 'doc-999'" in result["environment_feedback"]


# ---------------------------------------------------------------- all agents
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize(
    "action, message",
    [
        ('<tool_call>{"name": "search", "arguments": {</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown tool 'rm_rf'"),
        ('<tool_call>{"name": "{tool}", "arguments": {"{param}": 42}}</tool_call>', "must be a string, got integer"),
        ('<tool_call>{"name": "{tool}", "arguments": {}}</tool_call>', "missing the required argument"),
        ('<tool_call>{"name": "{tool}", "arguments": {"bogus": "x"}}</tool_call>', "unexpected argument(s) bogus"),
        ("I think the answer is 12.", "no tool call or answer found"),
        ("", "no tool call or answer found"),
    ],
)
def test_malformed_actions_get_error_observations(task, action, message, any_rows):
    episode = Episode(task, any_rows[task][0])
    tool = episode.agent.tools[0] if task != "arithmetic_calculator" else calc.TOOLS[0]
    action = action.replace("{tool}", tool.name).replace("{param}", tool.params[0].name)
    result = episode.step(action)
    assert result["done"] is False and result["rewards"].item() == 0.0
    feedback = result["environment_feedback"]
    assert feedback.startswith("\n<tool_response>\nError: ") and feedback.endswith("</tool_response>\n")
    assert message in feedback


@pytest.mark.parametrize("task", TASKS)
def test_agent_classes_follow_openrlhf(task):
    # Loaded exactly as OpenRLHF's _load_agent_executor does: by path, under the name "agent_module".
    spec = importlib.util.spec_from_file_location("agent_module", EXAMPLES / task / "agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert issubclass(module.AgentExecutor, MultiTurnAgentExecutor)
    assert issubclass(module.AgentInstance, AgentInstanceBase)
    assert module.AgentExecutor().agent_instance_cls is module.AgentInstance


class _CharTokenizer:
    """A character-level stand-in for a Hugging Face tokenizer (what the executor calls)."""

    def __call__(self, text, add_special_tokens=False, return_tensors="pt"):
        return {"input_ids": torch.tensor([[ord(c) for c in text]], dtype=torch.long)}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class _ScriptedEngine:
    """Returns the scripted actions in turn, like ``llm_engine.generate`` would."""

    def __init__(self, actions):
        self.actions = list(actions)
        self.prompts = []

    async def generate(self, prompt_token_ids, sampling_params, multi_modal_data=None):
        self.prompts.append("".join(chr(i) for i in prompt_token_ids))
        text = self.actions.pop(0)
        output = SimpleNamespace(token_ids=[ord(c) for c in text], text=text, finish_reason="stop", logprobs=None)
        return SimpleNamespace(outputs=[output])


def _scripted_actions(task, shop_rows):
    if task == "arithmetic_calculator":
        problem = ar_ds.sample_problems(1, seed=0)[0]
        row = ar_ds.generate(1, seed=0)[0]
        return row, [tool_call("calculator", expression=problem.expression), f"<answer>{problem.answer}</answer>"]
    if task == "sql_qa":
        row = shop_rows[0]
        answer = json.loads(row["label"])["answer"]
        return row, [tool_call("execute_sql", query="SELECT COUNT(*) FROM orders"), f"<answer>{answer}</answer>"]
    q = dl_ds.sample_questions(1, seed=0)[0]
    row = dl_ds.generate(1, seed=0)[0]
    return row, [tool_call("search", query=q.text), tool_call("open", doc_id=q.doc_id), f"<answer>{q.answer}</answer>"]


@pytest.mark.parametrize("task", TASKS)
def test_openrlhf_executor_runs_the_agent(task, shop):
    """OpenRLHF's own MultiTurnAgentExecutor.execute drives the agent to a reward of 1.0."""
    row, actions = _scripted_actions(task, shop[1])
    engine = _ScriptedEngine(actions)
    sampling_params = SimpleNamespace(max_tokens=256, logprobs=None)
    executor = AGENTS[task].AgentExecutor()
    out = asyncio.run(
        executor.execute(row["prompt"], row["label"], sampling_params, 100_000, _CharTokenizer(), engine)
    )
    assert out["reward"] == 1.0 and float(out["scores"]) == 1.0
    assert len(out["action_ranges"]) == len(actions) and not engine.actions
    assert out["extra_logs"]["answered"] == 1.0 and out["extra_logs"]["tool_errors"] == 0.0
    transcript = "".join(chr(i) for i in out["observation_tokens"])
    assert transcript.startswith(row["prompt"])
    assert transcript[len(row["prompt"]):].count("<tool_response>") == len(actions) - 1
    assert engine.prompts[-1].endswith("</tool_response>\n")


# ---------------------------------------------------------------------- hostile actions and queries
def _calc_tools():
    return calc.TOOLS if hasattr(calc, "TOOLS") else AGENTS["arithmetic_calculator"].TOOLS


def test_a_4301_digit_integer_in_a_tool_call_is_an_error_observation():
    out = protocol.handle_action(
        '<tool_call>{"name": "calculator", "arguments": {"expression": ' + "9" * 4301 + "}}</tool_call>",
        _calc_tools())
    assert out.kind == "error" and "Python cannot read" in out.feedback


def test_several_tool_calls_in_one_turn_are_refused_and_none_runs():
    ran = []
    tool = protocol.Tool("probe", "records calls", (protocol.Param("x", str, "x"),), fn=lambda x: ran.append(x) or x)
    out = protocol.handle_action(tool_call("probe", x="1") + tool_call("probe", x="2"), [tool])
    assert out.kind == "error" and "2 tool calls in one turn" in out.feedback and ran == []
    # inside <think> a call is reasoning, not an action
    out = protocol.handle_action("<think>" + tool_call("probe", x="0") + "</think>" + tool_call("probe", x="1"), [tool])
    assert out.kind == "tool" and ran == ["1"]


def test_an_answer_counts_only_outside_think_and_tool_calls():
    tool = protocol.Tool("echo", "echo", (protocol.Param("x", str, "x"),), fn=lambda x: x)
    assert protocol.handle_action("<think>it is <answer>3</answer></think>", [tool]).kind == "none"
    out = protocol.handle_action(tool_call("echo", x="<answer>4</answer>"), [tool])
    assert out.kind == "tool" and "<answer>4</answer>" in out.feedback
    assert protocol.handle_action("<think>hmm</think><answer>5</answer>", [tool]).answer == "5"
    assert protocol.handle_action("<think>unclosed <answer>6</answer>", [tool]).kind == "none"


_PIECES = st.sampled_from(list('<>/{}":,[] abc0123456789') + [
    "<tool_call>", "</tool_call>", "<answer>", "</answer>", "<think>", "</think>", '"name"', '"arguments"',
    '"calculator"', '"expression"', "9" * 5000, "1e999", "\\u0000"])


@settings(max_examples=300, deadline=None)
@given(st.lists(_PIECES, max_size=40).map("".join))
def test_handle_action_never_raises(text):
    out = protocol.handle_action(text, _calc_tools())
    assert out.kind in ("answer", "tool", "error", "none")


def test_sql_authorizer_refuses_every_write_and_attach_by_itself():
    """The authorizer alone (a writable in-memory connection, not the read-only file) refuses
    what the read-only connection would also refuse, so removing it fails this test."""
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (x)")
    conn.execute("INSERT INTO t VALUES (1)")
    conn.set_authorizer(sql_tool._authorizer)
    for stmt in ("CREATE TEMP TABLE u (x)", "INSERT INTO t VALUES (2)", "DELETE FROM t", "UPDATE t SET x = 3",
                 "DROP TABLE t", "ATTACH ':memory:' AS other", "PRAGMA writable_schema = 1",
                 "CREATE TEMP VIEW v AS SELECT 1"):
        with pytest.raises(sqlite3.DatabaseError, match="not authorized"):
            conn.execute(stmt)
    assert conn.execute("SELECT count(*) FROM t").fetchone() == (1,)
    assert conn.execute("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r WHERE i < 3) "
                        "SELECT sum(i) FROM r").fetchone() == (6,)


@pytest.mark.timeout(60)  # without its deadline the query runs for many minutes
def test_a_slow_query_is_stopped_by_the_wall_clock_deadline(tmp_path):
    import time

    db = shop_db.build_database(tmp_path / "shop.sqlite", seed=0)
    t0 = time.monotonic()
    with pytest.raises(sql_tool.SqlToolError, match="ran too long"):
        sql_tool.run_query(db, "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) "
                               "SELECT count(length(randomblob(999999))) FROM r")
    assert time.monotonic() - t0 < sql_tool.MAX_QUERY_SECONDS + 3.0
    # a large sort of random blobs stays in memory (no temp files) and inside the deadline
    t0 = time.monotonic()
    try:
        sql_tool.run_query(db, "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 3000) "
                               "SELECT length(randomblob(99999)) AS n FROM r ORDER BY randomblob(99999)")
    except sql_tool.SqlToolError as exc:
        assert "too long" in str(exc) or "too much memory" in str(exc)
    assert time.monotonic() - t0 < sql_tool.MAX_QUERY_SECONDS + 3.0
