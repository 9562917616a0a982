"""Draft proposers behind one interface, so benchmarks compare them on equal terms.

Each proposer is driven the way vLLM drives its proposer: a turn starts with its
prompt, every verification step reports the tokens the engine emitted, the proposer
drafts for the next step from the context so far, and the turn finishes.

- :class:`NoSpeculation`: the baseline.
- :class:`NgramProposer`: vLLM's ``ngram`` method (prompt lookup). Calls vLLM's own
  matcher, ``_find_longest_matched_ngram_and_propose_tokens``.
- :class:`PerEngineSuffixProposer`: vLLM's ``suffix`` method today: one arctic-inference
  ``SuffixDecodingCache`` per engine, fed exactly as ``vllm/v1/spec_decode/suffix_decoding.py``
  feeds it (prompt tree per request; every engine's responses, live and finished, in
  that engine's global tree; FIFO eviction by request count).
- :class:`WarGlobalProposer`: WAR: one :class:`GlobalSuffixIndex` replica per engine,
  all applying one :class:`CompletedSequenceLog` of finished turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .index import GlobalSuffixIndex, SuffixIndexConfig
from .log import CompletedSequenceLog
from .records import CompletedSequence


def _writable(tokens: np.ndarray) -> np.ndarray:
    """arctic's nanobind bindings accept only writable, contiguous int32 buffers."""
    if tokens.dtype == np.int32 and tokens.flags.writeable and tokens.flags.c_contiguous:
        return tokens
    return np.array(tokens, dtype=np.int32)


@dataclass(frozen=True)
class TurnRequest:
    """What a proposer may know about a live turn."""

    request_id: str
    engine: int
    trajectory_id: str
    group_id: str
    prompt_token_ids: np.ndarray


class Proposer(Protocol):
    name: str

    def start(self, req: TurnRequest) -> None: ...

    def propose(self, req: TurnRequest, context: np.ndarray, max_tokens: int) -> list[int]: ...

    def observe(self, req: TurnRequest, emitted: np.ndarray) -> None: ...

    def finish(self, req: TurnRequest, response: np.ndarray, policy_version: int = 0) -> None: ...


class NoSpeculation:
    name = "none"

    def start(self, req: TurnRequest) -> None:
        pass

    def propose(self, req: TurnRequest, context: np.ndarray, max_tokens: int) -> list[int]:
        return []

    def observe(self, req: TurnRequest, emitted: np.ndarray) -> None:
        pass

    def finish(self, req: TurnRequest, response: np.ndarray, policy_version: int = 0) -> None:
        pass


class NgramProposer(NoSpeculation):
    """vLLM's prompt-lookup proposer; defaults are vLLM's (``prompt_lookup_min = max = 5``)."""

    name = "ngram"

    def __init__(self, min_n: int = 5, max_n: int = 5, max_model_len: int = 1 << 30) -> None:
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram: need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self._match = _find_longest_matched_ngram_and_propose_tokens
        self.min_n, self.max_n, self.max_model_len = min_n, max_n, max_model_len

    def propose(self, req: TurnRequest, context: np.ndarray, max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        out = self._match(
            origin_tokens=context, min_ngram=self.min_n, max_ngram=self.max_n,
            max_model_len=self.max_model_len, k=max_tokens,
        )
        return out.tolist()


class PerEngineSuffixProposer(NoSpeculation):
    """vLLM's ``suffix`` method: an arctic ``SuffixDecodingCache`` per engine.

    Defaults are vLLM's: depth 24, 10000 cached requests, spec factor 1.0, min prob 0.1.
    """

    name = "per_engine_suffix"

    def __init__(
        self,
        engines: int,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
    ) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.depth = max_tree_depth
        self.factor = max_spec_factor
        self.min_prob = min_token_prob
        self.caches = [SuffixDecodingCache(max_tree_depth, max_cached_requests) for _ in range(engines)]

    def start(self, req: TurnRequest) -> None:
        cache = self.caches[req.engine]
        if req.request_id in cache.cached_requests:
            cache.evict_cached_response(req.request_id)
        cache.start_request(req.request_id, _writable(req.prompt_token_ids))

    def observe(self, req: TurnRequest, emitted: np.ndarray) -> None:
        self.caches[req.engine].add_active_response(req.request_id, _writable(emitted))

    def propose(self, req: TurnRequest, context: np.ndarray, max_tokens: int) -> list[int]:
        if max_tokens <= 0:
            return []
        pattern = _writable(context[-self.depth :])
        draft = self.caches[req.engine].speculate(
            req.request_id, pattern, max_spec_tokens=max_tokens,
            max_spec_factor=self.factor, min_token_prob=self.min_prob,
        )
        return list(draft.token_ids)

    def finish(self, req: TurnRequest, response: np.ndarray, policy_version: int = 0) -> None:
        self.caches[req.engine].stop_request(req.request_id)


class WarGlobalProposer(NoSpeculation):
    """WAR: a replica per engine; every finished turn goes to the shared log."""

    name = "war_global"

    def __init__(self, engines: int, config: SuffixIndexConfig | None = None) -> None:
        self.config = config or SuffixIndexConfig()
        self.log = CompletedSequenceLog()
        self.replicas = [GlobalSuffixIndex(self.config) for _ in range(engines)]

    def start(self, req: TurnRequest) -> None:
        replica = self.replicas[req.engine]
        replica.sync(self.log)
        replica.start_request(req.request_id, req.prompt_token_ids, req.group_id, req.trajectory_id)

    def observe(self, req: TurnRequest, emitted: np.ndarray) -> None:
        self.replicas[req.engine].extend_request(req.request_id, emitted)

    def propose(self, req: TurnRequest, context: np.ndarray, max_tokens: int) -> list[int]:
        replica = self.replicas[req.engine]
        if replica.applied_seq != self.log.last_seq:
            replica.sync(self.log)
        return replica.speculate(req.request_id, context[-self.config.max_tree_depth :], max_tokens).token_ids

    def finish(self, req: TurnRequest, response: np.ndarray, policy_version: int = 0) -> None:
        self.replicas[req.engine].stop_request(req.request_id)
        self.log.append(
            CompletedSequence.create(req.trajectory_id, req.group_id, policy_version, req.prompt_token_ids, response)
        )
