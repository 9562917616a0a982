"""What an episode produces, and its conversion to the samples OpenRLHF's trainer consumes.

A :class:`Trajectory` holds the whole token stream of one episode (prompt, every model turn,
every environment observation), an action mask (1 on tokens the model sampled, 0 on prompt
and environment tokens), the rollout logprob of every token (0 where the mask is 0), the
turn boundaries, rewards, and per turn the engine, timing and prefix-cache figures.

:func:`to_openrlhf_response` builds the dict OpenRLHF's ``MultiTurnAgentExecutor.execute``
returns, and :func:`to_experiences` runs it through OpenRLHF's own
``SamplesGenerator._process_response_into_experience``, so the trainer receives exactly what
its default rollout path would hand it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

END_REASONS = ("done", "max_turns", "max_context", "prompt_too_long", "tool_error", "engine_error",
               "episode_error", "agent_error")
#: Episodes that ended because the infrastructure or the agent file failed, not because of
#: what the policy did: they are retried, and never handed to the trainer as samples.
FAILED_END_REASONS = ("engine_error", "episode_error", "agent_error")


@dataclass
class TurnRecord:
    """One model turn of an episode."""

    index: int
    engine: int
    start: int  # offset of the first sampled token in Trajectory.token_ids
    end: int  # one past the last sampled token
    prompt_tokens: int
    cached_tokens: int  # prefix-cache hit reported by the engine
    finish_reason: str
    dispatched_s: float  # seconds since the batch started
    generate_s: float  # engine call, dispatch to last token
    tool_s: float = 0.0  # environment step after this turn
    attempts: int = 1  # >1: re-dispatched after an engine failure
    tool_error: str | None = None
    # weight versions the turn ran under (engine's count of weight syncs): one, or the
    # first and last when a sync landed mid-turn (OpenRLHF's partial rollouts)
    policy_versions: tuple[int, int] = (0, 0)
    # the dispatcher's estimate of cached_tokens on this engine before the turn (record_cache_estimates)
    estimated_cached_tokens: int | None = None
    # inside the engine (vLLM's request timestamps): waiting to be scheduled, then to the first token
    queue_s: float | None = None
    prefill_s: float | None = None


@dataclass
class Trajectory:
    trajectory_id: str
    group_id: str
    prompt: str
    label: Any
    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    reward: float = 0.0
    score: float | None = None
    end_reason: str = ""
    error: str | None = None
    extra_logs: dict[str, float] = field(default_factory=dict)
    truncated: bool = False
    wall_s: float = 0.0
    finished_s: float = 0.0  # when the episode ended, seconds since its batch started (the step's tail)

    @property
    def action_ranges(self) -> list[tuple[int, int]]:
        return [(t.start, t.end) for t in self.turns]

    @property
    def generated_tokens(self) -> int:
        return sum(self.action_mask)

    def check(self) -> None:
        """Invariants every consumer relies on; raises AssertionError naming the broken one."""
        n = len(self.token_ids)
        assert len(self.action_mask) == n, "action_mask length != token_ids length"
        assert len(self.logprobs) == n, "logprobs length != token_ids length"
        mask = [0] * n
        for t in self.turns:
            assert 0 <= t.start <= t.end <= n, f"turn {t.index} range {t.start}:{t.end} outside 0:{n}"
            for i in range(t.start, t.end):
                mask[i] = 1
        assert mask == list(self.action_mask), "action_mask is not exactly the turns' ranges"
        assert all(lp == 0.0 for lp, m in zip(self.logprobs, self.action_mask) if not m), \
            "non-zero logprob on an environment token"
        assert self.end_reason in END_REASONS, f"unknown end_reason {self.end_reason!r}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def to_openrlhf_response(traj: Trajectory) -> dict[str, Any]:
    """The dict OpenRLHF 0.11.2's ``MultiTurnAgentExecutor.execute`` returns for an episode."""
    return {
        "prompt": traj.prompt,
        "label": traj.label,
        "images": None,
        "mm_train_inputs": None,
        "reward": traj.reward,
        "scores": traj.score if traj.score is not None else traj.reward,
        "observation_tokens": list(traj.token_ids),
        "action_ranges": traj.action_ranges,
        "rollout_log_probs": list(traj.logprobs),
        "truncated": traj.truncated,
        "extra_logs": dict(traj.extra_logs),
    }


def to_experiences(trajectories: Sequence[Trajectory], max_len: int) -> list:
    """OpenRLHF ``Experience`` objects, built by OpenRLHF's own conversion code.

    Every experience gets the same ``info`` keys (:func:`uniform_info`): an episode whose tool
    failed before the agent logged anything would otherwise fail the whole step with "Size of
    info[...] does not match batch_size"."""
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator

    convert = SamplesGenerator._process_response_into_experience  # uses no instance state
    return uniform_info([convert(None, to_openrlhf_response(t), max_len=max_len) for t in trajectories])


def uniform_info(experiences: list) -> list:
    """Every experience with the same ``info`` keys (a key one lacks is 0.0): OpenRLHF batches
    experiences and needs each ``info`` key in all of them. Used per conversion and per
    training step (a step can hold two rollout batches whose scalars differ)."""
    import torch

    keys = set().union(*(e.info for e in experiences)) if experiences else set()
    for e in experiences:
        for k in keys - set(e.info):
            e.info[k] = torch.zeros(1)
    return experiences
