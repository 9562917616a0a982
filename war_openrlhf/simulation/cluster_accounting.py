"""Accounting of a simulated run: conservation checks, the per-trajectory time split and the
metrics a :class:`~.cluster.SimResult` reports (the model: :mod:`.cluster`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Sequence, Tuple

import numpy as np

from ..dispatch.block_index import BLOCK_SIZE
from ..metrics.tail import tail_figures

if TYPE_CHECKING:
    from .cluster import _Traj
    from .cluster_engine import SimEngine, SimRequest


class ConservationError(RuntimeError):
    """A token, turn, request or KV block was lost or counted twice."""


# ---- conservation --------------------------------------------------------------------------
class Ledger:
    """Counts generated tokens and finished turns/trajectories; :meth:`verify` checks them."""

    def __init__(self, expected: Dict[Tuple[str, int], int], trajectory_turns: Dict[str, int]):
        self.expected = dict(expected)  # (trajectory id, turn) -> response tokens
        self.trajectory_turns = dict(trajectory_turns)
        self.generated: Dict[Tuple[str, int], int] = {}
        self.finished_turns: Dict[Tuple[str, int], int] = {}
        self.finished_trajectories: Dict[str, int] = {}

    def tokens(self, key: Tuple[str, int], count: int) -> None:
        """``count`` more tokens of turn ``key`` (one decode step may verify several)."""
        n = self.generated.get(key, 0) + count
        if n > self.expected.get(key, -1):
            raise ConservationError(f"turn {key} generated token {n} of "
                                    f"{self.expected.get(key)} (generated twice / unknown turn)")
        self.generated[key] = n

    def turn_finished(self, key: Tuple[str, int]) -> None:
        self.finished_turns[key] = self.finished_turns.get(key, 0) + 1
        if self.finished_turns[key] > 1:
            raise ConservationError(f"turn {key} finished twice")
        if self.generated.get(key, 0) != self.expected.get(key):
            raise ConservationError(f"turn {key} finished with {self.generated.get(key, 0)} of "
                                    f"{self.expected.get(key)} response tokens")

    def trajectory_finished(self, tid: str) -> None:
        self.finished_trajectories[tid] = self.finished_trajectories.get(tid, 0) + 1
        if self.finished_trajectories[tid] > 1:
            raise ConservationError(f"trajectory {tid!r} finished twice")

    def verify(self, outstanding_requests: int = 0, pinned_blocks: int = 0) -> None:
        if outstanding_requests:
            raise ConservationError(f"{outstanding_requests} requests still queued or running")
        if pinned_blocks:
            raise ConservationError(f"{pinned_blocks} KV blocks still pinned after the run")
        for key, n in self.expected.items():
            got = self.generated.get(key, 0)
            if got != n:
                raise ConservationError(f"turn {key}: {got} of {n} response tokens generated")
            if self.finished_turns.get(key, 0) != 1:
                raise ConservationError(f"turn {key} finished {self.finished_turns.get(key, 0)} "
                                        f"times")
        for key in self.generated:
            if key not in self.expected:
                raise ConservationError(f"tokens generated for unknown turn {key}")
        for tid in self.trajectory_turns:
            if self.finished_trajectories.get(tid, 0) != 1:
                raise ConservationError(f"trajectory {tid!r} finished "
                                        f"{self.finished_trajectories.get(tid, 0)} times")


def verify_drained(ledger: Ledger, engines: Sequence["SimEngine"]) -> None:
    """After the run: every token, turn and trajectory accounted for, every engine empty."""
    outstanding = sum(len(e.running) + len(e.waiting) for e in engines)
    pinned = sum(e.pinned_blocks() for e in engines)
    ledger.verify(outstanding, pinned)
    for e in engines:
        if e.queued_tokens != 0 or e.pending_turns != 0:
            raise ConservationError(f"engine {e.eid}: queued_tokens {e.queued_tokens}, "
                                    f"pending_turns {e.pending_turns} after the run")


# ---- metrics -------------------------------------------------------------------------------
@dataclass
class RunAccounts:
    """What a run measures: totals over the measured steps, and each trajectory's time split."""

    decision_s: List[float] = field(default_factory=list)  # policy.choose() wall-clock times
    turn_latency_s: List[float] = field(default_factory=list)  # dispatch to last token
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated: int = 0
    engine_changes: int = 0
    deferrals: int = 0
    step_spans: List[float] = field(default_factory=list)  # every step, warm-up included
    critical: List[dict] = field(default_factory=list)  # per measured step
    paths: Dict[str, dict] = field(default_factory=dict)  # trajectory id -> its time split

    def start_path(self, traj: "_Traj") -> None:
        self.paths[traj.tid] = {"trajectory": traj.tid, "turns": traj.turns, "engine": -1,
                                "start_s": None, "end_s": 0.0, "admission_wait_s": 0.0,
                                "tool_s": 0.0, "queue_s": 0.0, "prefill_s": 0.0,
                                "decode_s": 0.0, "prefill_tokens": 0}

    def count_turn(self, r: "SimRequest", now: float) -> None:
        """A measured turn finished at ``now``."""
        self.prompt_tokens += r.ctx_len
        self.cached_tokens += r.hit
        self.generated += r.resp_len
        self.turn_latency_s.append(now - r.t_dispatch)

    def add_turn_to_path(self, r: "SimRequest", engine: int, now: float) -> dict:
        """Split the finished turn's time into its trajectory's path; returns the path."""
        path = self.paths[r.traj.tid]
        path["queue_s"] += r.t_admit - r.t_dispatch
        path["prefill_s"] += r.t_prefilled - r.t_admit
        path["decode_s"] += now - r.t_prefilled
        path["prefill_tokens"] += r.ctx_len - r.hit
        path["engine"] = engine
        return path


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    neq = np.flatnonzero(a[:n] != b[:n])
    return int(neq[0]) if len(neq) else n


