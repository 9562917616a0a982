"""WAR's workload-aware turn dispatch: every choice costed in seconds from measured state.

A synchronous RL step ends when its slowest trajectory ends, and a trajectory is a chain of
turns and tool calls. So each turn goes where it finishes soonest *and* slows the others
least, and a new trajectory starts only where the KV cache can keep what the live ones will
need again after their tool calls. Nothing here is a constant fit to one trace: the rates
are the engines' own step regression (``EngineState.step_s``, ``step_per_seq_s``,
``prefill_token_s``), else :class:`~.turn_costs.TurnCosts` (every finished turn's latency,
regressed on its uncached prompt, its response and the engine's batch). An engine whose
recent steps did not identify a prefill rate reports 0 for it: prefill is never free, so the
last rate an engine identified stands (a zero would price recomputation at nothing, and
admission's fluid model would find admitting all free); the cache state is a
block-hash model of every engine (:class:`~.block_index.BlockHashIndex`, bounded by each
engine's reported KV capacity and counted in its own ``kv_block_size``); the workload's shape
(turn counts, growth per turn, tool gap) is measured from the turns it dispatches.

Per ``choose()`` and healthy engine ``e`` (``p`` = prefill seconds per token, ``s1`` = decode
step seconds added per sequence, ``r`` = mean response tokens, ``R`` = expected turns left
of this trajectory, all measured)::

    u_e     = len(context) - cached_e                  # tokens e must prefill
    cost_e  = w * (wait_e + p * u_e + R * r * s1 * (b_e + 1))  # this turn's own time
            + running_e * p * u_e + R * b_e * r * s1           # the delay it adds to the others
            + p * overflow_e * R * (running_e + 1)             # evictions it forces (admission)

* ``R``: sum over j >= k of P(T > j) / P(T > k) for a trajectory with k turns done, from the
  turn counts of finished trajectories: the engine a turn picks is where the trajectory's next
  turns decode too, so batch costs count that many times, a prefill once. Before any
  trajectory of the pool finished (its first step) ``R`` is ``cold_turns`` at every k (a
  memoryless prior). It was 1: a cached shared prompt then outweighed the batch a turn joins,
  so a GRPO group's samples all started on the engine that held their prompt. Siblings run to
  similar lengths, so the engines' loads differed by whole groups.

* ``cached_e``: the longest prefix the model says e holds, capped at ``len - 1`` (the engine
  computes the last token) and rounded down to e's blocks.
* ``s1`` is floored at ``p``: whatever a fit says, a sequence in a decode step costs at least
  the forward pass of one token, which is what ``p`` measures. A fit of few or noisy turns
  can say 0 for ``p`` or ``s1`` (seen on two CPU engines: latency explained by the step time
  alone), which would make batching free and pile every turn onto one engine; a zero takes
  the cold prior's ratio to the fitted step time instead.
* The turn goes to ``argmin cost_e``; ties go to the trajectory's engine, then the one with
  fewer requests, then the lower id. An engine holding none of the context costs at least
  ``p * n * (w + running_e)``; once a cheaper engine is known it is not priced at all (its
  cost is computed on demand, for ``last_scores`` and the eviction check): at 32 engines most
  of a returning turn's candidates are settled by that one bound.
* ``b_e = running + waiting + pending_turns``: the requests e will batch, counting the
  trajectories parked on a tool whose next turn comes back to e -- they hold the engine as
  surely as the running ones, which is what makes load balance see the step's stragglers.
* ``wait_e``: a request queued behind ``waiting_e`` others starts when that many of the
  ``running_e + 1`` in flight have finished (Little's law with the measured mean latency);
  one that needs ``u + r`` KV tokens where the running requests leave less starts when they
  have freed the shortfall, ``mean latency x shortfall / kv_used`` (they free ``kv_used``
  per mean latency); the larger of the two.
* ``w = 1 + progress``, progress = turns done / mean turns of finished trajectories (0 before
  any finished): the further a trajectory is, the likelier it is the step's straggler, so
  its own time weighs up to twice the delay it causes -- the chain that ends last is the
  step's length.
* There is no move margin: staying saves ``(1 + running) * p * cached`` seconds, so a trajectory
  moves only when the queue or batch it leaves costs more than recomputing its context.

KV-aware admission (``admission=True``): parked trajectories' blocks sit in vLLM's evictable
LRU, and an LRU over a cyclic working set larger than the cache misses on every return, so
once the live trajectories of an engine outgrow its KV every turn recomputes its whole
context. ``overflow_e`` is the number of tokens by which this trajectory (new, or moving to
e) pushes e's projected peak live footprint past its budget (the KV less the shared prompt):
over the coming rounds, each live trajectory is still live with its conditional survival
probability and then holds its own tokens + the measured growth per turn; the peak is taken
of the mean + 2 standard deviations of that sum (past the KV the LRU loses everything, a
cliff, so the footprint must fit with ~98% probability). A trajectory's own engine never
overflows. If every engine would overflow for a *first* turn, ``choose`` returns
:data:`~.base.DEFER` -- but only when :meth:`deferral_pays`: a fluid model of the step, all
trajectories now with recomputation against waves without, from the measured tool gap,
rates and trajectories per step, says waves finish sooner by more than ``defer_margin``
(5%, the one constant here tuned on a benchmark suite's tuning half; with slow tools waves
rarely win).
It never defers a later turn or when no trajectory is live; the caller offers a deferred
turn again when a turn finishes.

Admission order (``admission_order``): deferred first turns are offered again in arrival order
(``fifo``) or longest-predicted first (``longest_first``: each one's expected turns from its GRPO
siblings' finished totals and running count, fitted on earlier steps' groups, Seer's
sibling-informed longest first): the step's likely straggler starts before the short ones.

Thrashing, measured (``thrash_bound``): every returning turn says how much of what the model
said its engine held was recomputed (``observe_turn``'s cached tokens). Counted only while the
model holds the engine's live trajectories within its budget (past it the model predicts the
misses itself): when an engine, over its last ``thrash_window`` such turns, recomputed more
than ``thrash_bound`` of it, the engine keeps less than the model holds (another tenant's
requests, a capacity report that counts blocks the prefix cache cannot keep); the model's KV
of it shrinks by a quarter (floor: a tenth of the report), which evicts from the block model
and lowers its admission budget (new trajectories go elsewhere or wait). It grows back by 5%
per window with almost no recomputation, up to the report. Off by default (``null``): what it
gains and costs is measured by ``tools/bench_thrashing.py`` (docs/benchmarks.md, "KV
thrashing"); vLLM's KV events (``kv_events: true``) correct the block model exactly instead.

Cache bookkeeping: a new trajectory's prompt is recorded on the chosen engine at ``choose()``
(vLLM caches a prompt as soon as it is prefilled, which lets the other samples of a GRPO
group find it); every turn's context + response in ``on_turn_finished``, O(new blocks).
A weight sync (``on_prefix_cache_reset``) empties the model; the measurements stay.

Options: ``kv_capacity_tokens`` (per engine, int or sequence; ``None`` takes it from the
engine snapshots and follows it when it changes), ``admission`` (``False``: never defer),
``admission_order``, ``thrash_bound`` and ``thrash_window``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

from .base import DEFER, DispatchPolicy, EngineState, PolicyOptions, TurnRequest
from .block_index import BLOCK_SIZE, BlockHashIndex, TrajectoryChain, whole_blocks
from .live_table import LiveTable
from .remaining_work import SiblingRecords
from .turn_costs import PRIOR_RATES, TurnCosts

ADMISSION_ORDERS = ("fifo", "longest_first")

_UNSET_CAPACITY = 1 << 62
# the cold prior's ratios to a decode step (turn_costs.py): used where a fit says 0
_PRIOR_PREFILL = PRIOR_RATES[0] / PRIOR_RATES[1]
_PRIOR_PER_SEQ = PRIOR_RATES[2] / PRIOR_RATES[1]  # until the first snapshot tells the capacity


def _priced(p: float, s0: float, s1: float) -> tuple:
    """The rates a price uses: a degenerate fit's zero takes the cold prior's ratio to the step
    time, and a decoded token costs at least one token's forward pass (``s1 >= p``)."""
    if p <= 0.0 or s1 <= 0.0:
        p = p if p > 0.0 else s0 * _PRIOR_PREFILL
        s1 = s1 if s1 > 0.0 else s0 * _PRIOR_PER_SEQ
    return p, s0, (s1 if s1 > p else p)


