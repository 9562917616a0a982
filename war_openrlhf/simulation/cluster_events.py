"""The simulator's event loop: turn arrivals and engine steps on one clock, across the
synchronous steps of a run (the model: :mod:`.cluster`)."""

from __future__ import annotations

import heapq
import math
from collections import deque
from time import perf_counter
from typing import TYPE_CHECKING, Dict, List, Sequence

import numpy as np

from ..dispatch import DEFER, DispatchPolicy, TurnRequest
from ..dispatch.turn_priority import TurnPriorities
from .cluster_accounting import ConservationError, Ledger, RunAccounts, critical_path
from .cluster_engine import SimEngine, SimRequest

if TYPE_CHECKING:
    from .cluster import SimConfig, _Traj

#: Event kinds; an event is ``(time, seq, kind, a, b)``: an engine step ending (``a`` the
#: engine id) or a trajectory's turn arriving (``a`` the trajectory, ``b`` the turn).
#: ``seq`` numbers events in the order they were made, so equal times resolve the same way.
_STEP, _ARRIVE = 0, 1


class EventLoop:
    """Runs the steps of one simulation; the clock and event numbering carry across steps."""

    def __init__(self, config: "SimConfig", engines: List[SimEngine], policy: DispatchPolicy,
                 ledger: Ledger, jitter: Dict[str, np.ndarray], accounts: RunAccounts) -> None:
        self.cfg = config
        self.engines = engines
        self.pol = policy
        self.ledger = ledger
        self.jitter = jitter  # trajectory id -> per-turn tool delay factor
        self.acc = accounts
        self.now = 0.0
        self.seq = 0
        self.last_engine: Dict[str, int] = {}
        self.tokens_so_far: Dict[str, int] = {}
        # the step being run
        self.heap: List[tuple] = []
        self.deferred: deque = deque()  # first turns the policy deferred, in arrival order
        self.t0 = 0.0
        self.measured = False
        self.live = 0
        # turn_priority longest_first: each turn's vLLM priority, as the pool computes it
        self.priorities = TurnPriorities() if config.turn_priority == "longest_first" else None
        if self.priorities is not None and config.turn_priority_history:
            self.priorities.seed(config.turn_priority_history)

    def _push(self, when: float, kind: int, a, b: int) -> None:
        heapq.heappush(self.heap, (when, self.seq, kind, a, b))
        self.seq += 1

    def run_step(self, s: int, step_trajs: Sequence["_Traj"], measured: bool) -> None:
        """Start every trajectory of step ``s`` now and run until the last one ends."""
        engines, acc = self.engines, self.acc
        t0 = self.t0 = self.now
        self.measured = measured
        busy_at_start = [e.busy_s for e in engines]
        self.pol.start_batch()
        if self.priorities is not None:
            self.priorities.start_batch()
        heap: List[tuple] = []
        for t in step_trajs:
            heap.append((t0, self.seq, _ARRIVE, t, 0))
            self.seq += 1
            self.tokens_so_far[t.tid] = 0
            acc.start_path(t)
        heapq.heapify(heap)
        self.heap = heap
        self.live = len(step_trajs)
        self.deferred = deque()
        now = t0
        while heap:
            now, _, kind, a, b = heapq.heappop(heap)
            if kind == _ARRIVE:
                self._arrive(a, b, now)
            else:
                self._engine_step_done(engines[a], now)
            if not heap and self.deferred:
                raise ConservationError(f"step {s}: {len(self.deferred)} deferred trajectories "
                                        f"never admitted (policy deferred with no live work)")
        if self.live != 0:
            raise ConservationError(f"step {s}: {self.live} trajectories never finished")
        self.now = now
        acc.step_spans.append(now - t0)
        if measured:
            acc.critical.append(critical_path([acc.paths[t.tid] for t in step_trajs], engines,
                                              busy_at_start))

    def _arrive(self, traj: "_Traj", turn: int, now: float) -> None:
        if turn > 0:
            self.engines[self.last_engine[traj.tid]].pending_turns -= 1
        if self.deferred and turn == 0:  # behind the deferred first turns (offered in admission order)
            self.deferred.append(traj)
        elif not self._dispatch(traj, turn, now):
            self.deferred.append(traj)

    def _dispatch(self, traj: "_Traj", turn: int, now: float) -> bool:
        """One choose() call; False if the policy deferred the turn."""
        acc, engines = self.acc, self.engines
        prev = self.last_engine.get(traj.tid)
        req = TurnRequest(traj.tid, traj.gid, traj.ctxs[turn], turn,
                          self.tokens_so_far[traj.tid], arrival_s=now)
        states = [e.state() for e in engines]
        c0 = perf_counter()
        eid = self.pol.choose(req, states)
        if self.measured:
            acc.decision_s.append(perf_counter() - c0)
        if eid == DEFER:
            if turn != 0:
                raise ConservationError(f"policy deferred turn {turn} of {traj.tid!r}: "
                                        f"only first turns may be deferred")
            if self.measured:
                acc.deferrals += 1
            return False
        if not (isinstance(eid, (int, np.integer)) and 0 <= eid < len(engines)):
            raise ConservationError(f"policy returned engine {eid!r}")
        eid = int(eid)
        if turn > 0 and eid != prev and self.measured:
            acc.engine_changes += 1
        eng = engines[eid]
        if turn == 0:
            acc.paths[traj.tid]["admission_wait_s"] = now - self.t0
        r = SimRequest(traj, turn, req, now, eng.bs)
        if self.priorities is not None:
            r.priority = self.priorities.priority(traj.tid, traj.gid, turn)
        r.batch = len(eng.running) + len(eng.waiting)
        eng.enqueue(r)
        if eng.sched is None:
            self._push(now + self._plan(eng, now), _STEP, eid, 0)
        return True

    def _plan(self, eng: SimEngine, now: float) -> float:
        """``eng``'s next step and its duration, stretched by the engines computing beside it
        where they share the machine (``CostModel.contention``; 1: independent accelerators)."""
        extra = eng.cost.contention - 1.0
        if extra == 0.0 or len(self.engines) == 1:
            return eng.plan_step(now)
        others = sum(1 for e in self.engines if e is not eng and e.sched is not None)
        return eng.plan_step(now, 1.0 + extra * others / (len(self.engines) - 1))

    def _engine_step_done(self, eng: SimEngine, now: float) -> None:
        finished_any = False
        for r in eng.finish_step(self.ledger, now):
            finished_any = True
            self._turn_done(eng, r, now)
        if eng.running or eng.waiting:
            self._push(now + self._plan(eng, now), _STEP, eng.eid, 0)
        while finished_any and self.deferred:
            head = self._next_deferred()
            if not self._dispatch(head, 0, now):
                break
            self.deferred.remove(head)

    def _next_deferred(self) -> "_Traj":
        """The deferred first turn offered next: the policy's highest ``admission_priority``,
        then arrival (the pool's order, ``TurnRouter.notify``)."""
        if not self.pol.orders_admission or len(self.deferred) == 1:
            return self.deferred[0]
        prio = self.pol.admission_priority
        best, best_p = None, -math.inf
        for t in self.deferred:  # arrival order: the first of equals wins
            p = prio(TurnRequest(t.tid, t.gid, t.ctxs[0], 0, 0))
            if p > best_p:
                best, best_p = t, p
        return best

    def _turn_done(self, eng: SimEngine, r: SimRequest, now: float) -> None:
        """The turn's last token came out at ``now``: tell the policy, schedule the next turn."""
        if self.measured:
            self.acc.count_turn(r, now)
        self.ledger.turn_finished(r.key)
        traj = r.traj
        path = self.acc.add_turn_to_path(r, eng.eid, now)
        pol = self.pol
        pol.on_turn_finished(r.request, eng.eid, traj.resp_ids[r.turn])
        pol.observe_turn(eng.eid, prompt_tokens=r.ctx_len, cached_tokens=r.hit,
                         response_tokens=r.resp_len,
                         latency_s=now - r.t_dispatch, batch=r.batch,
                         trajectory_id=traj.tid)
        self.last_engine[traj.tid] = eng.eid
        self.tokens_so_far[traj.tid] += r.resp_len
        if r.turn + 1 < traj.turns:
            eng.pending_turns += 1
            delay = self._tool_delay(traj, r.turn)
            path["tool_s"] += delay
            self._push(now + delay, _ARRIVE, traj, r.turn + 1)
        else:
            path["end_s"] = now - self.t0
            self.ledger.trajectory_finished(traj.tid)
            pol.on_trajectory_finished(traj.tid)
            if self.priorities is not None:
                self.priorities.finished(traj.tid, traj.gid, traj.turns)
            self.live -= 1

    def _tool_delay(self, traj: "_Traj", turn: int) -> float:
        """Seconds between turn ``turn``'s end and the next turn's arrival."""
        if traj.delays is not None:
            return traj.delays[turn]
        cfg = self.cfg
        return ((cfg.tool_delay_s + cfg.per_env_token_s * traj.env[turn])
                * self.jitter[traj.tid][turn])
