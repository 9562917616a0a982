"""OpenRLHF agent for fact lookup in a local knowledge base with ``search`` and ``open`` tools.

Load it with ``--train.agent_func_path examples/doc_lookup/agent.py``. The knowledge base
(200 synthetic articles and their BM25 index) is rebuilt in memory once per process from
``kb_corpus.CORPUS_SEED``; each trajectory gets its own ``AgentInstance``:

- ``<answer>...</answer>`` ends the episode with reward 1.0 if it equals the label after
  normalization (case, punctuation, articles, spaces), else 0.0;
- ``<tool_call>{"name": "search", "arguments": {"query": ...}}</tool_call>`` returns the top
  articles (id | title | best sentence); ``open`` with ``{"doc_id": ...}`` returns one article;
- a malformed call, or a turn with neither, gets an ``Error: ...`` observation and the
  episode goes on.
"""

from __future__ import annotations

import sys
from pathlib import Path


from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

# Loaded by path (OpenRLHF): put examples/common and this folder on sys.path (examples/README.md).
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(_HERE.parent / "common"), str(_HERE)) if p not in sys.path]

from kb_search import knowledge_base  # noqa: E402
from tool_protocol import step_result, EpisodeStats, handle_action, normalize_text  # noqa: E402


def reward(answer_text: str, label: str) -> float:
    """1.0 for an exact match after normalization ("48,200" matches "48200", "The Ada Quist." matches "ada quist")."""
    return 1.0 if normalize_text(answer_text) == normalize_text(label) else 0.0


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.stats = EpisodeStats()
        self.tools = knowledge_base().tools()

    async def reset(self, states: dict, **kwargs):
        self.stats = EpisodeStats()
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        return step_result(handle_action(states["action_text"], self.tools), states, self.stats, reward)


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
