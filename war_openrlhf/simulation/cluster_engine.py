"""The simulated engines: vLLM-like continuous batching and prefix-cached KV blocks (the
model: :mod:`.cluster`)."""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from itertools import count
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import numpy as np

from ..dispatch import EngineState, TurnRequest
from ..dispatch.block_index import BLOCK_SIZE
from .cluster_accounting import ConservationError, Ledger
from .cost_model import CostModel

if TYPE_CHECKING:
    from .cluster import _Traj


class SimRequest:
    """One turn on a simulated engine: its blocks, progress and timestamps."""

    __slots__ = ("traj", "turn", "key", "ctx_len", "resp_len", "hl", "n_ctx_blocks",
                 "n_cacheable", "hit", "prefill_left", "computed", "generated", "pinned", "anon",
                 "next_block", "queued", "t_dispatch", "t_admit", "t_prefilled", "request",
                 "credit", "batch", "priority")

    def __init__(self, traj: "_Traj", turn: int, request: TurnRequest, now: float, block_size: int = BLOCK_SIZE) -> None:
        self.traj = traj
        self.turn = turn
        self.key = (traj.tid, turn)
        self.ctx_len = traj.ctx_lens[turn]
        self.resp_len = traj.resp_lens[turn]
        self.hl = traj.hashes(turn, block_size)
        self.n_ctx_blocks = self.ctx_len // block_size
        self.n_cacheable = (self.ctx_len - 1) // block_size  # hit cap: last token computed
        self.hit = 0
        self.prefill_left = self.ctx_len
        self.computed = 0
        self.generated = 0
        self.pinned: List[int] = []
        self.anon = 0
        self.next_block = 0
        self.queued = 0  # this request's contribution to the engine's queued_tokens
        self.t_dispatch = now
        self.t_admit = self.t_prefilled = now  # set when admitted / when its prefill ends
        self.request = request
        self.credit = 0.0  # fractional tokens per step under speculation
        self.batch = 0  # the engine's requests (running + waiting) when this one was queued
        self.priority = 0  # vLLM request priority (lower first), on priority-scheduling engines


