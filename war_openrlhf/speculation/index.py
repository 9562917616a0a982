"""The global suffix index: one replica per engine, fed by the completed-sequence log.

SuffixDecoding drafts tokens by matching the tail of a request's context against
suffix trees of earlier text. vLLM's ``suffix`` method keeps one such tree per
engine, so a GRPO sibling on engine B cannot draft from the samples engine A
finished. Here every replica applies the same log, so every engine drafts from
every completed turn of the step (and of earlier steps, within a token budget).

The trees themselves are arctic-inference's C++ ``SuffixTree`` (:mod:`.suffix_tree`: compiled
here with a longest-first, incremental speculate that drafts the same); a replica
(:class:`GlobalSuffixIndex`) puts together:

- *replicated state* (deterministic from the log; :mod:`.replica`, applied in bounded
  slices): a global tree of completed records and, optionally, one tree per GRPO group;
- *local state* (per engine; :mod:`.request_trees`): a tree per live trajectory (its
  whole context plus what it generated, extended across turns instead of rebuilt), and
  a "live" tree of the engine's in-flight responses, as vLLM's proposer has;
- bounded memory: a token budget evicted oldest-first, and an optional maximum
  policy-version lag. Eviction drops records and rebuilds the tree from the
  survivors in log order (:mod:`.rebuild`), so a tree is always exactly "the surviving
  records, appended in order": replicas converge and ``save``/``load``
  (:mod:`.index_file`) is exact even where draft choice depends on ties, which the C++
  tree resolves by history.

Its knobs are :class:`~.index_config.SuffixIndexConfig`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .index_config import SuffixIndexConfig
from .index_file import IndexFileError, read_replica_file, save_replica
from .log import CompletedSequenceLog, LogEntry
from .records import as_token_array
from .replica import ReplicatedTrees
from .request_trees import RequestState, RequestTrees

__all__ = ["Draft", "GlobalSuffixIndex", "IndexFileError", "SuffixIndexConfig"]


@dataclass
class Draft:
    """A proposal: tokens, their estimated probabilities, and where they came from."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    source: str = "none"  # "request" | "group" | "inflight" | "live" | "global" | "none"


