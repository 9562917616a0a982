"""Replay of synchronous GRPO steps to measure what a draft proposer buys.

Why a replay: acceptance of drafts depends on the text, not on the model that
produced it, so real agent transcripts replayed with greedy verification against
the recorded tokens measure tokens-per-verification-step faithfully, for any number
of engines, on a laptop.

Model (one verification step per tick for every decoding turn):

- A step's groups (all samples of a task) start together at tick 0; each group is
  placed whole on one engine by OpenRLHF's least-loaded dispatch (a min-heap of
  unfinished requests, load += samples), from a seeded shuffle of the prompts.
- Each tick, every decoding turn gets a draft of at most ``k`` tokens for its
  context; the engine accepts the longest prefix that matches the recorded response
  and emits it plus one token (never past the end of the response).
- A finished turn is reported to the proposer (WAR appends it to the global log);
  the trajectory's next turn starts after the environment delay.
- With several steps, each step takes its own slice of every task's trials, and
  placement is reshuffled, as a fresh dataloader batch would be.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from tqdm import tqdm

from ..config_checks import check_int, check_number
from ..dispatch.least_loaded import openrlhf_group_placement
from ..speculation.proposers import Proposer, TurnRequest
from ..traces import TokenizedTrajectory


@dataclass
class ReplayConfig:
    """Replay settings (see module docstring)."""

    engines: int = 8
    k: int = 16
    tool_delay_ticks: int = 8
    tool_delay_ticks_per_env_token: float = 0.0
    steps: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("engines", "k", "steps"):
            check_int("ReplayConfig", name, getattr(self, name), 1)
        check_int("ReplayConfig", "tool_delay_ticks", self.tool_delay_ticks, 0)
        check_number("ReplayConfig", "tool_delay_ticks_per_env_token", self.tool_delay_ticks_per_env_token, ge=0)


@dataclass
class ReplayResult:
    name: str
    generated_tokens: int = 0
    verification_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    ticks: int = 0
    turns: int = 0
    propose_seconds: float = 0.0
    per_step_ticks: list[int] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        return self.generated_tokens / self.verification_steps if self.verification_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def as_dict(self) -> dict:
        return {
            "tokens_per_step": self.tokens_per_step,
            "acceptance_rate": self.acceptance_rate,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "generated_tokens": self.generated_tokens,
            "verification_steps": self.verification_steps,
            "ticks": self.ticks,
            "per_step_ticks": self.per_step_ticks,
            "turns": self.turns,
            "propose_us_per_call": 1e6 * self.propose_seconds / max(1, self.verification_steps),
        }


def split_into_steps(
    groups: dict[str, list[TokenizedTrajectory]], steps: int
) -> list[dict[str, list[TokenizedTrajectory]]]:
    """Step s gets the s-th slice of every group's samples (trials)."""
    out: list[dict[str, list[TokenizedTrajectory]]] = [dict() for _ in range(steps)]
    for gid, trajs in groups.items():
        if len(trajs) < steps:
            raise ValueError(
                f"steps: group '{gid}' has {len(trajs)} samples, fewer than steps={steps}; lower --steps"
            )
        for s, chunk in enumerate(np.array_split(np.arange(len(trajs)), steps)):
            out[s][gid] = [trajs[i] for i in chunk]
    return out


@dataclass
class _Live:
    traj: TokenizedTrajectory
    engine: int
    turn: int = 0
    pos: int = 0
    ready_at: int = 0
    req: TurnRequest | None = None