def oracle_hit_rate(trajs: Sequence["_Traj"], block_size: int = BLOCK_SIZE) -> Tuple[int, int]:
    """(oracle cached prompt tokens, prompt tokens): unlimited KV, perfect affinity."""
    first_ctx: Dict[str, np.ndarray] = {}
    cached = total = 0
    for t in trajs:
        for i in range(t.turns):
            ctx = t.ctxs[i]
            n = len(ctx)
            total += n
            if i > 0:
                prev = np.concatenate([t.ctxs[i - 1], t.resp_ids[i - 1]])
                shared = _common_prefix(ctx, prev)
            elif t.gid in first_ctx:
                shared = _common_prefix(ctx, first_ctx[t.gid])
            else:
                first_ctx[t.gid] = ctx
                shared = 0
            blocks = min(shared // block_size, (n - 1) // block_size)
            cached += blocks * block_size
    return cached, total


def critical_path(paths: List[dict], engines: Sequence["SimEngine"], busy_at_start: List[float]) -> dict:
    """The step's critical path: the trajectory that finished last, its time split into
    admission wait (deferred first turn), tool calls, queueing for a batch slot or KV, prefill
    and decode, how busy its last engine was compared with the others in this step, and the
    step's tail figures (:func:`~war_openrlhf.metrics.tail.tail_figures`). A
    straggler whose ``queue_s`` or ``prefill_s`` is large lost the step to placement; one
    whose ``tool_s`` + ``decode_s`` is nearly its whole span was bound by its own length."""
    last = max(paths, key=lambda p: p["end_s"])
    busy = [e.busy_s - b for e, b in zip(engines, busy_at_start)]
    out = dict(last)
    out.pop("start_s", None)
    eid = last["engine"]
    mean_busy = float(np.mean(busy)) if busy else 0.0
    out["engine_busy_s"] = busy[eid] if 0 <= eid < len(busy) else 0.0
    out["engine_busy_over_mean"] = out["engine_busy_s"] / mean_busy if mean_busy > 0 else 1.0
    spans = {k: last[k] for k in ("admission_wait_s", "tool_s", "queue_s", "prefill_s",
                                  "decode_s")}
    out["dominant"] = max(spans, key=spans.get)
    # ``end_s`` counts from the step's start, where every trajectory of a synchronous step arrives
    ends = [p["end_s"] for p in paths]
    out.update(tail_figures(ends, ends))
    return out


def percentile(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else 0.0
