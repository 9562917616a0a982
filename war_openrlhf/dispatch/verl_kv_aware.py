"""verl's KV-cache-aware router (``KVCAwareBalancer`` + ``KVCacheAwareStrategy``), per turn.

Source: verl-project/verl pull request #7115 ("kvcaware" router), head commit
``0b402ca951d437b759d85e8b3e390a937c098c5e`` (2026-08-03). The PR is not merged: verl ``main``
(1dda039, 2026-08-22) has no ``verl/workers/rollout/router/kvcaware``. Paths below are relative
to ``verl/workers/rollout/router/kvcaware/`` unless they start with ``verl/``.

Per request (``balancer.py:221-256`` ``acquire_server``; one request = one turn: verl's
``LLMServerClient.generate`` acquires with the trajectory's sticky ``request_id`` and releases
in ``finally``, ``verl/workers/rollout/llm_server.py:66-71,102,129``):

1. **Sticky shortcut** (``strategies/kvc_aware.py:198-228``, enabled by ``do_shortcut``,
   ``:248-252``). If the trajectory is bound to a replica (``store/data_store.py:226-228``)
   and that replica is in the pool, it wins -- unless ``is_overloaded`` says otherwise, then
   scoring falls through (``:220-222``). A bound replica not in the pool also falls through
   (``:227-228``). ``is_overloaded`` (``:166-196``) by ``overload_mode``:
   ``"kv_load"``: ``load > load_threshold`` (``:183-193``); ``"kv_cache_usage_perc"``: vLLM's
   ``kv_cache_usage_perc > load_threshold`` (``:179-182``); ``"None"``: never (``:177-178``).
2. **Slow cut** after a miss (``:253-261``), by ``slow_cut``:

   * ``"prefix-load-aware"`` (``:263-304``): per replica
     ``score = alpha * S_cache + (1 - alpha) * (1 - load)`` (``:286-290``) with
     ``load = a*kv_usage + b*min(1, running/M) + c*min(1, waiting/M) + d*min(1, inflight/M)``
     (``_compute_load``, ``:139-164``), ``M = max_num_seqs``, and
     ``S_cache = w_gpu*gpu_hit + w_cpu*cpu_hit + w_ssd*ssd_hit`` (``:306-326``). Only the GPU
     layer has an index, CPU/SSD hits are always 0 (``store/kv_cache_store.py:138``), so
     ``S_cache = w_gpu * gpu_hit`` <= 0.7 by default. ``gpu_hit`` = leading full blocks of the
     prompt the replica holds / full blocks of the prompt (``store/kv_cache_store.py:143-153``;
     full blocks only, ``utils/prefix_cache.py:26-59``; 0 for a prompt under one block).
   * ``"least-inflight"``: ``score = -inflight`` (``:253-254``).
   * ``"capacity-token-aware"`` (``:345-424``): ``cap`` = one replica's KV tokens
     (``:330-343``); per replica ``avail = cap*(1 - kv_cache_usage_perc)``,
     ``need = len(prompt)*(1 - gpu_hit)``, ``remaining = avail - need`` (``:375-377``). A
     trajectory with no binding ("cold start") goes to the fewest in-flight prompt tokens
     (``:393-396``); otherwise the largest ``remaining`` among replicas with
     ``avail >= cap*(1 - load_threshold)``, or among all if none is (``:392,398-403``).
3. **Ranking**: highest score first, a *stable* sort, so ties go to the earlier replica in the
   pool (``strategies/routing.py:116``; ``balancer.py:243`` takes ``ranking[0]``). Pool order
   is engine id order here.
4. **Bookkeeping**: ``on_acquire`` (re)binds ``request_id -> replica``
   (``collectors/decoder/basic/sticky.py:47-51``) in an LRU of 10000 request ids
   (``store/per_request_store.py:35``; bindings are never dropped when a trajectory ends) and
   adds 1 to the replica's in-flight count and ``len(prompt)`` to its in-flight tokens;
   ``on_release`` subtracts them (``collectors/decoder/basic/inflight.py:79-100``).
   ``kv_usage`` is ``store.kv_cache_load`` = GPU blocks the replica retains according to its
   vLLM KV events (BlockStored - BlockRemoved) / ``num_gpu_blocks``, capped at 1
   (``store/data_store.py:180-194``) -- NOT vLLM's ``kv_cache_usage_perc`` gauge: cached free
   blocks count. An AllBlocksCleared event (prefix-cache reset) empties the replica's index
   (``collectors/collector.py:155-156``); bindings survive it.

Defaults are those of the shipped Hydra config that selects this router,
``verl/trainer/config/rollout/router/kvcaware.yaml:15-25``: ``slow_cut="prefix-load-aware"``,
``overload_mode="kv_load"``, ``do_shortcut=True``, ``alpha=0.3``, ``load_threshold=0.6``,
``layer_weights={gpu: 0.7, cpu: 0.2, ssd: 0.1}`` (the strategy's one weight is 1.0, so
``route``'s weighted sum, ``routing.py:95-114``, changes nothing). ``load_weights =
(0.5, 0, 0, 0.5)`` is the code default (``strategies/kvc_aware.py:35``; the yaml does not set
it). ``max_num_seqs=1024``: the balancer reads it from the server's rollout config
(``balancer.py:99-124``, 256 only if no server answers), whose default is 1024
(``verl/trainer/config/rollout/rollout.yaml:92``). The config dataclass alone has other
defaults, ``alpha=0.7, load_threshold=0.9`` (``config/strategy.py:36-37``); pass them to model a
run built without the yaml.

Not modelled: ``memory_overload_filter`` (``config/strategy.py:41``) is not read at this commit
-- ``_sticky_shortcut`` calls ``is_overloaded`` unconditionally (``strategies/kvc_aware.py:220``)
-- so it has no parameter here; ``overload_mode="None"`` is how the source turns the check off.
A later variant of this file (seen only in a code-search index, repository and commit not
resolvable, so not citable) adds an ``overload_mode="skew"`` with ``skew_window=60,
skew_delta=2, skew_factor=2.0``, split sticky/capacity thresholds, windowed random first binds
and ``tie_epsilon`` for capacity-token-aware; its defaults leave the default path above
(prefix-load-aware + kv_load) unchanged, and none of it is modelled.

Deviations, forced by the dispatch interface:

* **Cache view.** verl's index follows the engines' real KV events; the dispatcher sees no
  engine cache, so each engine's cache is the block-hash model
  (:class:`~.block_index.BlockHashIndex`: an LRU of 16-token block hashes bounded by the
  engine's ``kv_capacity_tokens``). A turn's blocks (context + response, minus the last sampled
  token, which has no KV) enter the model when the turn finishes -- the interface's only event
  after the engine computed them; vLLM emits BlockStored for the prompt at prefill scheduling,
  so concurrent turns can see a sibling's prompt a little earlier in verl. The model evicts
  LRU blocks even if a running request still uses them. ``gpu_hit`` and ``kv_usage`` are
  computed from this model (``kv_usage`` = modelled blocks / capacity blocks, in 16-token
  blocks; matches are cut to the engine's ``kv_block_size``).
* **vLLM's ``kv_cache_usage_perc`` gauge** (used only by ``overload_mode="kv_cache_usage_perc"``
  and ``slow_cut="capacity-token-aware"``) is polled every 5 s in verl; here it is the
  distinct context blocks of the engine's in-flight turns / its capacity blocks, current at
  each decision (response blocks growing during decode are not counted).
* **running / waiting** (weights 0 by default) come from the ``EngineState`` snapshot instead of
  a 5 s metrics poll; ``max_num_seqs`` is a constructor argument (``EngineState`` does not
  carry it): pass the engines' real value.
* **In-flight counts** are the policy's own acquire/release counters, as in verl: ``choose()``
  acquires, ``on_turn_finished`` (or ``on_trajectory_finished``) releases.
* **Health.** verl has no health state; an unhealthy engine is left out of the pool, so a
  trajectory bound to it takes the "bound replica not in pool" path and is re-scored.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .base import DispatchPolicy, EngineState, PolicyOptions, TurnRequest
from .block_index import BLOCK_SIZE, BlockHashIndex, TrajectoryChain, chain_hashes, whole_blocks

__all__ = ["VerlKvAwarePolicy", "SLOW_CUTS", "OVERLOAD_MODES"]

SLOW_CUTS = ("prefix-load-aware", "least-inflight", "capacity-token-aware")  # types/slow_cut.py:36-38
OVERLOAD_MODES = ("kv_load", "kv_cache_usage_perc", "None")  # types/overload_mode.py:35-39
LAYERS = ("gpu", "cpu", "ssd")  # types/layer.py:36-38

DEFAULT_ALPHA = 0.3  # kvcaware.yaml:19
DEFAULT_LOAD_THRESHOLD = 0.6  # kvcaware.yaml:21
DEFAULT_LAYER_WEIGHTS = {"gpu": 0.7, "cpu": 0.2, "ssd": 0.1}  # kvcaware.yaml:22-25
DEFAULT_LOAD_WEIGHTS = (0.5, 0.0, 0.0, 0.5)  # strategies/kvc_aware.py:35
DEFAULT_MAX_NUM_SEQS = 1024  # verl/trainer/config/rollout/rollout.yaml:92
DEFAULT_LRU_CAPACITY = 10000  # store/per_request_store.py:35

_UNSET_CAPACITY = 1 << 62


def _is_number(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _check_options(alpha, load_threshold, layer_weights, load_weights, max_num_seqs, slow_cut, overload_mode,
                   do_shortcut, lru_capacity) -> tuple[dict, tuple]:
    """The source's own checks (strategies/kvc_aware.py:59-89), as ValueError naming the argument;
    returns the layer weights (defaults filled in) and the load weights as a tuple."""
    if not _is_number(alpha) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if not _is_number(load_threshold) or not 0.0 < load_threshold < 1.0:
        raise ValueError(f"load_threshold must be in (0, 1), got {load_threshold!r}")
    lw = dict(DEFAULT_LAYER_WEIGHTS if layer_weights is None else layer_weights)
    if set(lw) != set(LAYERS):
        raise ValueError(f"layer_weights keys must be {set(LAYERS)}, got {set(lw)}")
    if any(not _is_number(v) or not v >= 0 for v in lw.values()):
        raise ValueError(f"layer_weights values must be numbers >= 0, got {lw}")
    if abs(sum(lw.values()) - 1.0) > 1e-6:
        raise ValueError(f"layer_weights values must sum to 1.0, got {sum(lw.values())}")
    ldw = tuple(load_weights)
    if len(ldw) != 4 or any(not _is_number(w) or not w >= 0 for w in ldw):
        raise ValueError(f"load_weights must be 4 non-negative numbers, got {load_weights!r}")
    if abs(sum(ldw) - 1.0) > 1e-6:
        raise ValueError(f"load_weights must sum to 1.0, got {sum(ldw)}")
    if not isinstance(max_num_seqs, (int, np.integer)) or isinstance(max_num_seqs, bool) \
            or max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs must be a positive int, got {max_num_seqs!r}")
    if slow_cut not in SLOW_CUTS:
        raise ValueError(f"slow_cut must be one of {list(SLOW_CUTS)}, got {slow_cut!r}")
    if overload_mode not in OVERLOAD_MODES:
        raise ValueError(f"overload_mode must be one of {list(OVERLOAD_MODES)}, got {overload_mode!r}")
    if not isinstance(do_shortcut, bool):
        raise ValueError(f"do_shortcut must be a bool, got {do_shortcut!r}")
    if not isinstance(lru_capacity, (int, np.integer)) or isinstance(lru_capacity, bool) \
            or lru_capacity <= 0:
        raise ValueError(f"lru_capacity must be a positive int, got {lru_capacity!r}")
    return lw, ldw


@dataclass(frozen=True)
class VerlKvAwareOptions(PolicyOptions):
    """Options of ``verl_kv_aware`` (the pull request's names and defaults)."""

    alpha: float = field(default=DEFAULT_ALPHA, metadata={
        "help": "weight of the cache score against the load score, in [0, 1]"})
    load_threshold: float = field(default=DEFAULT_LOAD_THRESHOLD, metadata={
        "help": "load above which the bound engine counts as overloaded, in (0, 1)"})
    layer_weights: Optional[Mapping[str, float]] = field(default=None, metadata={
        "help": "cache-layer weights {gpu, cpu, ssd} summing to 1 (null: 0.7, 0.2, 0.1)"})
    load_weights: Sequence[float] = field(default=DEFAULT_LOAD_WEIGHTS, metadata={
        "help": "the load formula's 4 weights, summing to 1"})
    max_num_seqs: int = field(default=DEFAULT_MAX_NUM_SEQS, metadata={"help": "M of the load formula (verl reads it from the rollout config)"})
    slow_cut: str = field(default="prefix-load-aware", metadata={"help": " | ".join(SLOW_CUTS)})
    overload_mode: str = field(default="kv_load", metadata={"help": " | ".join(OVERLOAD_MODES)})
    do_shortcut: bool = field(default=True, metadata={"help": "the sticky shortcut: a bound trajectory stays unless its engine is overloaded"})
    lru_capacity: int = field(default=DEFAULT_LRU_CAPACITY, metadata={"help": "trajectories the binding map remembers"})

    def __post_init__(self) -> None:
        _check_options(**self.as_kwargs())


class VerlKvAwarePolicy(DispatchPolicy):
    name = "verl_kv_aware"
    Options = VerlKvAwareOptions

    def __init__(self, num_engines: int, *, alpha: float = DEFAULT_ALPHA,
                 load_threshold: float = DEFAULT_LOAD_THRESHOLD,
                 layer_weights: Optional[Mapping[str, float]] = None,
                 load_weights: Sequence[float] = DEFAULT_LOAD_WEIGHTS,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 slow_cut: str = "prefix-load-aware", overload_mode: str = "kv_load",
                 do_shortcut: bool = True, lru_capacity: int = DEFAULT_LRU_CAPACITY) -> None:
        super().__init__(num_engines)
        lw, ldw = _check_options(alpha, load_threshold, layer_weights, load_weights, max_num_seqs, slow_cut,
                                 overload_mode, do_shortcut, lru_capacity)
        self.alpha = float(alpha)
        self.load_threshold = float(load_threshold)
        self.layer_weights = {k: float(v) for k, v in lw.items()}
        self.load_weights = tuple(float(w) for w in ldw)
        self.max_num_seqs = int(max_num_seqs)
        self.slow_cut = slow_cut
        self.overload_mode = overload_mode
        self.do_shortcut = do_shortcut
        self.lru_capacity = int(lru_capacity)

        self.index = BlockHashIndex(num_engines, [_UNSET_CAPACITY] * num_engines)
        self._caps: Dict[int, int] = {}  # engine -> kv_capacity_tokens last seen
        self.block_sizes = [BLOCK_SIZE] * num_engines
        self._bindings: "OrderedDict[str, int]" = OrderedDict()  # sticky LRU: trajectory -> engine
        self._chains: Dict[str, TrajectoryChain] = {}
        self.inflight = [0] * num_engines
        self.inflight_tokens = [0] * num_engines
        self._active_blocks: List[Counter] = [Counter() for _ in range(num_engines)]
        # trajectory -> (engine, prompt tokens, context block hashes) of its in-flight turn
        self._active: Dict[str, Tuple[int, int, Tuple[int, ...]]] = {}
        self.last_scores: Dict[int, float] = {}  # engine -> score of the last slow-cut decision
        self.last_path = ""  # "sticky" or the slow cut used, for inspection

    # ---- the signals the router reads ------------------------------------------------------
    def kv_usage(self, engine_id: int) -> float:
        """``store.kv_cache_load``: retained (modelled) blocks / the engine's blocks, capped at 1;
        0 while the capacity is unknown (data_store.py:188-194)."""
        cap = self._caps.get(engine_id, 0) // BLOCK_SIZE
        if cap <= 0:
            return 0.0
        return min(1.0, self.index.cached_blocks(engine_id) / float(cap))

    def kv_cache_usage_perc(self, engine_id: int) -> float:
        """Stand-in for vLLM's ``kv_cache_usage_perc`` gauge: blocks pinned by in-flight turns."""
        cap = self._caps.get(engine_id, 0) // BLOCK_SIZE
        if cap <= 0:
            return 0.0
        return min(1.0, len(self._active_blocks[engine_id]) / float(cap))

    def load(self, e: EngineState) -> float:
        """``_compute_load`` (strategies/kvc_aware.py:157-164); bigger = more loaded."""
        a, b, c, d = self.load_weights
        m = float(self.max_num_seqs)
        i = e.engine_id
        return (a * self.kv_usage(i) + b * min(1.0, e.running / m) + c * min(1.0, e.waiting / m)
                + d * min(1.0, self.inflight[i] / m))

    def is_overloaded(self, e: EngineState) -> bool:
        """``is_overloaded`` (strategies/kvc_aware.py:177-193)."""
        if self.overload_mode == "None":
            return False
        if self.overload_mode == "kv_cache_usage_perc":
            return self.kv_cache_usage_perc(e.engine_id) > self.load_threshold
        return self.load(e) > self.load_threshold

    def engine_of(self, trajectory_id: str) -> Optional[int]:
        """The engine the sticky LRU binds the trajectory to (None if absent); no LRU touch."""
        return self._bindings.get(trajectory_id)

    # ---- choose ---------------------------------------------------------------------------
    def choose(self, request: TurnRequest, engines: Sequence[EngineState]) -> int:
        healthy = sorted(self._healthy(engines), key=lambda e: e.engine_id)  # the pool, in order
        for e in healthy:
            self.block_sizes[e.engine_id] = max(BLOCK_SIZE, e.kv_block_size // BLOCK_SIZE * BLOCK_SIZE)
            if self._caps.get(e.engine_id) != e.kv_capacity_tokens:
                self._caps[e.engine_id] = e.kv_capacity_tokens
                self.index.set_capacity(e.engine_id, e.kv_capacity_tokens // BLOCK_SIZE)
        tid = request.trajectory_id
        context = np.asarray(request.context_token_ids, dtype=np.int32)
        chain = self._chains.get(tid)
        if chain is None:
            chain = self._chains[tid] = TrajectoryChain()
        chain.sync(context)
        hashes = chain.hashes

        chosen = None
        bound = self._bindings.get(tid)
        if self.do_shortcut and bound is not None:
            for e in healthy:
                if e.engine_id == bound:
                    if not self.is_overloaded(e):
                        chosen = bound
                        self.last_path = "sticky"
                    break
        if chosen is None:
            self.last_path = self.slow_cut
            chosen = self._slow_cut(healthy, hashes, len(context), bound is not None)

        # on_acquire: rebind (LRU refresh) and count the turn in flight on `chosen`
        self._release(tid)
        blocks = tuple(hashes)
        self.inflight[chosen] += 1
        self.inflight_tokens[chosen] += len(context)
        self._active_blocks[chosen].update(blocks)
        self._active[tid] = (chosen, len(context), blocks)
        self._bindings[tid] = chosen
        self._bindings.move_to_end(tid)
        while len(self._bindings) > self.lru_capacity:
            self._bindings.popitem(last=False)
        return chosen

    def gpu_hits(self, healthy: Sequence[EngineState], hashes: List[int], n_tokens: int) -> Dict[int, float]:
        """``gpu_hit`` per engine: leading full blocks it holds / full blocks of the prompt."""
        matched = self.index.match_engines(hashes, healthy)
        out: Dict[int, float] = {}
        for e in healthy:
            bs = self.block_sizes[e.engine_id]
            total = n_tokens // bs
            got = whole_blocks(matched.get(e.engine_id, 0) * BLOCK_SIZE, bs) // bs
            out[e.engine_id] = got / total if total else 0.0
        return out

    def _slow_cut(self, healthy: List[EngineState], hashes: List[int], n_tokens: int, bound: bool) -> int:
        if self.slow_cut == "least-inflight":
            scores = {e.engine_id: -float(self.inflight[e.engine_id]) for e in healthy}
            self.last_scores = scores
            return self._top(healthy, scores)
        hits = self.gpu_hits(healthy, hashes, n_tokens)
        if self.slow_cut == "prefix-load-aware":
            w_gpu = self.layer_weights["gpu"]  # cpu/ssd hits are 0 (kv_cache_store.py:138)
            scores = {e.engine_id: self.alpha * (w_gpu * hits[e.engine_id])
                      + (1.0 - self.alpha) * (1.0 - self.load(e)) for e in healthy}
            self.last_scores = scores
            return self._top(healthy, scores)
        # capacity-token-aware (strategies/kvc_aware.py:366-403)
        cap = next((self._caps[i] for i in sorted(self._caps) if self._caps[i] > 0), 0)
        rem: Dict[int, float] = {}
        avail: Dict[int, float] = {}
        for e in healthy:
            i = e.engine_id
            avail[i] = cap * (1.0 - self.kv_cache_usage_perc(i))
            rem[i] = avail[i] - n_tokens * (1.0 - hits[i])
        self.last_scores = rem
        if not bound:  # cold start: fewest in-flight prompt tokens, first in the pool on ties
            return min(healthy, key=lambda e: self.inflight_tokens[e.engine_id]).engine_id
        thresh = cap * (1.0 - self.load_threshold)
        eligible = [e for e in healthy if avail[e.engine_id] >= thresh] or healthy
        return max(eligible, key=lambda e: rem[e.engine_id]).engine_id

    @staticmethod
    def _top(healthy: List[EngineState], scores: Dict[int, float]) -> int:
        """Highest score; ties to the first in the pool (the stable sort of routing.py:116)."""
        best = healthy[0].engine_id
        for e in healthy[1:]:
            if scores[e.engine_id] > scores[best]:
                best = e.engine_id
        return best

    # ---- events ---------------------------------------------------------------------------
    def _release(self, trajectory_id: str) -> None:
        """``on_release`` of the trajectory's in-flight turn, if any."""
        active = self._active.pop(trajectory_id, None)
        if active is None:
            return
        engine, n_tokens, blocks = active
        self.inflight[engine] -= 1
        self.inflight_tokens[engine] -= n_tokens
        counter = self._active_blocks[engine]
        counter.subtract(blocks)
        for h in set(blocks):
            if counter[h] <= 0:
                del counter[h]

    def on_turn_finished(self, request: TurnRequest, engine_id: int, response_token_ids: np.ndarray) -> None:
        """Release the turn; the engine now holds its context + response blocks (KV events)."""
        self._release(request.trajectory_id)
        response = np.asarray(response_token_ids, dtype=np.int32)
        stream = np.concatenate([np.asarray(request.context_token_ids, dtype=np.int32),
                                 response[:-1] if len(response) else response])
        chain = self._chains.get(request.trajectory_id)
        if chain is None:  # a turn this policy did not dispatch: hash it without keeping a chain
            self.index.touch(engine_id, chain_hashes(stream))
            return
        chain.sync(stream)  # the next turn's context extends this stream
        self.index.touch(engine_id, chain.hashes)

    def on_trajectory_finished(self, trajectory_id: str) -> None:
        """Release a turn still in flight and drop the hash chain; the binding stays in the LRU
        (verl never deletes it, per_request_store.py:35)."""
        self._release(trajectory_id)
        self._chains.pop(trajectory_id, None)

    def on_prefix_cache_reset(self) -> None:
        """AllBlocksCleared on every engine (collector.py:155-156): empty the cache model."""
        self.index = BlockHashIndex(self.num_engines, list(self.index.capacity_blocks))

    def estimated_cached_tokens(self, engine_id: int, context: np.ndarray) -> int:
        matched = self.index.matched_blocks(engine_id, chain_hashes(np.asarray(context, dtype=np.int32)))
        return whole_blocks(matched * BLOCK_SIZE, self.block_sizes[engine_id])

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_engines={self.num_engines}, alpha={self.alpha}, "
                f"load_threshold={self.load_threshold}, slow_cut={self.slow_cut!r}, "
                f"overload_mode={self.overload_mode!r})")