class _Live:
    """What WAR tracks of a live trajectory; its engine, turns done and tokens are its row of
    the policy's :class:`~.live_table.LiveTable` (read by the footprint projection), mirrored
    here as Python ints for the per-turn reads."""

    __slots__ = ("_table", "row", "expect_hit", "arrival", "finish", "last_n", "_engine", "_turns",
                 "_tokens")

    def __init__(self, table: LiveTable, engine: int, n: int, arrival: Optional[float]) -> None:
        self._table = table
        self.row = table.add(engine, 0, n)  # turns finished: 0; tokens: context + responses so far
        self._engine, self._turns, self._tokens = int(engine), 0, int(n)
        self.expect_hit = 0       # own prefix its engine should still hold at this turn
        self.arrival = arrival    # clock time its current turn became ready
        self.finish = None        # clock time its last turn finished
        self.last_n = n           # context length at its last dispatch

    @property
    def engine(self) -> int:
        return self._engine

    @engine.setter
    def engine(self, value: int) -> None:
        self._table.engine[self.row] = value
        self._engine = int(self._table.engine[self.row])

    @property
    def turns(self) -> int:
        return self._turns

    @turns.setter
    def turns(self, value: int) -> None:
        self._table.turns[self.row] = value
        self._turns = int(self._table.turns[self.row])

    @property
    def tokens(self) -> int:
        return self._tokens

    @tokens.setter
    def tokens(self, value: int) -> None:
        self._table.tokens[self.row] = value
        self._tokens = int(self._table.tokens[self.row])


@dataclass(frozen=True)
class WarOptions(PolicyOptions):
    """Options of ``war``."""

    kv_capacity_tokens: Union[None, int, Sequence[int]] = field(default=None, metadata={
        "help": "KV tokens per engine, one number or one per engine (None: read from the engines' reports)"})
    admission: bool = field(default=True, metadata={
        "help": "hold new trajectories back while the engines' KV is short (true/false)"})
    thrash_bound: Optional[float] = field(default=None, metadata={
        "help": "share of returning trajectories' modelled cache hits an engine recomputed, over "
                "its last thrash_window returning turns, above which its KV is modelled smaller "
                "(null, the default: never; 0.3 is the value benchmarked)"})
    thrash_window: int = field(default=16, metadata={
        "help": "returning turns per engine behind each thrashing verdict"})
    admission_order: str = field(default="fifo", metadata={
        "help": "order in which deferred new trajectories are offered again: fifo (arrival) or "
                "longest_first (most predicted turns, from GRPO siblings, first)"})
    defer_margin: float = field(default=0.05, metadata={
        "help": "share of the step the fluid model must say deferral saves before new "
                "trajectories are held back (0: any saving; tuned on the tuning suite)"})
    cold_turns: float = field(default=4.0, metadata={
        "help": "expected turns left of a trajectory before any trajectory of the pool finished "
                "(its first step; measured turn counts replace it): >= 1; at 4 a GRPO group's "
                "samples start on different engines (tuned on the tuning half's prompts)"})

    def __post_init__(self) -> None:
        if not isinstance(self.admission, bool):
            raise ValueError(f"admission must be true or false, got {self.admission!r}")
        if self.thrash_bound is not None and not 0.0 < self.thrash_bound < 1.0:
            raise ValueError(f"thrash_bound must be in (0, 1) or null, got {self.thrash_bound!r}")
        if isinstance(self.thrash_window, bool) or not isinstance(self.thrash_window, int) \
                or self.thrash_window < 1:
            raise ValueError(f"thrash_window must be an int >= 1, got {self.thrash_window!r}")
        if isinstance(self.defer_margin, bool) or not isinstance(self.defer_margin, (int, float)) \
                or not 0.0 <= self.defer_margin < 1.0:
            raise ValueError(f"defer_margin must be a number in [0, 1), got {self.defer_margin!r}")
        if isinstance(self.cold_turns, bool) or not isinstance(self.cold_turns, (int, float)) \
                or not 1.0 <= self.cold_turns < math.inf:
            raise ValueError(f"cold_turns must be a finite number >= 1, got {self.cold_turns!r}")
        if self.admission_order not in ADMISSION_ORDERS:
            raise ValueError(f"admission_order must be one of {', '.join(ADMISSION_ORDERS)}, "
                             f"got {self.admission_order!r}")
        caps = self.kv_capacity_tokens
        if caps is None:
            return
        for i, c in enumerate([caps] if np.isscalar(caps) else list(caps)):
            if c < 0:
                which = "" if np.isscalar(caps) else f" of engine {i}"
                raise ValueError(f"kv_capacity_tokens{which} must be >= 0, got {c}")

    def check_engines(self, num_engines: int) -> None:
        caps = self.kv_capacity_tokens
        if caps is not None and not np.isscalar(caps) and len(list(caps)) != num_engines:
            raise ValueError(f"kv_capacity_tokens has {len(list(caps))} entries for {num_engines} engines")


