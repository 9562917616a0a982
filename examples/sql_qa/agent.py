"""OpenRLHF agent for question answering over a SQLite database with an ``execute_sql`` tool.

Load it with ``--train.agent_func_path examples/sql_qa/agent.py``. The label of each
prompt is the JSON text ``{"answer": ..., "db": <path>}`` written by ``dataset.py``; the
``SQL_QA_DB`` environment variable, when set, replaces the path (for a moved database).

- ``<answer>...</answer>`` ends the episode with reward 1.0 if it matches the gold answer
  (numerically for numbers, after normalization for names), else 0.0;
- ``<tool_call>{"name": "execute_sql", "arguments": {"query": ...}}</tool_call>`` runs one
  read-only SELECT and returns at most 20 rows in ``<tool_response>`` tags;
- a malformed call, a refused or failing query, or a turn with neither gets an
  ``Error: ...`` observation and the episode goes on.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path


from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

# Loaded by path (OpenRLHF): put examples/common and this folder on sys.path (examples/README.md).
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(_HERE.parent / "common"), str(_HERE)) if p not in sys.path]

from sql_tool import make_tools  # noqa: E402
from tool_protocol import step_result, EpisodeStats, handle_action, normalize_text, numbers_equal, parse_number  # noqa: E402

DB_ENV_VAR = "SQL_QA_DB"


def parse_label(label: str) -> tuple[str, str]:
    """(gold answer, database path) from a label written by dataset.py."""
    try:
        data = json.loads(label)
        answer, db = data["answer"], data["db"]
    except (json.JSONDecodeError, TypeError, KeyError) as exc:
        raise ValueError(f'sql_qa label must be JSON {{"answer": ..., "db": ...}}, got {label!r}') from exc
    return str(answer), os.environ.get(DB_ENV_VAR) or str(db)


def reward(answer_text: str, label: str) -> float:
    """1.0 for a correct answer, else 0.0: numeric comparison for a numeric gold answer, normalized text otherwise."""
    gold, _ = parse_label(label)
    if re.fullmatch(r"-?\d+(\.\d+)?", gold.strip()):
        predicted = parse_number(answer_text)
        return 1.0 if predicted is not None and numbers_equal(predicted, float(gold)) else 0.0
    return 1.0 if normalize_text(answer_text) == normalize_text(gold) else 0.0


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.stats = EpisodeStats()
        self.tools = ()

    async def reset(self, states: dict, **kwargs):
        self.stats = EpisodeStats()
        _, db_path = parse_label(states["label"])
        self.tools = make_tools(db_path)
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        return step_result(handle_action(states["action_text"], self.tools), states, self.stats, reward)


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