class GlobalSuffixIndex:
    """One replica of the global suffix index (see module docstring).

    Replicated side: :meth:`apply` / :meth:`sync` entries of a
    :class:`CompletedSequenceLog`. Engine side: :meth:`start_request`,
    :meth:`extend_request`, :meth:`speculate`, :meth:`stop_request`.
    """

    def __init__(self, config: SuffixIndexConfig | None = None, **overrides: Any) -> None:
        if config is None:
            config = SuffixIndexConfig(**overrides)
        elif overrides:
            config = SuffixIndexConfig(**{**asdict(config), **overrides})
        self.config = config
        self._depth = config.max_tree_depth
        self._replica = ReplicatedTrees(config)
        self._local = RequestTrees(config)
        # the compiled tree's incremental speculate (arctic's own tree has none)
        self._incremental = self._local.incremental

    # ================================================================ replication
    @property
    def applied_seq(self) -> int:
        """Sequence number of the last log entry applied (0: none)."""
        return self._replica.applied_seq

    @property
    def policy_version(self) -> int:
        return self._replica.policy_version

    def start_at(self, seq: int) -> None:
        """An empty replica joining a log whose entries up to ``seq`` are gone (truncated once
        every earlier replica had them): apply from ``seq + 1`` on."""
        self._replica.start_at(seq)

    def sync(self, log: CompletedSequenceLog, limit: int | None = None) -> int:
        """Apply the log's entries after those applied or queued, and any queued ones; returns how many."""
        return self.apply(log.read(self._replica.queued_seq, limit))

    def apply(self, entries: Iterable[LogEntry]) -> int:
        """Apply log entries in order, all of them now. Already-applied entries are skipped; a gap raises."""
        self.enqueue(entries)
        return self.work(None)["entries"]

    def enqueue(self, entries: Iterable[LogEntry]) -> int:
        """Queue log entries (in order, after what is applied or queued) for :meth:`work`; returns how many.

        Already-queued or applied entries are skipped; a gap raises ``ValueError`` and queues nothing.
        """
        return self._replica.enqueue(entries)

    @property
    def pending_entries(self) -> int:
        """Entries queued or partly applied (0: the replica holds everything it was given)."""
        return self._replica.pending_entries

    @property
    def has_pending_work(self) -> bool:
        """Entries to apply, or an eviction's rebuild to finish: :meth:`work` has something to do."""
        return self._replica.has_pending_work

    @property
    def pending_tokens(self) -> int:
        """Response tokens of queued records (what is left to insert, roughly)."""
        return self._replica.queued_tokens

    def work(self, budget_s: float | None) -> dict[str, Any]:
        """Apply queued entries for about ``budget_s`` seconds (``None``: until the queue is empty).

        At least one chunk of work is done per call when there is any, so the queue always
        drains. Returns ``{"entries": applied, "tokens": inserted, "seconds": spent}``.
        """
        return self._replica.work(budget_s)

    # ================================================================ requests
    def start_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] | np.ndarray,
        group_id: str | None = None,
        trajectory_id: str | None = None,
    ) -> None:
        """Register a live request (one turn). Its prompt becomes its own draft source.

        With ``trajectory_id``, the trajectory's tree from the previous turn is
        extended by the new tokens only, when the new prompt extends what it holds
        (a finished trajectory's tree ages out LRU, ``max_trajectory_trees``).
        """
        self._local.start(request_id, prompt_token_ids, group_id, trajectory_id)

    def extend_request(self, request_id: str, token_ids: Sequence[int] | np.ndarray) -> None:
        """Append tokens the request just generated (to its own tree and the live tree)."""
        self._local.extend(request_id, token_ids)

    def extend_request_engine(self, request_id: str, token_ids: list[int]) -> None:
        """:meth:`extend_request` for the engine's per-step hot path: ``token_ids`` is the list
        of ids the engine just sampled for the request (Python ints); a negative id (a padded
        slot) falls back to the checked path, which names it. The checked path's per-token
        validation was a large share of the drafter's time at batch 32 (cProfile of one engine)."""
        state = self._local.get(request_id)  # an unknown request is an error even with nothing to add
        if token_ids:
            self.append_sampled(state, token_ids)

    def stop_request(self, request_id: str) -> None:
        """The request finished (its record arrives through the log)."""
        state = self._local.stop(request_id)
        if self._incremental:
            self._replica.global_tree.forget_handle(state.handle)

    # ================================================================ speculation
    # Two entry points share :meth:`_speculate`: :meth:`speculate` checks every argument (any
    # caller: tests, benchmarks, proposers), :meth:`speculate_engine` only the request id, for
    # the engine's per-step hot path, whose context is already the engine's own int32 token
    # buffer (checking it again would cost a pass over the context every step).
    def speculate(self, request_id: str, context: Sequence[int] | np.ndarray, max_tokens: int) -> Draft:
        """Best draft for the request's ``context`` from its own tree, its group's
        tree (if enabled), its group's in-flight tree (turns still generating on any engine),
        the engine's live tree and the global tree.

        The highest score wins (group scores times ``group_bias``); ties go to the
        earlier source in that order, as arctic-inference prefers the prompt tree.
        Every argument is checked; the engine calls :meth:`speculate_engine`.
        """
        state = self._local.requests.get(request_id) if type(request_id) is str else None
        if state is None:
            state = self._local.get(request_id)  # raises with the reason
        if type(max_tokens) is not int:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, np.integer):
                raise ValueError(f"max_tokens: must be an int >= 0, got {max_tokens!r}")
            max_tokens = int(max_tokens)
        if max_tokens < 0:
            raise ValueError(f"max_tokens: must be an int >= 0, got {max_tokens!r}")
        return self._speculate(state, as_token_array(context, "context"), max_tokens)

    def speculate_engine(self, request_id: str, context: np.ndarray, max_tokens: int,
                         min_token_prob: float | None = None) -> Draft:
        """:meth:`speculate` for the engine's hot path: ``context`` is a 1-D int32 slice of
        the engine's own token buffer (ids the engine sampled, so never negative) and
        ``max_tokens`` an int; only the request id is checked. ``min_token_prob``: the engine's
        cost-aware cut-off for this step (None: the config's)."""
        state = self._local.requests.get(request_id)
        if state is None:
            state = self._local.get(request_id)
        if context.dtype != np.int32 or context.ndim != 1 or not context.size:
            context = as_token_array(context, "context")
        return self._speculate(state, context, max_tokens, min_token_prob)

    def _speculate(self, state: RequestState, ctx: np.ndarray, max_tokens: int,
                   min_token_prob: float | None = None) -> Draft:
        if max_tokens <= 0:
            return Draft()
        best, source = self.best_draft(state, ctx, max_tokens, min_token_prob)
        token_ids = best.token_ids
        if not token_ids:
            return Draft(match_len=best.match_len)
        return Draft(token_ids, best.probs, float(best.score), int(best.match_len), source)

    # The engine's batched drafter (:meth:`WarSuffixCache.propose`) works on request states:
    # one lookup per request and step, no :class:`Draft` built per call.
    def engine_state(self, request_id: str) -> RequestState | None:
        """The live request's state (None: not started)."""
        return self._local.requests.get(request_id)

    def append_sampled(self, state: RequestState, token_ids: list[int]) -> None:
        """Append the ids the engine just sampled for a live request (a non-empty list of ints);
        a negative id raises, naming the field."""
        if min(token_ids) < 0:
            as_token_array(token_ids, "token_ids")  # raises with the offending value
        self._local.append_to(state, np.array(token_ids, dtype=np.int32))

    def best_draft(self, state: RequestState, ctx: np.ndarray, max_tokens: int,
                   min_token_prob: float | None = None) -> tuple[Any, str]:
        """``(C++ draft, source)``: the best draft of every source for the request's context
        (``ctx``: 1-D contiguous int32, ``max_tokens`` > 0)."""
        cfg = self.config
        min_prob = cfg.min_token_prob if min_token_prob is None else min_token_prob
        window = cfg.match_window or max(2, self._depth - max_tokens + 1)
        if ctx.size > window:
            ctx = ctx[-window:]
        if not ctx.flags.c_contiguous:
            ctx = np.ascontiguousarray(ctx)
        factor, offset = cfg.max_spec_factor, cfg.max_spec_offset
        local, replica = self._local, self._replica
        # Candidates in tie-break order, each with its score weight. The compiled tree's handle
        # form starts from what this request's last call learned (the same draft, fewer walks).
        incremental = self._incremental
        tree = local.trajectories[state.trajectory_key].tree
        if incremental:
            best = tree.speculate_handle_ndarray(ctx, max_tokens, factor, offset, min_prob, state.handle)
        else:
            best = tree.speculate_ndarray(ctx, max_tokens, factor, offset, min_prob, False)
        best_score, source = best.score, "request"
        full = float(max_tokens)  # no draft scores more than max_tokens
        group_id = state.group_id
        if group_id is not None and best_score < full * cfg.group_bias:
            bias = cfg.group_bias
            if cfg.group_trees:
                group = replica.groups.get(group_id)
                if group is not None:
                    d = group.tree.speculate_ndarray(ctx, max_tokens, factor, offset, min_prob, False)
                    if d.score * bias > best_score:
                        best, best_score, source = d, d.score * bias, "group"
            # The group's turns still generating on any engine (chunks on the log), weighed as the group.
            if replica.inflight and best_score < full * bias:
                group = replica.inflight.get(group_id)
                if group is not None:
                    d = group.tree.speculate_ndarray(ctx, max_tokens, factor, offset, min_prob, False)
                    if d.score * bias > best_score:
                        best, best_score, source = d, d.score * bias, "inflight"
        # The live tree holds this engine's in-flight responses; when the only one is this
        # request's own (already in its trajectory tree) it can add nothing: skip the lookup.
        if state.live_seq is not None and best_score < full and local.live_seqs > (state.live_tokens > 0):
            d = local.live.speculate_ndarray(ctx, max_tokens, factor, offset, min_prob, False)
            if d.score > best_score:
                best, best_score, source = d, d.score, "live"
        if replica.records and best_score < full:
            tree = replica.global_tree
            if incremental:
                d = tree.speculate_handle_ndarray(ctx, max_tokens, factor, offset, min_prob, state.handle)
            else:
                d = tree.speculate_ndarray(ctx, max_tokens, factor, offset, min_prob, False)
            if d.score > best_score:
                best, best_score, source = d, d.score, "global"
        return best, source

    # ================================================================ memory & stats
    @property
    def num_records(self) -> int:
        return len(self._replica.records)

    @property
    def indexed_tokens(self) -> int:
        """Tokens held in the global tree (the quantity the budget bounds)."""
        return self._replica.global_tokens

    def memory_bytes(self) -> int:
        """Bytes held by the replicated trees (walks the C++ trees: not for hot paths)."""
        return self._replica.memory_bytes()

    def bytes_per_indexed_token(self) -> float:
        tokens = self._replica.global_tokens
        return self.memory_bytes() / tokens if tokens else 0.0

    def stats(self) -> dict[str, Any]:
        replica, local = self._replica, self._local
        return {
            **replica.stats,
            "applied_seq": replica.applied_seq,
            "pending_entries": replica.pending_entries,
            "pending_tokens": replica.queued_tokens,
            "policy_version": replica.policy_version,
            "records": len(replica.records),
            "indexed_tokens": replica.global_tokens,
            "groups": len(replica.groups),
            "inflight_turns": sum(len(g.turns) for g in replica.inflight.values()),
            "active_requests": len(local.requests),
            "trajectory_trees": len(local.trajectories),
        }

    # ================================================================ persistence
    def save(self, path: str | Path) -> Path:
        """Write the replicated state (config, records, log position) to ``path`` (.npz).

        Queued entries are applied first, so the file holds everything this replica was given.
        The write is atomic: a temporary file in the same directory, flushed to disk, then
        renamed over ``path`` (a failed or interrupted save leaves the last good index). The
        header records the array shapes and a SHA-256 of the arrays, which :meth:`load` checks."""
        self.work(None)
        return save_replica(self._replica, path)

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> "GlobalSuffixIndex":
        """Rebuild a replica from :meth:`save` output; it resumes the log after its seq.

        Every problem with the file is one :class:`IndexFileError` naming the file and what is
        wrong (unreadable, not an index, another format, a checksum or shape mismatch,
        inconsistent arrays); a file is never loaded into a wrong index."""
        config, records, applied_seq, policy_version = read_replica_file(path, overrides)
        index = cls(config)
        index._replica.restore(records, applied_seq, policy_version)
        return index
