"""OpenRLHF agent for arithmetic word problems solved with a calculator tool.

Load it with ``--train.agent_func_path examples/arithmetic_calculator/agent.py``. Each
trajectory gets its own ``AgentInstance``; every model turn goes through ``step``:

- ``<answer>N</answer>`` ends the episode with reward 1.0 if N equals the label, else 0.0;
- ``<tool_call>{"name": "calculator", "arguments": {"expression": ...}}</tool_call>`` runs
  the calculator and returns its value in ``<tool_response>`` tags;
- a malformed call, or a turn with neither, gets an ``Error: ...`` observation and the
  episode goes on (OpenRLHF's context budget bounds the number of turns).
"""

from __future__ import annotations

import sys
from pathlib import Path


from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

# Loaded by path (OpenRLHF): put examples/common and this folder on sys.path (examples/README.md).
_HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(_HERE.parent / "common"), str(_HERE)) if p not in sys.path]

from calculator_tool import TOOLS  # noqa: E402
from tool_protocol import step_result, EpisodeStats, handle_action, numbers_equal, parse_number  # noqa: E402


def reward(answer_text: str, label: str) -> float:
    """1.0 when the answer holds exactly one number equal to the integer label ("$1,250" is 1250), else 0.0."""
    predicted = parse_number(answer_text)
    return 1.0 if predicted is not None and numbers_equal(predicted, float(label)) else 0.0


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.stats = EpisodeStats()

    async def reset(self, states: dict, **kwargs):
        self.stats = EpisodeStats()
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        return step_result(handle_action(states["action_text"], TOOLS), states, self.stats, reward)


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
