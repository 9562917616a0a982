"""The WAR replica behind vLLM's ``SuffixDecodingProposer``: :class:`WarSuffixCache`.

Why it exists: vLLM's ``suffix`` drafter delegates to one arctic-inference
``SuffixDecodingCache`` (``proposer.suffix_cache``); this class implements the
surface the proposer uses on top of a :class:`GlobalSuffixIndex` replica, so the
worker extension can swap it in (see :mod:`war_openrlhf.engine.worker_extension`).
Runs in the worker process (the model runner's thread, inside ``propose``); it has
no vLLM import and is also driven directly by tests.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from war_openrlhf.speculation.index import Draft, GlobalSuffixIndex

__all__ = ["WarSuffixCache"]

_SOURCES = ("request", "group", "inflight", "live", "global")


def _empty_keys():
    return {}.keys()


_NO_CACHED = _empty_keys()


class WarSuffixCache:
    """arctic-inference ``SuffixDecodingCache``'s surface, as vLLM's proposer uses
    it, backed by a :class:`GlobalSuffixIndex` replica.

    - ``start_request``/``add_active_response``/``stop_request`` map to the index's
      ``start_request``/``extend_request``/``stop_request`` (vLLM's per-turn
      ``req_id`` is the index's request id; trajectory and group come from
      ``request_meta(req_id)``, normally the request's ``extra_args``).
    - ``speculate`` returns the index's :class:`Draft` (``.token_ids``); the index's
      own config (spec factor, min prob, match window) decides, vLLM's
      ``max_spec_factor``/``min_token_prob`` arguments are ignored, ``max_spec_tokens``
      is honoured; ``min_token_prob`` (set by the worker from the switch's cost-aware draft
      rule; None: the index's) overrides the index's cut-off.
    - ``cached_requests`` is always empty: finished responses reach the replica as
      log records, never from this engine's own request ids (so vLLM never calls
      ``evict_cached_response``).
    - A request is stopped at the first step *after* it left the batch (vLLM's
      loop), so the last batch stays active while the engine idles. When a new
      turn names a trajectory whose previous turn is still active but no longer
      ``in_batch(req_id)``, that turn is stopped first and its tree continued;
      a trajectory held by a request still in the batch (``n > 1`` siblings share
      ``extra_args``) gets a per-request tree instead.
    - ``enabled = False``: ``speculate`` returns empty drafts. Inside an engine the
      worker extension goes further and skips vLLM's proposer while drafting is off
      (releasing the requests; they restart from their prompts when it comes back),
      because at high load the per-request proposer work is a real share of a step.

    It also counts what it drafted and how much of it was accepted, per source:
    after a draft, the request's next ``add_active_response`` carries the accepted
    draft tokens plus one sampled token, so ``accepted = common prefix``.
    """

    def __init__(
        self,
        index: GlobalSuffixIndex,
        request_meta: Callable[[str], tuple[str | None, str | None]] | None = None,
        in_batch: Callable[[str], bool] | None = None,
    ) -> None:
        self.index = index
        self.enabled = True
        self.min_token_prob: float | None = None
        self.step_score = 0.0  # accepted tokens the drafts proposed since the last reset expect
        self._request_meta = request_meta
        self._in_batch = in_batch
        self._active: dict[str, str | None] = {}  # req_id -> trajectory_id it holds
        self._traj_users: dict[str, str] = {}  # trajectory_id -> req_id using it
        self._pending: dict[str, tuple[str, list[int]]] = {}  # req_id -> (source, draft)
        self.reset_stats()

    # -------------------------------------------------------------- stats
    def reset_stats(self) -> None:
        self.counters = {
            "requests_started": 0,
            "requests_stopped": 0,
            "with_trajectory": 0,
            "with_group": 0,
            "speculate_calls": 0,
            "disabled_calls": 0,
            "empty_drafts": 0,
            "drafts": dict.fromkeys(_SOURCES, 0),
            "draft_tokens": dict.fromkeys(_SOURCES, 0),
            "accepted_tokens": dict.fromkeys(_SOURCES, 0),
        }

    # -------------------------------------------------------------- vLLM surface
    @property
    def max_tree_depth(self) -> int:
        return self.index.config.max_tree_depth

    @property
    def active_requests(self):
        """KeysView (vLLM computes ``active_requests - req_id_to_index.keys()``)."""
        return self._active.keys()

    @property
    def cached_requests(self):
        return _NO_CACHED

    def evict_cached_response(self, req_id: str) -> None:
        raise ValueError(f"Request '{req_id}' is not cached")  # as arctic: never cached here

    def start_request(self, req_id: str, prompt_token_ids: np.ndarray | Sequence[int]) -> None:
        if req_id in self._active:
            raise ValueError(f"Request '{req_id}' is already active")
        trajectory_id, group_id = self._request_meta(req_id) if self._request_meta else (None, None)
        holder = self._traj_users.get(trajectory_id) if trajectory_id is not None else None
        if holder is not None:
            if self._in_batch is not None and not self._in_batch(holder):
                # The trajectory's previous turn: it left the batch, but vLLM stops
                # it only after starting this one (end of the same propose call).
                self.stop_request(holder)
            else:
                # n > 1 fan-out (siblings share sampling params, not a context):
                # this one gets its own tree.
                trajectory_id = None
        self.index.start_request(req_id, prompt_token_ids, group_id=group_id, trajectory_id=trajectory_id)
        self._active[req_id] = trajectory_id
        c = self.counters
        c["requests_started"] += 1
        if trajectory_id is not None:
            self._traj_users[trajectory_id] = req_id
            c["with_trajectory"] += 1
        if group_id is not None:
            c["with_group"] += 1
        self._pending.pop(req_id, None)

    def add_active_response(self, req_id: str, token_ids: np.ndarray | Sequence[int]) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is not None and len(token_ids):
            source, draft = pending
            limit = min(len(draft), len(token_ids) - 1)
            n = 0
            while n < limit and int(token_ids[n]) == draft[n]:
                n += 1
            self.counters["accepted_tokens"][source] += n
        if type(token_ids) is list:  # vLLM's proposer hands each request's sampled ids as a list
            self.index.extend_request_engine(req_id, token_ids)
        else:
            self.index.extend_request(req_id, token_ids)

    def speculate(
        self,
        req_id: str,
        context: np.ndarray | Sequence[int],
        max_spec_tokens: int | None = None,
        max_spec_factor: float | None = None,  # noqa: ARG002 - the index's config decides
        max_spec_offset: float | None = None,  # noqa: ARG002
        min_token_prob: float | None = None,  # noqa: ARG002
        use_tree_spec: bool = False,
    ) -> Draft:
        if use_tree_spec:
            raise NotImplementedError("WarSuffixCache drafts chains only (use_tree_spec=False)")
        c = self.counters
        c["speculate_calls"] += 1
        if not self.enabled:
            c["disabled_calls"] += 1
            return Draft()
        if max_spec_tokens is None:
            max_spec_tokens = self.max_tree_depth
        draft = self.index.speculate_engine(req_id, np.asarray(context), int(max_spec_tokens), self.min_token_prob)
        if not draft.token_ids:
            c["empty_drafts"] += 1
            return draft
        c["drafts"][draft.source] += 1
        c["draft_tokens"][draft.source] += len(draft.token_ids)
        self._pending[req_id] = (draft.source, list(draft.token_ids))
        self.step_score += draft.score
        return draft

    def propose(self, input_batch: Any, sampled_token_ids: list[list[int]], num_speculative_tokens: int,
                max_model_len: int, pattern_len: int) -> list[list[int]]:
        """vLLM's ``SuffixDecodingProposer.propose`` over this cache, in one pass.

        The same drafts, request starts, appends, stops and counters as vLLM's loop
        (``vllm/v1/spec_decode/suffix_decoding.py``, ``propose``: skip partial prefills and
        requests at ``max_model_len``, start a request from its prompt, append its sampled ids,
        draft from the tail of its tokens, stop the requests that left the batch) calling
        :meth:`start_request`, :meth:`add_active_response`, :meth:`speculate` and
        :meth:`stop_request`; the per-request call layers (proposer, cache, index) cost more
        than the C++ trees at batch 32, so this loop looks each request up once and builds no
        :class:`Draft`. ``pattern_len``: the proposer's ``max_tree_depth`` (the tail of a
        request's tokens it hands to ``speculate``).
        """
        index, c, pending = self.index, self.counters, self._pending
        drafted, drafted_tokens, accepted = c["drafts"], c["draft_tokens"], c["accepted_tokens"]
        active, min_prob, enabled = self._active, self.min_token_prob, self.enabled
        req_ids, num_tokens_no_spec, token_ids_cpu = input_batch.req_ids, input_batch.num_tokens_no_spec, \
            input_batch.token_ids_cpu
        if token_ids_cpu.dtype != np.int32:  # vLLM's buffer is int32; the trees take nothing else
            token_ids_cpu = token_ids_cpu.astype(np.int32)
        drafts: list[list[int]] = []
        calls = empty = disabled = 0
        score_sum = 0.0
        for i, sampled in enumerate(sampled_token_ids):
            if not sampled:
                drafts.append([])  # a partial prefill
                continue
            num_tokens = int(num_tokens_no_spec[i])
            if num_tokens >= max_model_len:
                drafts.append([])
                continue
            rid = req_ids[i]
            if rid not in active:
                j = input_batch.req_id_to_index[rid]
                self.start_request(rid, token_ids_cpu[j, : input_batch.num_prompt_tokens[j]])
            state = index.engine_state(rid)
            last = pending.pop(rid, None)
            if last is not None:
                source, draft = last
                limit = min(len(draft), len(sampled) - 1)
                n = 0
                while n < limit and sampled[n] == draft[n]:
                    n += 1
                accepted[source] += n
            index.append_sampled(state, sampled)
            calls += 1
            if not enabled:  # vLLM's loop still feeds the requests; speculate answers empty
                disabled += 1
                drafts.append([])
                continue
            max_tokens = min(num_speculative_tokens, max_model_len - num_tokens - 1)
            if max_tokens <= 0:
                empty += 1
                drafts.append([])
                continue
            best, source = index.best_draft(state, token_ids_cpu[i, max(0, num_tokens - pattern_len):num_tokens],
                                            max_tokens, min_prob)
            tokens = best.token_ids
            if not tokens:
                empty += 1
                drafts.append([])
                continue
            drafted[source] += 1
            drafted_tokens[source] += len(tokens)
            pending[rid] = (source, tuple(tokens))  # vLLM may trim the list it is handed
            score_sum += best.score
            drafts.append(tokens)
        c["speculate_calls"] += calls
        c["empty_drafts"] += empty
        c["disabled_calls"] += disabled
        self.step_score += score_sum
        # the requests that left the batch (vLLM's proposer's expression, so in its order)
        for rid in self.active_requests - input_batch.req_id_to_index.keys():
            self.stop_request(rid)
        return drafts

    def stop_request(self, req_id: str) -> None:
        if req_id not in self._active:
            raise ValueError(f"Request '{req_id}' is not active")
        trajectory_id = self._active.pop(req_id)
        if trajectory_id is not None and self._traj_users.get(trajectory_id) == req_id:
            del self._traj_users[trajectory_id]
        self._pending.pop(req_id, None)
        self.index.stop_request(req_id)
        self.counters["requests_stopped"] += 1

    # -------------------------------------------------------------- stats
    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "enabled": self.enabled,
            "min_token_prob": self.min_token_prob,
            **{k: v for k, v in c.items() if not isinstance(v, dict)},
            "drafts": dict(c["drafts"]),
            "draft_tokens": dict(c["draft_tokens"]),
            "accepted_tokens": dict(c["accepted_tokens"]),
            "active_requests": len(self._active),
            "index": self.index.stats(),
        }
