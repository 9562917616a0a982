"""NVIDIA Dynamo's KV router (``--router-mode kv``), per turn.

Modelled on ``lib/kv-router/src/scheduling/selector.rs`` (ai-dynamo/dynamo,
``DefaultWorkerSelector::select_worker`` and ``softmax_sample``), defaults of its
``KvRouterConfig``: ``overlap_score_weight = 1``, ``router_temperature = 0``.

For a request of ``isl`` tokens and every worker::

    new_tokens      = isl - overlap_blocks * block_size        # not in the worker's KV cache
    prefill_blocks  = (prefill_tokens + new_tokens) / block_size
    logit           = overlap_score_weight * prefill_blocks + decode_blocks

and the lowest logit wins; at temperature 0 ties are broken uniformly at random (here by a
seeded generator, so runs replay), above 0 a worker is sampled by softmax over the logits
normalised by their range. ``prefill_tokens`` and ``decode_blocks`` are the worker's active
sequences as the router tracks them from its own decisions: a routed request adds its
uncached tokens to the worker's prefill tokens and its blocks to the worker's active blocks
(blocks shared by two active requests count once, as Dynamo's ``ActiveSequences`` hashes
them). ``overlap_blocks`` comes from the router's view of the worker's cache; with KV
events off (``--no-kv-events``) Dynamo predicts it from its routing decisions, which is what
the block-hash model here does (:class:`~.block_index.BlockHashIndex`, bounded by each
engine's KV capacity, counted in the engine's own blocks).

Deviations, forced by the dispatch interface: a request's prefill tokens stay counted until
its turn finishes (Dynamo drops them at the first output token, an event this interface does
not see), and unhealthy engines are skipped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Sequence

import numpy as np

from .base import DispatchPolicy, EngineState, PolicyOptions, TurnRequest
from .block_index import BLOCK_SIZE, BlockHashIndex, chain_hashes, coarse_chain, whole_blocks

__all__ = ["DynamoKvPolicy"]

_UNSET_CAPACITY = 1 << 62


@dataclass(frozen=True)
class DynamoKvOptions(PolicyOptions):
    """Options of ``dynamo_kv`` (Dynamo's KV router names and defaults)."""

    overlap_score_weight: float = field(default=1.0, metadata={
        "help": "weight of the prefill blocks in the logit (+ active decode blocks; lowest wins)"})
    router_temperature: float = field(default=0.0, metadata={
        "help": "0: the lowest logit wins; above 0: an engine sampled by softmax over the logits"})
    seed: int = field(default=0, metadata={"help": "seed of the random tie-break (temperature 0) and of the sampling"})

    def __post_init__(self) -> None:
        if not self.overlap_score_weight >= 0:
            raise ValueError(f"overlap_score_weight must be >= 0, got {self.overlap_score_weight}")
        if not self.router_temperature >= 0:
            raise ValueError(f"router_temperature must be >= 0, got {self.router_temperature}")


class DynamoKvPolicy(DispatchPolicy):
    name = "dynamo_kv"
    Options = DynamoKvOptions

    def __init__(self, num_engines: int, *, overlap_score_weight: float = 1.0, router_temperature: float = 0.0,
                 seed: int = 0) -> None:
        super().__init__(num_engines)
        DynamoKvOptions(overlap_score_weight, router_temperature, seed)  # the checks
        self.overlap_score_weight = float(overlap_score_weight)
        self.router_temperature = float(router_temperature)
        self._rng = np.random.default_rng(seed)
        self.index = BlockHashIndex(num_engines, [_UNSET_CAPACITY] * num_engines)
        self._caps: Dict[int, int] = {}
        self.block_sizes = [BLOCK_SIZE] * num_engines
        self.prefill_tokens = [0] * num_engines
        self._active_blocks: List[Counter] = [Counter() for _ in range(num_engines)]
        # trajectory -> (engine, prefill tokens counted, block hashes counted) of its active turn
        self._active: Dict[str, tuple] = {}
        self.last_logits: Dict[int, float] = {}

    def decode_blocks(self, engine_id: int) -> int:
        """Distinct blocks of the engine's active sequences (in the engine's own block size)."""
        return len(self._active_blocks[engine_id])

    def choose(self, request: TurnRequest, engines: Sequence[EngineState]) -> int:
        healthy = self._healthy(engines)
        for e in healthy:
            self.block_sizes[e.engine_id] = max(BLOCK_SIZE, e.kv_block_size // BLOCK_SIZE * BLOCK_SIZE)
            if self._caps.get(e.engine_id) != e.kv_capacity_tokens:
                self._caps[e.engine_id] = e.kv_capacity_tokens
                self.index.set_capacity(e.engine_id, e.kv_capacity_tokens // BLOCK_SIZE)
        chain = chain_hashes(np.asarray(request.context_token_ids, dtype=np.int32))
        isl = len(request.context_token_ids)
        matched = self.index.match_engines(chain, healthy)
        logits: Dict[int, float] = {}
        for e in healthy:
            i = e.engine_id
            bs = self.block_sizes[i]
            new_tokens = max(0, isl - whole_blocks(matched.get(i, 0) * BLOCK_SIZE, bs))
            prefill_blocks = (self.prefill_tokens[i] + new_tokens) / bs
            logits[i] = self.overlap_score_weight * prefill_blocks + self.decode_blocks(i)
        self.last_logits = logits
        chosen = self._sample(logits)
        # the router's own view: the request is active on `chosen` and its prompt will be cached there
        new_tokens = max(0, isl - whole_blocks(matched.get(chosen, 0) * BLOCK_SIZE, self.block_sizes[chosen]))
        blocks = coarse_chain(chain, self.block_sizes[chosen])
        self._release(request.trajectory_id)
        self.prefill_tokens[chosen] += new_tokens
        self._active_blocks[chosen].update(blocks)
        self._active[request.trajectory_id] = (chosen, new_tokens, blocks)
        self.index.touch(chosen, chain)
        return chosen

    def _sample(self, logits: Dict[int, float]) -> int:
        """``softmax_sample``: temperature 0 -> a uniformly random minimum; else softmax of
        -logit / (max - min) / temperature."""
        keys = sorted(logits)
        values = np.array([logits[k] for k in keys])
        if self.router_temperature == 0.0:
            best = [k for k, v in zip(keys, values) if v == values.min()]
            return best[int(self._rng.integers(len(best)))]
        lo, hi = values.min(), values.max()
        if lo == hi:
            p = np.full(len(keys), 1.0 / len(keys))
        else:
            scaled = -values / (hi - lo) / self.router_temperature
            p = np.exp(scaled - scaled.max())
            p /= p.sum()
        return keys[int(self._rng.choice(len(keys), p=p))]

    def _release(self, trajectory_id: str) -> None:
        active = self._active.pop(trajectory_id, None)
        if active is None:
            return
        engine, prefill, blocks = active
        self.prefill_tokens[engine] -= prefill
        counter = self._active_blocks[engine]
        counter.subtract(blocks)
        for h in blocks:
            if counter[h] <= 0:
                del counter[h]

    def on_turn_finished(self, request: TurnRequest, engine_id: int, response_token_ids: np.ndarray) -> None:
        self._release(request.trajectory_id)
        stream = np.concatenate([np.asarray(request.context_token_ids, dtype=np.int32),
                                 np.asarray(response_token_ids, dtype=np.int32)])
        self.index.touch(engine_id, chain_hashes(stream))

    def on_trajectory_finished(self, trajectory_id: str) -> None:
        self._release(trajectory_id)

    def on_prefix_cache_reset(self) -> None:
        """vLLM publishes ``AllBlocksCleared`` when its prefix cache is reset, and Dynamo's
        indexer drops the worker's blocks on it: the model is emptied, capacities kept."""
        self.index = BlockHashIndex(self.num_engines, list(self.index.capacity_blocks))

    def estimated_cached_tokens(self, engine_id: int, context: np.ndarray) -> int:
        matched = self.index.matched_blocks(engine_id, chain_hashes(np.asarray(context, dtype=np.int32)))
        return whole_blocks(matched * BLOCK_SIZE, self.block_sizes[engine_id])

