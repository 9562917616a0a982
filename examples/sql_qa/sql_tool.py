"""The ``execute_sql`` tool: one read-only SELECT against a SQLite file.

Several independent guards, so that no model output can change the database or stall
the rollout worker:

1. an up-front check that refuses anything but a single SELECT / WITH ... SELECT
   statement, naming the offending keyword;
2. a read-only connection (``mode=ro`` URI);
3. an authorizer that denies every operation other than reading and calling functions;
4. a progress handler that interrupts long-running queries, and a cap on value sizes.

Results are capped at ``MAX_ROWS`` rows and rendered as text.
"""

from __future__ import annotations

import re
import sqlite3
import time
import sys
from pathlib import Path

# Loaded by path (OpenRLHF): put examples/common and this folder on sys.path (examples/README.md).
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(_HERE.parent / "common"), str(_HERE)) if p not in sys.path]

from tool_protocol import Param, Tool, ToolCallError  # noqa: E402

MAX_ROWS = 20
MAX_QUERY_CHARS = 2000
MAX_CELL_CHARS = 100
# SQLite virtual-machine instructions per query (checked every PROGRESS_PERIOD); a few
# hundred thousand cover any sensible query over this database.
MAX_VM_STEPS = 5_000_000
PROGRESS_PERIOD = 1000
MAX_VALUE_BYTES = 1_000_000
# Wall-clock bound of one query (checked with the VM steps): VM steps alone let a query whose
# steps are slow (a recursive CTE making megabyte blobs) run for minutes.
MAX_QUERY_SECONDS = 2.0
# Sorts and temporary tables stay in memory (never temp files on disk), bounded by SQLite's
# heap limit. The hard heap limit is per process (sqlite3_hard_heap_limit64): the example
# agents run in rollout actor processes where this tool is SQLite's only user.
HARD_HEAP_LIMIT_BYTES = 512 * 2**20

# Keywords that only occur in statements that write, change the schema or the
# connection; refused wherever they appear outside string literals and comments.
FORBIDDEN_KEYWORDS = frozenset(
    {
        "INSERT", "UPDATE", "DELETE", "DROP", "ALTER", "CREATE", "ATTACH", "DETACH", "PRAGMA",
        "VACUUM", "REINDEX", "ANALYZE", "BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE",
        "TRANSACTION", "UPSERT",
    }
)
_REPLACE_INTO = re.compile(r"\bREPLACE\s+INTO\b", re.IGNORECASE)
_ALLOWED_ACTIONS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, getattr(sqlite3, "SQLITE_RECURSIVE", 33)}
)


class SqlToolError(ToolCallError):
    """A refused or failed query; the message is shown to the model."""


def _mask_literals(query: str) -> str:
    """``query`` with string literals and quoted identifiers replaced by ``0``s and comments by spaces.

    What remains is SQL keywords, names, numbers and punctuation, which the statement
    checks can inspect without being fooled by ``'DROP'`` inside a string. The result
    has the same length as ``query``, so positions carry over.
    """
    out: list[str] = []
    i, n = 0, len(query)
    while i < n:
        ch = query[i]
        if ch in "'\"`":
            end = i + 1
            while True:
                end = query.find(ch, end)
                if end < 0:
                    kind = "string literal" if ch == "'" else "quoted identifier"
                    raise SqlToolError(f"unterminated {kind} starting at character {i}")
                if end + 1 < n and query[end + 1] == ch:  # doubled quote is an escaped quote
                    end += 2
                    continue
                break
            out.append("0" * (end + 1 - i))
            i = end + 1
        elif query.startswith("--", i):
            end = query.find("\n", i)
            end = n if end < 0 else end
            out.append(" " * (end - i))
            i = end
        elif query.startswith("/*", i):
            end = query.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append(" " * (end - i))
            i = end
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def check_query(query: str) -> str:
    """Return the query without trailing semicolons if it is one read-only SELECT; else raise SqlToolError."""
    if not isinstance(query, str) or not query.strip():
        raise SqlToolError("the query is empty; send one SELECT statement")
    if len(query) > MAX_QUERY_CHARS:
        raise SqlToolError(f"the query is too long ({len(query)} characters, limit {MAX_QUERY_CHARS})")
    code = _mask_literals(query)
    body_end = len(code.rstrip().rstrip(";").rstrip())
    if ";" in code[:body_end]:
        raise SqlToolError("multiple statements are not allowed; send one SELECT statement per call")
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code[:body_end])
    if not words:
        raise SqlToolError("no SQL statement found; send one SELECT statement")
    first = words[0].upper()
    if first not in ("SELECT", "WITH"):
        raise SqlToolError(
            f"{first} statements are refused: the database is read-only, only SELECT queries are allowed"
        )
    forbidden = sorted({w.upper() for w in words} & FORBIDDEN_KEYWORDS)
    if _REPLACE_INTO.search(code):
        forbidden.append("REPLACE INTO")
    if forbidden:
        raise SqlToolError(
            f"the query contains {', '.join(forbidden)}: the database is read-only, only SELECT queries are allowed"
        )
    return query[:body_end]