def _propose(decoding: list[_Live], proposer: Proposer, step: int, k: int, result: ReplayResult) -> list:
    """Drafts for the whole batch, from the state at the start of the step (a turn's first
    step is its prefill, which samples its first token: no draft)."""
    drafts = []
    t0 = time.perf_counter()
    for lv in decoding:
        turn = lv.traj.turns[lv.turn]
        if lv.req is None:
            lv.req = TurnRequest(
                request_id=f"s{step}/{lv.traj.trajectory_id}/turn{lv.turn}",
                engine=lv.engine,
                trajectory_id=lv.traj.trajectory_id,
                group_id=lv.traj.group_id,
                prompt_token_ids=turn.context_token_ids,
            )
            proposer.start(lv.req)
            drafts.append([])  # the prefill step samples the first token
            continue
        context = np.concatenate([turn.context_token_ids, turn.response_token_ids[: lv.pos]])
        drafts.append(proposer.propose(lv.req, context, k))
    result.propose_seconds += time.perf_counter() - t0
    return drafts


def _verify(decoding: list[_Live], drafts: list, proposer: Proposer, result: ReplayResult, bar) -> list[_Live]:
    """Each draft checked against the recorded response; returns the requests whose turn ended."""
    finished = []
    for lv, draft in zip(decoding, drafts):
        resp = lv.traj.turns[lv.turn].response_token_ids
        remaining = int(resp.size) - lv.pos
        accepted = 0
        for tok in draft[:remaining]:
            if tok != resp[lv.pos + accepted]:
                break
            accepted += 1
        emitted = min(accepted + 1, remaining)
        result.draft_tokens += len(draft)
        result.accepted_tokens += min(accepted, remaining)
        result.generated_tokens += emitted
        result.verification_steps += 1
        bar.update(emitted)
        new = resp[lv.pos : lv.pos + emitted]
        lv.pos += emitted
        t0 = time.perf_counter()
        proposer.observe(lv.req, new)
        result.propose_seconds += time.perf_counter() - t0
        if lv.pos >= resp.size:
            finished.append(lv)
    return finished


def _finish_turns(finished: list[_Live], proposer: Proposer, step: int, tick: int, config: ReplayConfig,
                  result: ReplayResult) -> None:
    """Finished turns enter the index; the environment answers later."""
    for lv in finished:
        turn = lv.traj.turns[lv.turn]
        proposer.finish(lv.req, turn.response_token_ids, policy_version=step)
        result.turns += 1
        lv.turn += 1
        lv.pos = 0
        lv.req = None
        delay = config.tool_delay_ticks + int(config.tool_delay_ticks_per_env_token * turn.env_token_count)
        lv.ready_at = tick + 1 + delay


def replay(
    groups: dict[str, list[TokenizedTrajectory]],
    proposer: Proposer,
    config: ReplayConfig,
    progress: bool = False,
    on_step: Callable[[int, ReplayResult], None] | None = None,
) -> ReplayResult:
    """Run ``config.steps`` synchronous steps of ``groups`` with ``proposer``."""
    result = ReplayResult(name=proposer.name)
    rng = np.random.default_rng(config.seed)
    step_groups = split_into_steps(groups, config.steps)
    total_tokens = sum(int(t.response_token_ids.size) for g in groups.values() for tr in g for t in tr.turns)
    bar = tqdm(total=total_tokens, desc=f"{proposer.name:>18}", unit="tok", disable=not progress, leave=False)
    tick = 0
    for step, sgroups in enumerate(step_groups):
        gids = list(sgroups)
        order = rng.permutation(len(gids))
        gids = [gids[i] for i in order]
        placement = openrlhf_group_placement([len(sgroups[g]) for g in gids], config.engines)
        live = [_Live(tr, engine) for gid, engine in zip(gids, placement) for tr in sgroups[gid]]
        step_start = tick
        while live:
            decoding = [lv for lv in live if lv.ready_at <= tick]
            drafts = _propose(decoding, proposer, step, config.k, result)
            finished = _verify(decoding, drafts, proposer, result, bar)
            _finish_turns(finished, proposer, step, tick, config, result)
            live = [lv for lv in live if lv.turn < len(lv.traj.turns)]
            tick += 1
        result.per_step_ticks.append(tick - step_start)
        if on_step is not None:
            on_step(step, result)
    result.ticks = tick
    bar.close()
    return result
