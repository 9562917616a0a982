"""The WAR rollout pool: async multi-turn episodes over engine actors, with per-turn
dispatch and a global suffix index (see :mod:`.pool`)."""

from .agents import check_step_result, load_agent_class
from .config import RolloutConfig
from .episode import run_episode, tool_error_text
from .pool import BatchResult, RolloutPool
from .trajectory import Trajectory, TurnRecord, to_experiences, to_openrlhf_response

__all__ = ["RolloutConfig", "RolloutPool", "BatchResult", "Trajectory", "TurnRecord", "run_episode",
           "load_agent_class", "check_step_result", "tool_error_text", "to_experiences",
           "to_openrlhf_response"]