def _authorizer(action, arg1, arg2, db_name, trigger):
    return sqlite3.SQLITE_OK if action in _ALLOWED_ACTIONS else sqlite3.SQLITE_DENY


def _format_cell(value) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, bytes):
        return f"<blob of {len(value)} bytes>"
    if isinstance(value, float):
        text = repr(round(value, 6))
    else:
        text = str(value)
    text = text.replace("\n", " ")
    return text if len(text) <= MAX_CELL_CHARS else text[: MAX_CELL_CHARS - 3] + "..."


def render_rows(columns: list[str], rows: list[tuple], more: bool) -> str:
    if not rows:
        return " | ".join(columns) + "\n(no rows)"
    lines = [" | ".join(columns)] + [" | ".join(_format_cell(v) for v in row) for row in rows]
    if more:
        lines.append(f"(only the first {len(rows)} rows are shown; aggregate or add LIMIT to see fewer)")
    else:
        lines.append(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
    return "\n".join(lines)


def connect_read_only(db_path: str | Path) -> sqlite3.Connection:
    """A connection that can only read ``db_path`` (which must exist)."""
    path = Path(db_path).resolve()
    if not path.is_file():
        raise SqlToolError(f"database file not found: {path} (generate it with examples/sql_qa/dataset.py)")
    conn = sqlite3.connect(path.as_uri() + "?mode=ro", uri=True, timeout=5.0)
    conn.execute("PRAGMA temp_store = MEMORY")  # before the authorizer, which refuses PRAGMA
    conn.execute(f"PRAGMA hard_heap_limit = {HARD_HEAP_LIMIT_BYTES}")
    conn.set_authorizer(_authorizer)
    if hasattr(conn, "setlimit"):  # Python >= 3.11
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES)
    steps = {"n": 0}
    deadline = time.monotonic() + MAX_QUERY_SECONDS

    def _progress() -> int:
        steps["n"] += PROGRESS_PERIOD
        # non-zero interrupts the query
        return 1 if steps["n"] > MAX_VM_STEPS or time.monotonic() > deadline else 0

    conn.set_progress_handler(_progress, PROGRESS_PERIOD)
    return conn


def run_query(db_path: str | Path, query: str, max_rows: int = MAX_ROWS) -> str:
    """Run one checked SELECT read-only and render at most ``max_rows`` rows."""
    sql = check_query(query)
    conn = connect_read_only(db_path)
    try:
        cursor = conn.execute(sql)
        rows = cursor.fetchmany(max_rows + 1)
        columns = [d[0] for d in cursor.description or ()]
    except sqlite3.DatabaseError as exc:
        message = str(exc)
        if message == "interrupted":
            raise SqlToolError("the query ran too long and was stopped; simplify it") from None
        if "out of memory" in message:
            raise SqlToolError("the query needed too much memory and was stopped; simplify it") from None
        if "not authorized" in message:
            raise SqlToolError("the query was refused: only reading the database is allowed") from None
        raise SqlToolError(f"SQL error: {message}") from None
    finally:
        conn.close()
    return render_rows(columns, rows[:max_rows], more=len(rows) > max_rows)


def make_tools(db_path: str | Path) -> tuple[Tool, ...]:
    """The tool list bound to one database file."""

    def execute_sql(query: str) -> str:
        return run_query(db_path, query)

    return (
        Tool(
            name="execute_sql",
            description=(
                f"Runs one read-only SQLite SELECT query on the shop database and returns at most {MAX_ROWS} rows."
            ),
            params=(Param("query", str, "a single SELECT statement", example="SELECT COUNT(*) FROM customers"),),
            fn=execute_sql,
        ),
    )