class WarDispatchPolicy(DispatchPolicy):
    name = "war"
    Options = WarOptions

    def __init__(self, num_engines: int, *,
                 kv_capacity_tokens: Union[None, int, Sequence[int]] = None,
                 admission: bool = True, thrash_bound: Optional[float] = None,
                 thrash_window: int = 16, admission_order: str = "fifo",
                 defer_margin: float = 0.05, cold_turns: float = 4.0) -> None:
        super().__init__(num_engines)
        options = WarOptions(kv_capacity_tokens=kv_capacity_tokens, admission=admission,
                             thrash_bound=thrash_bound, thrash_window=thrash_window,
                             admission_order=admission_order, defer_margin=defer_margin,
                             cold_turns=cold_turns)
        options.check_engines(num_engines)
        self.admission = admission
        self.cold_turns = float(cold_turns)
        self.defer_margin = float(defer_margin)
        self.thrash_bound = thrash_bound
        self.thrash_window = thrash_window
        self.admission_order = admission_order
        self.siblings = SiblingRecords()      # GRPO groups of this step (longest-first admission)
        self._group_of: Dict[str, str] = {}   # trajectory -> group, until it finishes
        if kv_capacity_tokens is None:
            caps = [_UNSET_CAPACITY] * num_engines
            self._caps_from_snapshot = True
        else:
            caps = ([kv_capacity_tokens] * num_engines if np.isscalar(kv_capacity_tokens)
                    else list(kv_capacity_tokens))
            caps = [int(c) for c in caps]
            self._caps_from_snapshot = False
        E = num_engines
        self.reported_capacity = list(caps)   # what the engines (or the options) say
        self.kv_scale = [1.0] * E             # share of it the engine measurably keeps
        self._reuse_window: List[deque] = [deque(maxlen=thrash_window) for _ in range(E)]
        self.thrash_verdicts = 0
        self.capacity_tokens = caps
        self.index = BlockHashIndex(E, [c // BLOCK_SIZE for c in caps])
        self.block_sizes = [BLOCK_SIZE] * E
        self.trajectories: Dict[str, TrajectoryChain] = {}
        self.costs = TurnCosts()
        self._engine_rates: Optional[tuple] = None
        self._prefill_held = 0.0  # the last prefill rate an engine's window identified
        self._last_scores: Dict[int, float] = {}
        self._unpriced: tuple = ((), None, ())  # engines the last decision did not price
        self.moves = 0
        self.deferrals = 0
        self.full_offers = 0    # this batch's offers of first turns every engine's budget refused (re-offers count)
        self.last_fluid: dict = {}
        # live trajectories and the admission limit
        self._live: Dict[str, _Live] = {}
        self._live_table = LiveTable()  # their engines, turns and tokens as columns
        self.live = [0] * E
        self.expected_reuse = [0] * E         # own-prefix tokens that should have hit
        self.reprefilled = [0] * E            # ... and were recomputed instead
        # measured workload shape
        self._finished_turns: List[int] = []  # turn counts of the last SURVIVAL_BATCHES batches' trajectories
        self._finished_sum = 0
        self._batch_starts: deque = deque()   # where each of those batches starts in _finished_turns
        self._surv: Optional[np.ndarray] = None
        self._remaining: Optional[np.ndarray] = None
        self._growth_sum = 0
        self._growth_count = 0
        self._gap_sum = 0.0
        self._gap_count = 0
        self._x0_sum = 0       # uncached prompt tokens of admitted trajectories
        self._shared0_sum = 0  # cached prompt tokens of admitted trajectories
        self._x0_count = 0
        self._started_batch = 0
        self._started_prev = 0
        self._defer_cache: Optional[bool] = None
        self._curves: List[Optional[tuple]] = [None] * E  # per engine footprint projection

    # ---- measured quantities --------------------------------------------------------------
    def growth_per_turn(self) -> float:
        """Mean tokens a live trajectory adds per turn (response + tool output)."""
        return self._growth_sum / self._growth_count if self._growth_count else 0.0

    def tool_gap_s(self) -> Optional[float]:
        """Mean seconds between a turn's end and the next turn's arrival (None without a
        clock or before any second turn)."""
        return self._gap_sum / self._gap_count if self._gap_count else None

    def reuse_loss(self, engine: int) -> float:
        """Share of returning trajectories' own prefixes ``engine`` recomputed (all time)."""
        exp = self.expected_reuse[engine]
        return self.reprefilled[engine] / exp if exp else 0.0

    def _survival(self) -> Optional[np.ndarray]:
        """``surv[j]`` = share of finished trajectories that ran more than ``j`` turns."""
        if self._surv is None and self._finished_turns:
            t = np.asarray(self._finished_turns)
            j = np.arange(int(t.max()) + 2)
            self._surv = (t[None, :] > j[:, None]).mean(axis=1)
        return self._surv

    def remaining_turns(self, k: int) -> float:
        """Expected turns left, this one included, of a trajectory with ``k`` turns done:
        sum over j >= k of P(T > j) / P(T > k) (``cold_turns`` before any trajectory finished)."""
        if self._remaining is None:
            surv = self._survival()
            if surv is None:
                return self.cold_turns
            tail = np.cumsum(surv[::-1])[::-1]
            self._remaining = np.where(surv > 0, tail / np.where(surv > 0, surv, 1.0), 1.0)
        rem = self._remaining
        return float(rem[k]) if k < len(rem) else 1.0

    def _rates(self, reported: Optional[tuple] = None):
        """(prefill s/token, step s, step s per sequence): the engines' own measurements
        (``reported``: their sums and counts, from :meth:`_note_engines`; the mean over those
        that report them, the prefill rate over those that identified one, else the last one
        identified), else the fit of turn latencies."""
        if reported is not None:
            pf, st, ps, k, kp = reported
            if kp:  # the engines whose window identified the prefill rate
                p = self._prefill_held = pf / kp
            else:  # none did (a window of few prefills, or the fit dropped it): prefill is never
                # free, so the last identified rate stands (else 0: :func:`_priced`'s prior)
                p = self._prefill_held
            self._engine_rates = (p, st / k, ps / k)
            return self._engine_rates
        return self.costs.rates()

    # ---- admission -------------------------------------------------------------------------
    def deferral_pays(self) -> bool:
        """Does holding new trajectories back shorten the step? A fluid model of one engine
        over rounds (a round = one turn of every live trajectory) both ways, from measured
        quantities only: the previous batch's trajectories per engine N, the survival curve
        S of turn counts, tokens per admitted prompt (x0, its cached part) and per turn (g),
        the tool gap, the engines' rates and KV capacity C, and the budget:

        * admit all N: at round j, ``N * S(j)`` are live holding ``x0 + j * g`` tokens each;
          past C every returning turn misses and recomputes its context (an LRU evicts the
          trajectory parked longest, the one that returns next); a round lasts the longer of
          one trajectory's turn + tool call and the engine's busy time for the round;
        * defer: K live at a time (as many fresh trajectories as the budget holds at their
          expected peak), no misses: ``N * mean turns / K`` rounds, plus the tail of the
          longest trajectory.

        It defers only when that saves more than ``defer_margin`` of the admit-all estimate:
        the model prices rounds by their means, and holding back is the riskier error (a
        held-back straggler starts late and ends the step; on the tuning suite's 32-engine,
        KV pressure 4, slow-tool tau_like cell the estimates were 0.8% apart and deferring
        made the step about a fifth longer than admitting).

        Without the measurements (first batch, no clock) it answers yes: keep the cache."""
        if self._defer_cache is not None:
            return self._defer_cache
        surv = self._survival()
        gap = self.tool_gap_s()
        caps = [c for c in self.capacity_tokens if c < _UNSET_CAPACITY]
        if (surv is None or gap is None or not self._started_prev or not caps
                or not self._x0_count or (self._engine_rates is None and self.costs.n < 3)):
            self.last_fluid = {"defers": True, "unmeasured": True}  # not cached: measurements come
            return True
        p, s0, s1 = _priced(*(self._engine_rates or self.costs.rates()))  # as turns are priced
        r = self.costs.mean_response
        g = self.growth_per_turn()
        x0 = self._x0_sum / self._x0_count
        shared = self._shared0_sum / self._x0_count
        C = float(np.mean(caps))
        N = self._started_prev / self.num_engines
        T = len(surv) - 1
        j = np.arange(max(T, 1))
        x = x0 + j * g
        budget = float(np.mean([self.budget(e) for e in range(self.num_engines)
                                if self.capacity_tokens[e] < _UNSET_CAPACITY]))
        K = max(1.0, math.floor(budget / max(float((surv[j] * x).max()), 1.0)))
        if K >= N:  # the budget holds a whole step's trajectories: nothing to wait for
            self.last_fluid = {"K": K, "N": N, "defers": False}
            self._defer_cache = False
            return False
        live = N * surv[j]
        miss = (shared + live * x > C).astype(np.float64)
        pre = p * (g + miss * x)
        dec = r * (s0 + s1 * live)
        admit_s = float(np.maximum(gap + dec + pre * live / 2, live * pre + dec).sum())
        t_mean = float(np.mean(self._finished_turns))
        dec_k = r * (s0 + s1 * K)
        rnd = max(gap + dec_k + p * g * K / 2, K * p * g + dec_k)
        defer_s = (N * t_mean / K + max(T - t_mean, 0.0)) * rnd
        self._defer_cache = defer_s < admit_s * (1.0 - self.defer_margin)
        self.last_fluid = {"admit_s": admit_s, "defer_s": defer_s, "K": K, "N": N,
                           "defers": self._defer_cache,
                           # what it was computed from, to check it against the step it priced
                           "inputs": {"prefill_s_per_token": p, "step_s": s0, "step_s_per_seq": s1,
                                      "mean_response": r, "growth_per_turn": g, "own_prompt": x0,
                                      "shared_prompt": shared, "kv_tokens": C, "budget": budget,
                                      "max_turns": T, "mean_turns": t_mean, "tool_gap_s": gap,
                                      "miss_rounds": int(miss.sum())}}
        return self._defer_cache

    def _curve(self, ks, owns):
        """(mean, variance) over the coming rounds h of the footprint of trajectories with
        ``ks`` turns done holding ``owns`` tokens: one is still live at round h with
        P(T > k + h | T > k) (the survival curve of finished trajectories' turn counts) and
        then holds its own tokens + h x the measured growth per turn (each independently
        live or not). Before any trajectory finished: their sizes now plus one turn."""
        g = self.growth_per_turn()
        surv = self._survival()
        if surv is None:
            tot = float(np.sum(owns) + len(owns) * g)
            return np.array([tot]), np.zeros(1)
        H = len(surv)
        if not len(ks):
            return np.zeros(H), np.zeros(H)
        k = np.minimum(np.asarray(ks, dtype=np.int64), H - 1)
        own = np.asarray(owns, dtype=np.float64)
        h = np.arange(H)
        idx = np.minimum(k[:, None] + h[None, :], H - 1)
        base = surv[k]
        alive = np.where(base[:, None] > 0, surv[idx] / np.where(base > 0, base, 1.0)[:, None],
                         (h == 0)[None, :].astype(np.float64))
        size = own[:, None] + h[None, :] * g
        return (alive * size).sum(axis=0), (alive * (1.0 - alive) * size * size).sum(axis=0)

    def _engine_curve(self, e: int):
        """``(mean, variance, peak)`` of engine ``e``'s live trajectories (cached until one of
        them moves, grows or finishes)."""
        c = self._curves[e]
        if c is None:
            shared = self._shared0_sum / max(self._x0_count, 1)
            ks, tokens = self._live_table.of_engine(e)
            mean, var = self._curve(ks, np.maximum(tokens - shared, 0.0))
            c = self._curves[e] = (mean, var, self._peak(mean, var))
        return c

    def _one_curve(self, k: int, own: float):
        """:meth:`_curve` of one trajectory (the candidate of every engine a turn is priced
        on): the same arithmetic without the batch's broadcasting."""
        surv = self._survival()
        if surv is None:
            return self._curve([k], [own])
        H = len(surv)
        k = min(int(k), H - 1)
        h = np.arange(H)
        base = surv[k]
        if base > 0:
            alive = surv[np.minimum(k + h, H - 1)] / base
        else:
            alive = (h == 0).astype(np.float64)
        size = float(own) + h * self.growth_per_turn()
        return alive * size, alive * (1.0 - alive) * size * size

    @staticmethod
    def _peak(mean, var) -> float:
        """Peak over rounds of mean + 2 standard deviations: past the KV an LRU loses every
        returning prefix (a cliff), so a footprint must fit with ~98% probability, not on
        average."""
        return float((mean + 2.0 * np.sqrt(var)).max())

    def peak_need(self, e: int, add: Optional[tuple] = None) -> float:
        """Expected peak live footprint (tokens beyond the shared prompt) of engine ``e``,
        with trajectory ``add`` = (turns done, tokens it would add there) joining it."""
        mean, var, peak = self._engine_curve(e)
        if add is None:
            return peak
        m2, v2 = self._one_curve(add[0], add[1])
        if len(mean) != len(m2):  # a curve cached before the survival curve grew
            n = max(len(mean), len(m2))
            mean = np.pad(mean, (0, n - len(mean)), mode="edge")
            var = np.pad(var, (0, n - len(var)), mode="edge")
            m2, v2 = np.pad(m2, (0, n - len(m2))), np.pad(v2, (0, n - len(v2)))
        return self._peak(mean + m2, var + v2)

    def overflow(self, e: int, k: int, tokens: float) -> float:
        """Tokens by which a trajectory (``k`` turns done, adding ``tokens``) joining engine
        ``e`` would push its expected peak footprint past its budget (beyond any overflow
        already there): what the LRU then evicts of parked trajectories, every round."""
        if self.live[e] == 0:
            return 0.0
        before = self.peak_need(e)
        after = self.peak_need(e, (k, tokens))
        return max(0.0, after - max(before, self.budget(e)))

    def budget(self, e: int) -> float:
        """Live footprint (tokens beyond the shared prompt) engine ``e`` is given: its KV
        capacity less the shared prompt, which every live trajectory uses once."""
        return max(self.capacity_tokens[e] - self._shared0_sum / max(self._x0_count, 1), 0.0)

    # ---- DispatchPolicy --------------------------------------------------------------------
    def choose(self, request: TurnRequest, engines: Sequence[EngineState]) -> int:
        healthy, mask, reported = self._note_engines(engines)
        tid = request.trajectory_id
        traj = self.trajectories.get(tid)
        is_new = traj is None
        rec = self._live.get(tid)
        if is_new:
            traj = TrajectoryChain()
            if tid not in self._group_of:  # alive from its first offer, deferred or not
                self._group_of[tid] = request.group_id
                self.siblings.running(tid, request.group_id, 0)
        cur = traj.engine
        ctx = request.context_token_ids
        # A returning turn's new tokens stay unhashed unless an engine holds the block after
        # the hashed chain: without that no engine holds any of them, and the match is exact.
        traj.sync(ctx, hash_blocks=is_new)
        if traj.unhashed_blocks:
            index = self.index
            hashes = traj.hashes
            if ((not hashes or index.may_extend(hashes[-1], mask))
                    and index.holders.get(traj.next_hash(), 0) & mask):
                traj.flush()
        n = len(ctx)
        max_cached = n - 1 if n > 0 else 0
        matched = self.index.match_all(traj.hashes, mask, traj.hint)
        traj.hint = matched
        bsz = self.block_sizes
        # tokens each engine would reuse, whole blocks of its own (engines absent hold nothing)
        cached = {}
        for eid, blocks in matched.items():
            if blocks:
                t = blocks * BLOCK_SIZE
                t = t if t < max_cached else max_cached
                cached[eid] = t // bsz[eid] * bsz[eid]

        k = rec.turns if rec is not None else 0
        p, scores, best, unpriced = self._scores(healthy, n, k, cached, reported, cur)
        self._last_scores, self._unpriced = scores, unpriced
        if self.admission and best != cur and sum(self.live) > 0:
            size = n if rec is None else rec.tokens
            if self.overflow(best, k, size - cached.get(best, 0)) > 0:  # it could change the choice
                scores = self.last_scores  # every engine priced, in the engines' order
                over_all, best = self._charge_evictions(scores, healthy, cur, k, size, p, cached)
                if over_all and is_new:
                    self.full_offers += 1
                    if self.deferral_pays():
                        self.deferrals += 1
                        return DEFER
        chosen = self._pick(scores, healthy, cur, best)
        if is_new:
            self._start_trajectory(tid, traj, chosen, n, cached.get(chosen, 0), request.arrival_s)
        elif rec is not None:
            self._continue_trajectory(rec, chosen, n, max_cached, request.arrival_s)
        traj.engine = chosen
        return chosen

    def _note_engines(self, engines: Sequence[EngineState]) -> tuple:
        """``(healthy engines, their bitmask, their reported rates)``, noting block sizes and,
        when they come from the engines' reports, KV capacities: one pass over the engines (the
        base class's checks: an id out of range or no healthy engine raise). The rates are the
        sums of the reported step regressions, how many engines report one and how many of those
        identified a prefill rate (None if none)."""
        mask = 0
        bsz = self.block_sizes
        n = self.num_engines
        healthy = []
        reported = self.reported_capacity if self._caps_from_snapshot else None  # unset: never equal
        pf = st = ps = 0.0
        k = kp = 0
        for e in engines:
            if not e.healthy:
                continue
            eid = e.engine_id
            if not 0 <= eid < n:
                raise ValueError(f"{self.name}: engine_id {eid} out of range [0, {n})")
            healthy.append(e)
            mask |= 1 << eid
            bsz[eid] = e.kv_block_size
            if reported is not None and reported[eid] != e.kv_capacity_tokens:
                reported[eid] = e.kv_capacity_tokens
                self._set_capacity(eid)
            if e.step_s > 0 or e.step_per_seq_s > 0:
                if e.prefill_token_s > 0:
                    pf += e.prefill_token_s
                    kp += 1
                st += e.step_s
                ps += e.step_per_seq_s
                k += 1
        if not healthy:
            self._healthy(engines)  # raises the base class's error naming the engines
        return healthy, mask, ((pf, st, ps, k, kp) if k else None)

    def _scores(self, healthy: Sequence[EngineState], n: int, k: int, cached: Dict[int, int],
                reported: Optional[tuple] = None, cur: Optional[int] = None) -> tuple:
        """``(p, scores, best, unpriced)``: the prefill rate used, each engine's cost in seconds of
        taking this turn (``n`` context tokens, ``k`` turns done): its own wait, prefill and
        expected decode, and what it adds to the requests already there; the first cheapest
        engine (in ``healthy``'s order); and what the engines not priced need to be.

        The engines holding part of the context and the trajectory's own are priced first; an
        engine holding none of it costs at least ``p * n * (w + running)`` (every other term is
        >= 0, and rounding is monotone), so one whose bound exceeds the cheapest so far cannot be
        chosen, nor tie, and is priced only when every score is wanted (:attr:`last_scores`,
        the eviction check).
        """
        p, s0, s1 = _priced(*self._rates(reported))
        w = 1.0 + self._progress(k)
        terms = (n, p, p * n, w, self.costs.mean_response * s1 * self.remaining_turns(k),
                 self.costs.mean_response, self.costs.mean_latency)
        price = self._price
        scores: Dict[int, float] = {}
        best, low, first = -1, math.inf, len(healthy)
        nh = len(healthy)
        for eid in (*cached, cur) if cur is not None and cur not in cached else cached:
            i = eid if eid < nh and healthy[eid].engine_id == eid else next(
                (j for j, e in enumerate(healthy) if e.engine_id == eid), None)
            if i is None:  # the trajectory's engine is not healthy
                continue
            sc = scores[eid] = price(healthy[i], n - cached.get(eid, 0), terms)
            if sc < low or (sc == low and i < first):
                best, low, first = eid, sc, i
        pn_w = terms[2]
        unpriced = []
        for i, e in enumerate(healthy):
            eid = e.engine_id
            if eid in scores:
                continue
            if pn_w * (w + e.running) > low:  # its prefill alone costs more than the cheapest
                unpriced.append(e)
                continue
            sc = scores[eid] = price(e, n, terms)
            if sc < low or (sc == low and i < first):
                best, low, first = eid, sc, i
        if best < 0:  # every score infinite or NaN: min()'s choice, the first
            best = healthy[0].engine_id
        return p, scores, best, (unpriced, terms, healthy)

    @staticmethod
    def _price(e: EngineState, u: int, terms: tuple) -> float:
        """One engine's cost of the turn (``u`` tokens to prefill), ``terms`` from :meth:`_scores`."""
        n, p, pn, w, rs1, r, lat = terms
        run = e.running
        queued = e.waiting
        b = run + queued + e.pending_turns
        wait = queued * lat / (run + 1) if queued else 0.0
        used = e.kv_used_tokens
        if used:
            short = used + u + r - e.kv_capacity_tokens
            if short > 0:  # until running requests free that much KV
                kv_wait = lat * short / used
                wait = kv_wait if kv_wait > wait else wait
        # = w * (wait + p*u + rs1*(b+1)) + run*p*u + b*rs1, factored; the same floating-point
        # operations when wait is 0 (w * 0.0 + x == x) or u is n, fewer of them
        pu = pn if u == n else p * u
        if wait:
            return w * wait + pu * (w + run) + rs1 * (w * (b + 1) + b)
        return pu * (w + run) + rs1 * (w * (b + 1) + b)

    @property
    def last_scores(self) -> Dict[int, float]:
        """Every healthy engine's cost of the last decision's turn, in the engines' order
        (with the eviction charges, where the eviction check ran)."""
        unpriced, terms, healthy = self._unpriced
        scores = self._last_scores
        if unpriced or list(scores) != [e.engine_id for e in healthy]:
            price = self._price
            n = terms[0]
            for e in unpriced:
                scores[e.engine_id] = price(e, n, terms)
            scores = self._last_scores = {e.engine_id: scores[e.engine_id] for e in healthy}
            self._unpriced = ((), terms, healthy)
        return scores

    def _charge_evictions(self, scores: Dict[int, float], healthy: Sequence[EngineState],
                          cur: Optional[int], k: int, size: int, p: float, cached: Dict[int, int]) -> tuple:
        """Add the eviction harm to ``scores`` (every engine's, in the engines' order) in place,
        once the cheapest engine was found to overflow. Returns ``(over_all, best)``: True when
        every engine it was checked on would overflow (then deferring a new trajectory may pay),
        and the first cheapest engine after.

        Tokens pushed past an engine's budget are evicted from parked trajectories and
        recomputed every round this trajectory lives there. Checked in order of the other
        costs, only while it could change the choice: when the cheapest engine overflows
        nothing (the trajectory's own engine never does), no other is checked."""
        rem = self.remaining_turns(k)
        run_of = {e.engine_id: e.running for e in healthy}
        clean_best = math.inf
        over_all = True
        for eid in sorted(scores, key=scores.get):
            if scores[eid] >= clean_best:
                break
            if eid == cur:
                over = 0.0
            else:
                over = self.overflow(eid, k, size - cached.get(eid, 0))
            if over > 0:
                scores[eid] += p * over * rem * (run_of[eid] + 1)
            else:
                over_all = False
                clean_best = min(clean_best, scores[eid])
        return over_all, min(scores, key=scores.get)

    @staticmethod
    def _pick(scores: Dict[int, float], healthy: Sequence[EngineState], cur: Optional[int],
              best: int) -> int:
        """The cheapest engine (``best``: the first of them); the trajectory's own on a tie,
        else the one with fewer requests, then the lower id."""
        low = scores[best]
        if cur is not None and scores.get(cur) == low:
            return cur
        ties = [eid for eid, sc in scores.items() if sc == low]
        if len(ties) == 1:
            return best
        load = {e.engine_id: e.running + e.waiting + e.pending_turns for e in healthy}
        return min(ties, key=lambda eid: (load[eid], eid))

    def _start_trajectory(self, tid: str, traj: TrajectoryChain, chosen: int, n: int, cached: int,
                          arrival_s: Optional[float]) -> None:
        """A new trajectory's first turn placed on ``chosen``."""
        self.trajectories[tid] = traj
        self._started_batch += 1
        self._x0_sum += n - cached
        self._shared0_sum += cached
        self._x0_count += 1
        self._live[tid] = _Live(self._live_table, chosen, n, arrival_s)
        self.live[chosen] += 1
        self._curves[chosen] = None
        self.index.touch(chosen, traj.hashes)
        traj.hint[chosen] = len(traj.hashes)

    def _continue_trajectory(self, rec: _Live, chosen: int, n: int, max_cached: int,
                             arrival_s: Optional[float]) -> None:
        """A live trajectory's next turn placed on ``chosen`` (a move when it is another engine)."""
        if arrival_s is not None and rec.finish is not None:
            self._gap_sum += max(arrival_s - rec.finish, 0.0)
            self._gap_count += 1
        rec.arrival = arrival_s
        self._growth_sum += n - rec.last_n
        self._growth_count += 1
        rec.last_n = n
        if chosen != rec.engine:
            self.moves += 1
            self.live[rec.engine] -= 1
            self.live[chosen] += 1
            self._curves[rec.engine] = self._curves[chosen] = None
            rec.engine = chosen
            rec.expect_hit = 0
        else:
            rec.expect_hit = whole_blocks(min(rec.tokens, max_cached), self.block_sizes[chosen])

    def _progress(self, k: int) -> float:
        """Turns done / mean turns of finished trajectories, capped at 1 (0 before any)."""
        if not self._finished_turns:
            return 0.0
        x = k * len(self._finished_turns) / self._finished_sum if self._finished_sum else 1.0
        return 1.0 if x > 1.0 else x

    def on_turn_finished(self, request: TurnRequest, engine_id: int,
                         response_token_ids: np.ndarray) -> None:
        tid = request.trajectory_id
        traj = self.trajectories.get(tid)
        if traj is None:  # finished turn never dispatched through us: adopt it
            traj = self.trajectories[tid] = TrajectoryChain()
        traj.sync(request.context_token_ids, hash_blocks=False)
        traj.extend(np.asarray(response_token_ids, dtype=np.int32))  # hashes both in one call
        traj.engine = engine_id
        rec = self._live.get(tid)
        if rec is None:
            rec = self._live[tid] = _Live(self._live_table, engine_id, traj.n_tokens, None)
            self.live[engine_id] += 1
        elif rec.engine != engine_id:
            self.live[rec.engine] -= 1
            self.live[engine_id] += 1
            self._curves[rec.engine] = None
            rec.engine = engine_id
        rec.tokens = traj.n_tokens
        self._curves[engine_id] = None
        rec.turns = request.turn_index + 1
        self.index.touch(engine_id, traj.hashes)
        traj.hint[engine_id] = len(traj.hashes)

    def observe_turn(self, engine_id: int, *, prompt_tokens: int, cached_tokens: int,
                     response_tokens: int, latency_s: float, batch: int,
                     trajectory_id: str = "") -> None:
        self.costs.observe(prompt_tokens - cached_tokens, response_tokens, batch, latency_s)
        rec = self._live.get(trajectory_id)
        if rec is None:
            return
        if rec.arrival is not None:
            rec.finish = rec.arrival + latency_s
        if rec.expect_hit > 0 and rec.engine == engine_id:
            missed = max(rec.expect_hit - cached_tokens, 0)
            self.expected_reuse[engine_id] += rec.expect_hit
            self.reprefilled[engine_id] += missed
            if self.thrash_bound is not None and self._fits(engine_id):
                self._judge_thrashing(engine_id, rec.expect_hit, missed)
            rec.expect_hit = 0

    # ---- thrashing: measured re-prefill corrects the model of an engine's KV --------------
    def recent_reuse_loss(self, engine: int) -> float:
        """Share of the modelled cache hits of ``engine``'s last returning turns (at most
        ``thrash_window``) that it recomputed."""
        win = self._reuse_window[engine]
        exp = sum(x for x, _ in win)
        return sum(m for _, m in win) / exp if exp else 0.0

    def _fits(self, engine: int) -> bool:
        """Does the model hold ``engine``'s live trajectories within its budget now? Only then
        is a miss evidence that the engine keeps less than the model: past the budget the
        model itself predicts misses (admission accepts them where tool calls hide the
        recomputation)."""
        return float(self._engine_curve(engine)[0][0]) <= self.budget(engine)

    def _judge_thrashing(self, engine: int, expected: int, missed: int) -> None:
        """One returning turn's measured reuse on ``engine``. Over a full window: more than
        ``thrash_bound`` of what the model said was cached was recomputed -> the engine keeps
        less than the model holds (other requests on it, a report that counts blocks its prefix
        cache cannot keep, an LRU that is not quite LRU), so the model's KV of it shrinks by a
        quarter (floor: a tenth of the report); almost nothing recomputed (under a quarter
        of the bound) -> it grows back by 5%, up to the report. Shrinking evicts from the
        block model (a returning trajectory there is no longer counted as cached, so it may
        move) and lowers the admission budget (new trajectories go elsewhere or wait): the
        dispatcher stops adding to a thrashing engine instead of feeding the LRU. The window
        restarts after each change, so each verdict reads the engine as it now is."""
        win = self._reuse_window[engine]
        win.append((expected, missed))
        if len(win) < self.thrash_window:
            return
        loss = self.recent_reuse_loss(engine)
        scale = self.kv_scale[engine]
        if loss > self.thrash_bound:
            new = max(scale * 0.75, 0.1)
        elif loss < self.thrash_bound / 4 and scale < 1.0:
            new = min(scale * 1.05, 1.0)
        else:
            return
        if new != scale:
            if new < scale:
                self.thrash_verdicts += 1
            self.kv_scale[engine] = new
            self._set_capacity(engine)
        win.clear()

    def _set_capacity(self, engine: int) -> None:
        """The model's KV of ``engine``: its reported capacity x the share it measurably keeps
        (the block model's bound and admission's budget)."""
        rep = self.reported_capacity[engine]
        cap = rep if rep >= _UNSET_CAPACITY else int(rep * self.kv_scale[engine])
        self.capacity_tokens[engine] = cap
        self.index.set_capacity(engine, cap // BLOCK_SIZE)
        self._curves[engine] = None
        # deferral_pays() keeps its verdict until the next batch: mid-batch the survival curve
        # would come from the batch's short trajectories only (they finish first)

    def on_trajectory_finished(self, trajectory_id: str) -> None:
        # Its blocks stay in the engines' LRUs: vLLM keeps freed blocks as evictable cache.
        self.trajectories.pop(trajectory_id, None)
        rec = self._live.pop(trajectory_id, None)
        group = self._group_of.pop(trajectory_id, None)
        if rec is not None:
            self.live[rec.engine] -= 1
            turns = rec.turns
            self._live_table.remove(rec.row)
            self._finished_turns.append(turns)
            self._finished_sum += turns
            if len(self._finished_turns) > self.SURVIVAL_HISTORY:  # one huge batch: its latest
                self._forget_finished(len(self._finished_turns) - self.SURVIVAL_HISTORY)
            self._surv = self._remaining = None
            self._curves = [None] * self.num_engines
            if group is not None:
                self.siblings.finished(trajectory_id, group, turns)

    @property
    def orders_admission(self) -> bool:
        return self.admission_order != "fifo"

    def admission_priority(self, request: TurnRequest) -> float:
        """``longest_first``: a deferred new trajectory's predicted turns (its GRPO siblings'
        finished totals and running count, the earlier steps' fit; Seer's sibling-informed
        longest first), so that the step's likely straggler starts first; ``fifo``: 0."""
        if self.admission_order == "fifo":
            return 0.0
        rem = self.siblings.remaining(request.trajectory_id, request.group_id, 0)
        return 0.0 if rem is None else float(rem)

    def start_batch(self) -> None:
        self.siblings.start_batch()
        self._group_of.clear()
        self._batch_starts.append(len(self._finished_turns))
        if len(self._batch_starts) > self.SURVIVAL_BATCHES:
            self._batch_starts.popleft()
            self._forget_finished(self._batch_starts[0])
        if self._started_batch:
            self._started_prev = self._started_batch
        self._started_batch = 0
        self._defer_cache = None
        self.last_fluid = {}  # this batch's answer, once asked
        self.full_offers = 0

    def on_prefix_cache_reset(self) -> None:
        """Weight sync: the engines' caches are empty; the measurements stay."""
        self.index = BlockHashIndex(self.num_engines, list(self.index.capacity_blocks))
        for traj in self.trajectories.values():
            traj.hint = {}

    #: the survival curve is drawn from the trajectories of the last this many batches (the
    #: policy's turn counts drift as it learns; memory stays bounded over a long job) ...
    SURVIVAL_BATCHES = 8
    #: ... and at most this many of them
    SURVIVAL_HISTORY = 16384

    def _forget_finished(self, n: int) -> None:
        """Drop the ``n`` oldest finished trajectories from the survival history."""
        if n <= 0:
            return
        self._finished_sum -= sum(self._finished_turns[:n])
        del self._finished_turns[:n]
        self._batch_starts = deque(max(b - n, 0) for b in self._batch_starts)
        self._surv = self._remaining = None

    def state_dict(self) -> dict:
        """The measurements (rates, survival curve, workload shape, KV shares, sibling groups);
        not the block model of the engines' caches, which restart empty."""
        return {"costs": self.costs.state_dict(),
                "engine_rates": list(self._engine_rates) if self._engine_rates is not None else None,
                "prefill_held": self._prefill_held,
                "finished_turns": list(self._finished_turns),
                "growth": [self._growth_sum, self._growth_count], "gap": [self._gap_sum, self._gap_count],
                "admitted": [self._x0_sum, self._shared0_sum, self._x0_count],
                "started_prev": self._started_prev or self._started_batch,
                "kv_scale": list(self.kv_scale), "siblings": self.siblings.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.costs.load_state_dict(state["costs"])
        rates = state.get("engine_rates")
        self._engine_rates = tuple(float(x) for x in rates) if rates else None
        self._prefill_held = float(state.get("prefill_held", 0.0) or 0.0)
        self._finished_turns = [int(t) for t in state["finished_turns"]][-self.SURVIVAL_HISTORY:]
        self._finished_sum = sum(self._finished_turns)
        self._batch_starts = deque([0]) if self._finished_turns else deque()
        self._surv = self._remaining = None
        self._growth_sum, self._growth_count = state["growth"]
        self._gap_sum, self._gap_count = state["gap"]
        self._x0_sum, self._shared0_sum, self._x0_count = state["admitted"]
        self._started_prev = int(state["started_prev"])
        scales = state.get("kv_scale") or []
        if len(scales) == self.num_engines:  # a job resumed on another engine count starts them at 1
            self.kv_scale = [float(x) for x in scales]
            for e in range(self.num_engines):
                self._set_capacity(e)
        self.siblings.load_state_dict(state.get("siblings", {}))
        self._defer_cache = None
        self._curves = [None] * self.num_engines

    def metrics(self) -> dict:
        """The measurements behind the decisions (cumulative): moves, deferrals, the share of
        returning trajectories' prefixes the engines recomputed, and the fitted rates."""
        p, s0, s1 = self._engine_rates or self.costs.rates()
        exp = sum(self.expected_reuse)
        gap = self.tool_gap_s()
        fluid = self.last_fluid
        return {"moves": float(self.moves), "deferrals": float(self.deferrals),
                # this batch's admission: first turns every engine's budget refused, and the fluid
                # model's two estimates of the step when it was asked (0: not asked), what
                # ``defer_margin`` is weighed against
                "admission_full_offers": float(self.full_offers),
                "fluid_admit_s": float(fluid.get("admit_s", 0.0)),
                "fluid_defer_s": float(fluid.get("defer_s", 0.0)),
                "reuse_loss": sum(self.reprefilled) / exp if exp else 0.0,
                "kv_scale_min": min(self.kv_scale), "thrash_verdicts": float(self.thrash_verdicts),
                "prefill_us_per_token": p * 1e6, "step_ms": s0 * 1e3,
                "step_us_per_seq": s1 * 1e6, "tool_gap_s": gap if gap is not None else 0.0,
                "growth_tokens_per_turn": self.growth_per_turn(),
                "mean_turns": (float(np.mean(self._finished_turns))
                               if self._finished_turns else 0.0),
                # what it holds (bounded over a long job): per-trajectory records, block-model
                # entries, the survival history
                "state_entries": float(len(self.trajectories) + len(self._live) + len(self._group_of)
                                       + sum(self.index.cached_blocks(e) for e in range(self.num_engines))),
                "survival_history": float(len(self._finished_turns))}

    def estimated_cached_tokens(self, engine_id: int, context: np.ndarray) -> int:
        """Modelled prefix-cache hit (tokens) of ``context`` on an engine (no side effects)."""
        tc = TrajectoryChain()
        tc.sync(context)
        return whole_blocks(self.index.matched_blocks(engine_id, tc.hashes) * BLOCK_SIZE,
                            self.block_sizes[engine_id])