class PriorityWaiting:
    """vLLM's waiting queue under ``scheduling_policy: priority``: a heap by (priority, arrival),
    with the deque operations the engine uses (vLLM 0.29 ``v1/core/sched/request_queue.py``
    ``PriorityRequestQueue``; ``v1/request.py`` ``Request.__lt__``)."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: List[Tuple[int, float, int, SimRequest]] = []
        self._seq = count()

    def append(self, r: SimRequest) -> None:
        heapq.heappush(self._heap, (r.priority, r.t_dispatch, next(self._seq), r))

    def popleft(self) -> SimRequest:
        return heapq.heappop(self._heap)[3]

    def __getitem__(self, i: int) -> SimRequest:
        if i != 0:
            raise IndexError("PriorityWaiting: only the head is readable")
        return self._heap[0][3]

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)


_RATE_REFIT_STEPS = 64  # computation schedule of the engines' step-cost regression


class SimEngine:
    """A vLLM-like engine: continuous batching over a prefix-cached, ref-counted KV cache."""

    def __init__(self, eid: int, cost: CostModel, spec_tokens: float = 1.0, spec_drafted: float = 0.0,
                 priority_scheduling: bool = False) -> None:
        self.eid = eid
        self.cost = cost
        self.spec_tokens = spec_tokens
        self.spec_drafted = spec_drafted
        self.bs = cost.block_size
        self.cap_blocks = cost.kv_capacity_tokens // self.bs
        # what the engine tells the dispatcher its KV holds (SimConfig.reported_kv_scale)
        self.reported_kv_tokens = self.cap_blocks * self.bs
        self.blocks: Dict[int, int] = {}  # hash -> refcount (0: cached, evictable)
        self.evictable: "OrderedDict[int, None]" = OrderedDict()  # LRU first
        self.anon = 0  # pinned blocks without a (shareable) hash
        self.running: List[SimRequest] = []
        # FCFS (vLLM's default) or by request priority (``scheduling_policy: priority``)
        self.waiting = PriorityWaiting() if priority_scheduling else deque()
        self.sched: Optional[List[Tuple[SimRequest, int]]] = None
        self.busy_s = 0.0
        self.queued_tokens = 0
        self.pending_turns = 0
        self.evicted = 0
        # The engine's own step-cost regression (what a real engine measures of its steps):
        # duration ~ step_s + step_per_seq_s * sequences + prefill_token_s * prefill tokens.
        # running sums of (1, n, m) x (1, n, m) and x duration, n = sequences, m = prefill
        # tokens (plain floats: this runs every simulated step)
        self._sums = [0.0] * 9
        self._fit_steps = 0
        self.rates = (0.0, 0.0, 0.0)

    # -- cache ----------------------------------------------------------------------------
    def match(self, hl: List[int], limit: int) -> int:
        """Cached blocks at the head of ``hl`` (at most ``limit``), scanned from the root as vLLM's
        longest-hit search does: the cache is not always prefix-closed (a request that computed
        blocks another had already published keeps private copies, so a parent can be evicted
        while a child it never pinned stays), and a gap ends the hit."""
        blocks = self.blocks
        i = 0
        while i < limit and hl[i] in blocks:
            i += 1
        return i

    def reset_cache(self) -> None:
        """Empty the prefix cache (a weight sync); only between steps, when nothing is pinned."""
        if self.pinned_blocks() or self.running or self.waiting:
            raise ConservationError(f"engine {self.eid}: cache reset with work in flight")
        self.blocks.clear()
        self.evictable.clear()

    def pinned_blocks(self) -> int:
        return len(self.blocks) - len(self.evictable) + self.anon

    def try_admit(self, r: SimRequest) -> bool:
        hb = self.match(r.hl, r.n_cacheable)
        need = -(-(r.ctx_len + r.resp_len) // self.bs)
        new = need - hb
        blocks = self.blocks
        hit = r.hl[:hb]
        pinned = self.pinned_blocks()
        # the hit's evictable blocks become pinned too; counted only when the bound says it matters
        if pinned + hb + new > self.cap_blocks and \
                pinned + sum(1 for h in hit if blocks[h] == 0) + new > self.cap_blocks:
            return False
        evictable = self.evictable
        for h in hit:
            c = blocks[h]
            if c == 0:
                del evictable[h]
            blocks[h] = c + 1
        r.pinned = hit
        r.next_block = hb
        while len(blocks) + self.anon + new > self.cap_blocks:
            h, _ = self.evictable.popitem(last=False)
            del blocks[h]
            self.evicted += 1
        self.anon += new
        r.anon = new
        r.hit = hb * self.bs
        r.computed = r.hit
        r.prefill_left = r.ctx_len - r.hit
        new_queued = r.prefill_left + r.resp_len
        self.queued_tokens += new_queued - r.queued
        r.queued = new_queued
        return True

    def publish(self, r: SimRequest, upto: int) -> None:
        """Blocks [next_block, upto) of r are computed: make them shareable cache entries."""
        blocks = self.blocks
        hl = r.hl
        for i in range(r.next_block, upto):
            h = hl[i]
            if h not in blocks:
                blocks[h] = 1
                self.anon -= 1
                r.anon -= 1
                r.pinned.append(h)
        if upto > r.next_block:
            r.next_block = upto

    def release(self, r: SimRequest) -> None:
        blocks = self.blocks
        for h in reversed(r.pinned):  # leaf first: leaves are evicted before ancestors
            c = blocks[h] - 1
            blocks[h] = c
            if c == 0:
                self.evictable[h] = None
            elif c < 0:
                raise ConservationError(f"engine {self.eid}: negative refcount")
        self.anon -= r.anon
        r.anon = 0
        r.pinned = []
        if self.anon < 0:
            raise ConservationError(f"engine {self.eid}: negative anonymous block count")

    # -- scheduling -----------------------------------------------------------------------
    def enqueue(self, r: SimRequest) -> None:
        need = -(-(r.ctx_len + r.resp_len) // self.bs)
        if need > self.cap_blocks:
            raise ValueError(f"kv_capacity_tokens ({self.cap_blocks * self.bs}) cannot hold "
                             f"turn {r.key} ({r.ctx_len + r.resp_len} tokens)")
        est_hit = self.match(r.hl, r.n_cacheable) * self.bs
        r.queued = r.ctx_len - est_hit + r.resp_len
        self.queued_tokens += r.queued
        self.waiting.append(r)

    def plan_step(self, now: float = 0.0, slowdown: float = 1.0) -> float:
        """Choose this step's work (starting at ``now``); return its duration (``slowdown``: the
        factor by which the machine's other busy engines stretch it, see ``CostModel.contention``)."""
        budget = self.cost.max_num_batched_tokens
        sched: List[Tuple[SimRequest, int]] = []
        n_dec = ctx_tokens = prefill = dec_ctx = 0
        pairs = 0.0  # prefill attention: chunk c over what is computed, c * (computed + c / 2)
        for r in self.running:
            if budget <= 0:
                break
            if r.prefill_left > 0:
                c = min(r.prefill_left, budget)
                sched.append((r, c))
                budget -= c
                prefill += c
                pairs += c * (r.computed + c / 2)
                ctx_tokens += r.computed + c
            else:
                sched.append((r, 0))
                budget -= 1
                n_dec += 1
                ctx_tokens += r.computed
                dec_ctx += r.computed
        while (self.waiting and budget > 0
               and len(self.running) < self.cost.max_num_seqs):
            r = self.waiting[0]
            if not self.try_admit(r):
                break
            self.waiting.popleft()
            r.t_admit = now
            self.running.append(r)
            c = min(r.prefill_left, budget)
            sched.append((r, c))
            budget -= c
            prefill += c
            pairs += c * (r.computed + c / 2)
            ctx_tokens += r.computed + c
        if not sched:
            raise ConservationError(f"engine {self.eid}: work queued but nothing schedulable "
                                    f"(running {len(self.running)}, waiting {len(self.waiting)})")
        self.sched = sched
        dur = self.cost.step_time(n_dec, ctx_tokens, prefill, pairs)
        if n_dec and self.spec_drafted:
            cost = self.cost
            drafts = n_dec * self.spec_drafted
            if cost.spec_step_s or cost.draft_token_s or cost.draft_context_token_s:  # measured costs
                dur += (cost.spec_step_s + cost.draft_token_s * drafts
                        + cost.draft_context_token_s * self.spec_drafted * dec_ctx)
            else:  # a verified draft token costs a prefill token's compute
                dur += cost.prefill_per_token_s * drafts
        dur *= slowdown
        self.busy_s += dur
        n, m, acc = len(sched), prefill, self._sums
        acc[0] += 1.0
        acc[1] += n
        acc[2] += m
        acc[3] += n * n
        acc[4] += n * m
        acc[5] += m * m
        acc[6] += dur
        acc[7] += n * dur
        acc[8] += m * dur
        self._fit_steps += 1
        if self._fit_steps % _RATE_REFIT_STEPS == 0:
            self._refit()
        return dur

    def _refit(self) -> None:
        """Least squares of the recorded steps (a feature that never varied is dropped)."""
        c, n, m, nn, nm, mm, y, ny, my = self._sums
        xtx = np.array([[c, n, m], [n, nn, nm], [m, nm, mm]])
        xty = np.array([y, ny, my])
        for cols in ((0, 1, 2), (0, 1), (0, 2), (0,)):
            idx = list(cols)
            sub = xtx[np.ix_(idx, idx)]
            if np.linalg.cond(sub) < 1e12:
                coef = np.linalg.solve(sub, xty[idx])
                if (coef >= 0).all():
                    full = np.zeros(3)
                    full[idx] = coef
                    self.rates = (float(full[0]), float(full[1]), float(full[2]))
                    return

    def finish_step(self, ledger: Ledger, now: float = 0.0) -> List[SimRequest]:
        done: List[SimRequest] = []
        for r, c in self.sched:
            emit = False
            if c > 0:
                r.prefill_left -= c
                r.computed += c
                r.queued -= c
                self.queued_tokens -= c
                self.publish(r, min(r.computed // self.bs, r.n_ctx_blocks))
                if r.prefill_left == 0:
                    r.t_prefilled = now
                    if r.resp_len > 0:
                        emit = True
                    else:
                        done.append(r)
            else:
                emit = True
            if emit:
                n = 1
                if c == 0 and self.spec_tokens > 1.0:  # a decode step with drafts verified
                    r.credit += self.spec_tokens
                    n = max(1, min(int(r.credit), r.resp_len - r.generated))
                    r.credit -= n
                ledger.tokens(r.key, n)
                r.generated += n
                r.computed += n
                r.queued -= n
                self.queued_tokens -= n
                if r.generated == r.resp_len:
                    done.append(r)
        self.sched = None
        if done:
            ids = {id(r) for r in done}
            self.running = [r for r in self.running if id(r) not in ids]
            for r in done:
                # KV exists for every token but the last sampled one.
                self.publish(r, min((r.ctx_len + r.resp_len - 1) // self.bs, len(r.hl)))
                self.release(r)
                if r.queued != 0:
                    raise ConservationError(f"turn {r.key} finished with {r.queued} queued tokens")
        return done

    def state(self) -> EngineState:
        s0, s1, p = self.rates
        return EngineState(self.eid, len(self.running), len(self.waiting), self.queued_tokens,
                           self.reported_kv_tokens, self.pending_turns, kv_block_size=self.bs,
                           step_s=s0, step_per_seq_s=s1, prefill_token_s=p,
                           kv_used_tokens=self.pinned_blocks() * self.bs)
