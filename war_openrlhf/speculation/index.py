"""The global suffix index: one replica per engine, fed by the completed-sequence log.

SuffixDecoding drafts tokens by matching the tail of a request's context against
suffix trees of earlier text. vLLM's ``suffix`` method keeps one such tree per
engine, so a GRPO sibling on engine B cannot draft from the samples engine A
finished. Here every replica applies the same log, so every engine drafts from
every completed turn of the step (and of earlier steps, within a token budget).

The trees themselves are arctic-inference's C++ ``SuffixTree``; this module adds:

- *replicated state* (deterministic from the log): a global tree of completed
  records and, optionally, one tree per GRPO group;
- *local state* (per engine): a tree per live trajectory (its whole context plus
  what it generated, extended across turns instead of rebuilt), and a "live" tree
  of the engine's in-flight responses, as vLLM's proposer has;
- bounded memory: a token budget evicted oldest-first, and an optional maximum
  policy-version lag. Eviction drops records and rebuilds the tree from the
  survivors in log order, so a tree is always exactly "the surviving records,
  appended in order": replicas converge and ``save``/``load`` is exact even where
  draft choice depends on ties, which the C++ tree resolves by history.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from arctic_inference.suffix_decoding._C import SuffixTree

from ..config_checks import check_int, dataclass_from_dict, load_yaml
from .log import CompletedSequenceLog, LogEntry
from .records import CompletedSequence, _check_id, as_token_array

_SEQ_MASK = 0x7FFFFFFF
_FORMAT = "war-suffix-index/2"  # /2: array shapes and a SHA-256 in the header


class IndexFileError(ValueError):
    """A saved index file that cannot be loaded: names the file and what is wrong."""


#: The arrays of a saved index, in checksum order.
_ARRAYS = ("seqs", "versions", "lengths", "tokens")


@dataclass
class SuffixIndexConfig:
    """Knobs of the index; defaults are the values the speculation benchmark chose
    (``tools/bench_speculation.py --ablations``, see docs/benchmarks.md).

    - ``max_tree_depth``: longest suffix kept per position (matching window). Cost of
      insertion and speculation grows with it. arctic-inference uses 64, vLLM 24;
      32 drafts as well as 64 on agent traces at a quarter of the speculate cost.
    - ``token_budget``: tokens kept in the global tree (records' inserted tokens).
    - ``evict_to_fraction``: when over budget, evict oldest records down to this
      fraction of the budget, then rebuild once (amortises the rebuild).
    - ``max_policy_lag``: drop records older than ``current_version - lag``
      (``None`` keeps all versions).
    - ``prompt_lead_in``: tokens from the end of a record's prompt inserted in front
      of its response, so the tree can draft a response's first tokens from the
      generation prompt / tool result that precedes it.
    - ``group_trees`` / ``group_bias``: keep a tree per GRPO group and multiply its
      draft scores by ``group_bias`` when choosing among candidate drafts.
    - ``live_responses``: share this engine's in-flight responses (vLLM's behaviour).
    - ``max_spec_factor``, ``max_spec_offset``, ``min_token_prob``: arctic's draft
      rule: at most ``match_len * factor + offset`` tokens, stop below ``min_token_prob``.
      WAR speculates only at low load, where verifying a longer draft is almost free
      (decode is memory-bound), so it drafts up to 2x the match length (vLLM: 1x).
    - ``max_trajectory_trees``: trajectory trees kept for multi-turn reuse (LRU).
    - ``match_window``: context tokens matched against the trees. A tree path is at
      most ``max_tree_depth`` long, so a match of ``m`` tokens can draft at most
      ``depth - m``; ``None`` (default) matches ``depth - max_tokens + 1`` tokens,
      which keeps every match that can still yield a full draft and cuts the
      speculate cost (quadratic in the window) by ~3x at depth 32, K 16.
    - ``apply_budget_ms``: on a busy engine, log entries are applied between steps in
      slices of about this long (0.5 ms: under 3% of a 20 ms GPU decode step), so a
      burst of completed turns never stalls a step; an idle engine applies them at once.
    - ``max_pending_tokens``: a backlog beyond this many queued response tokens is applied
      in full at the next step (the replica never falls far behind the log).
    """

    max_tree_depth: int = 32
    token_budget: int = 4_000_000
    evict_to_fraction: float = 0.75
    max_policy_lag: int | None = None
    prompt_lead_in: int = 16
    group_trees: bool = False
    group_bias: float = 1.0
    live_responses: bool = True
    max_spec_factor: float = 2.0
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1
    max_trajectory_trees: int = 4096
    match_window: int | None = None
    apply_budget_ms: float = 0.5
    max_pending_tokens: int = 65536

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SuffixIndexConfig.{name}: {why}, got {getattr(self, name)!r}")

        for name in ("max_tree_depth", "token_budget", "max_trajectory_trees"):
            check_int("SuffixIndexConfig", name, getattr(self, name), 1)
        check_int("SuffixIndexConfig", "prompt_lead_in", self.prompt_lead_in, 0)
        check_int("SuffixIndexConfig", "max_policy_lag", self.max_policy_lag, 0, nullable=True)
        check_int("SuffixIndexConfig", "match_window", self.match_window, 2, nullable=True)
        check_int("SuffixIndexConfig", "max_pending_tokens", self.max_pending_tokens, 0)
        if not float(self.apply_budget_ms) > 0:
            raise bad("apply_budget_ms", "must be > 0")
        if not 0.0 < float(self.evict_to_fraction) <= 1.0:
            raise bad("evict_to_fraction", "must be in (0, 1]")
        if float(self.group_bias) <= 0:
            raise bad("group_bias", "must be > 0")
        if float(self.max_spec_factor) < 0 or float(self.max_spec_offset) < 0:
            raise bad("max_spec_factor" if float(self.max_spec_factor) < 0 else "max_spec_offset", "must be >= 0")
        if not 0.0 <= float(self.min_token_prob) <= 1.0:
            raise bad("min_token_prob", "must be in [0, 1]")

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "SuffixIndexConfig") -> "SuffixIndexConfig":
        """Build from a mapping; unknown keys and wrong types name the key and ``source``."""
        return dataclass_from_dict(cls, data, source)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "SuffixIndexConfig":
        data = load_yaml(path)
        return cls.from_dict(data, source=str(path))


@dataclass
class Draft:
    """A proposal: tokens, their estimated probabilities, and where they came from."""

    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    source: str = "none"  # "request" | "group" | "live" | "global" | "none"


@dataclass
class _StoredRecord:
    seq: int
    trajectory_id: str
    group_id: str
    policy_version: int
    tokens: np.ndarray  # what went into the trees (lead-in + response)


@dataclass
class _RequestState:
    trajectory_key: str
    group_id: str | None
    live_seq: int | None
    live_tokens: int = 0


class _TrajectoryTree:
    """A trajectory's own context (+ generated tokens), extended turn over turn."""

    __slots__ = ("tree", "tokens", "length")

    def __init__(self, depth: int) -> None:
        self.tree = SuffixTree(depth)
        self.tokens = np.zeros(1024, dtype=np.int32)
        self.length = 0

    def append(self, new: np.ndarray) -> None:
        if new.size == 0:
            return
        need = self.length + new.size
        if need > self.tokens.size:
            grown = np.zeros(max(need, 2 * self.tokens.size), dtype=np.int32)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length : need] = new
        self.length = need
        self.tree.extend_ndarray(0, new)

    def is_prefix_of(self, prompt: np.ndarray) -> bool:
        n = self.length
        return prompt.size >= n and bool(np.array_equal(prompt[:n], self.tokens[:n]))


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
        # replicated state
        self._records: OrderedDict[int, _StoredRecord] = OrderedDict()
        self._global = SuffixTree(self._depth)
        self._global_tokens = 0
        self._groups: dict[str, tuple[SuffixTree, list[int]]] = {}
        self._applied_seq = 0
        self._policy_version = 0
        # log entries waiting for work(); a record being inserted; a shadow rebuild
        self._queue: deque[LogEntry] = deque()
        self._queued_seq = 0
        self._queued_tokens = 0
        self._inserting: list | None = None
        self._rebuilding: list | None = None
        # local state
        self._requests: dict[str, _RequestState] = {}
        self._trajectories: OrderedDict[str, _TrajectoryTree] = OrderedDict()
        self._live = SuffixTree(self._depth)
        self._next_live_seq = 0
        # counters
        self._stats = {
            "records_applied": 0,
            "records_evicted": 0,
            "records_stale_dropped": 0,
            "records_truncated": 0,
            "rebuilds": 0,
            "rebuild_seconds": 0.0,
            "apply_seconds": 0.0,
        }

    # ================================================================ replication
    @property
    def applied_seq(self) -> int:
        """Sequence number of the last log entry applied (0: none)."""
        return self._applied_seq

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def start_at(self, seq: int) -> None:
        """An empty replica joining a log whose entries up to ``seq`` are gone (truncated once
        every earlier replica had them): apply from ``seq + 1`` on."""
        if self._records or self._queued_seq:
            raise ValueError("start_at: only an empty replica can start in the middle of a log")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise ValueError(f"start_at: seq must be an int >= 0, got {seq!r}")
        self._applied_seq = self._queued_seq = seq

    def sync(self, log: CompletedSequenceLog, limit: int | None = None) -> int:
        """Apply the log's entries after those applied or queued, and any queued ones; returns how many."""
        return self.apply(log.read(self._queued_seq, limit))

    def apply(self, entries: Iterable[LogEntry]) -> int:
        """Apply log entries in order, all of them now. Already-applied entries are skipped; a gap raises."""
        self.enqueue(entries)
        return self.work(None)["entries"]

    # Entries wait in a queue and are applied by :meth:`work` in bounded slices, so an engine
    # applies the log between steps without stalling one (see worker_extension): a record is
    # inserted in chunks of _CHUNK tokens, and an eviction's rebuild is a shadow tree filled
    # chunk by chunk while the old tree keeps drafting, then swapped in. Entries are applied
    # strictly in order, so the state after a full drain is the same however it was sliced.
    _CHUNK = 256

    def enqueue(self, entries: Iterable[LogEntry]) -> int:
        """Queue log entries (in order, after what is applied or queued) for :meth:`work`; returns how many.

        Already-queued or applied entries are skipped; a gap raises ``ValueError`` and queues nothing.
        """
        last = self._queued_seq
        fresh = []
        for entry in entries:
            if entry.seq <= last:
                continue
            if entry.seq != last + 1:
                raise ValueError(
                    f"seq: expected entry {last + 1}, got {entry.seq}; "
                    "apply entries in order without gaps (use sync(log))"
                )
            if entry.record is None and entry.policy_version is None:
                raise ValueError(f"entry {entry.seq}: neither a record nor a policy_version")
            fresh.append(entry)
            last = entry.seq
        self._queue.extend(fresh)
        self._queued_tokens += sum(int(e.record.response_token_ids.size) for e in fresh if e.record is not None)
        self._queued_seq = last
        return len(fresh)

    @property
    def pending_entries(self) -> int:
        """Entries queued or partly applied (0: the replica holds everything it was given)."""
        return len(self._queue) + (self._inserting is not None)

    @property
    def has_pending_work(self) -> bool:
        """Entries to apply, or an eviction's rebuild to finish: :meth:`work` has something to do."""
        return bool(self._queue) or self._inserting is not None or self._rebuilding is not None

    @property
    def pending_tokens(self) -> int:
        """Response tokens of queued records (what is left to insert, roughly)."""
        return self._queued_tokens

    def work(self, budget_s: float | None) -> dict[str, Any]:
        """Apply queued entries for about ``budget_s`` seconds (``None``: until the queue is empty).

        At least one chunk of work is done per call when there is any, so the queue always
        drains. Returns ``{"entries": applied, "tokens": inserted, "seconds": spent}``.
        """
        t0 = time.perf_counter()
        deadline = None if budget_s is None else t0 + budget_s
        entries = tokens = 0
        while True:
            if self._rebuilding is not None:
                tokens += self._rebuild_step()
            elif self._inserting is not None:
                tokens += self._insert_step()
                if self._inserting is None:
                    entries += 1
            elif self._queue:
                if self._begin(self._queue.popleft()):
                    entries += 1
            else:
                break
            if deadline is not None and time.perf_counter() >= deadline:
                break
        seconds = time.perf_counter() - t0
        self._stats["apply_seconds"] += seconds
        return {"entries": entries, "tokens": tokens, "seconds": seconds}

    def _begin(self, entry: LogEntry) -> bool:
        """Start applying ``entry``; True when it is already fully applied."""
        if entry.record is None:
            if self._advance_version(entry.policy_version):
                self._start_eviction()
            self._applied_seq = entry.seq
            return True
        record = entry.record
        self._queued_tokens -= int(record.response_token_ids.size)
        cfg = self.config
        stale_evict = self._advance_version(record.policy_version)
        if cfg.max_policy_lag is not None and record.policy_version < self._policy_version - cfg.max_policy_lag:
            self._stats["records_stale_dropped"] += 1
            if stale_evict:
                self._start_eviction()
            self._applied_seq = entry.seq
            return True
        lead = record.prompt_token_ids[-cfg.prompt_lead_in :] if cfg.prompt_lead_in else record.prompt_token_ids[:0]
        tokens = np.concatenate([lead, record.response_token_ids]) if lead.size else record.response_token_ids
        if tokens.size > cfg.token_budget:
            tokens = tokens[-cfg.token_budget :]
            self._stats["records_truncated"] += 1
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        stored = _StoredRecord(entry.seq, record.trajectory_id, record.group_id, record.policy_version, tokens)
        self._records[entry.seq] = stored
        self._global_tokens += int(tokens.size)
        self._inserting = [stored, 0, stale_evict]
        return False

    def _insert_step(self) -> int:
        """Insert the next chunk of the record being applied; finish it when it is all in."""
        stored, offset, stale_evict = self._inserting
        chunk = stored.tokens[offset : offset + self._CHUNK]
        self._global.extend_ndarray(stored.seq & _SEQ_MASK, chunk)
        offset += int(chunk.size)
        if offset < stored.tokens.size:
            self._inserting[1] = offset
            return int(chunk.size)
        self._inserting = None
        if self.config.group_trees:
            tree, seqs = self._groups.get(stored.group_id) or (SuffixTree(self._depth), [])
            tree.extend_ndarray(stored.seq & _SEQ_MASK, stored.tokens)
            seqs.append(stored.seq)
            self._groups[stored.group_id] = (tree, seqs)
        self._stats["records_applied"] += 1
        self._applied_seq = stored.seq
        if stale_evict or self._global_tokens > self.config.token_budget:
            self._start_eviction()
        return int(chunk.size)

    def _advance_version(self, version: int) -> bool:
        if version <= self._policy_version:
            return False
        self._policy_version = version
        lag = self.config.max_policy_lag
        if lag is None or not self._records:
            return False
        floor = version - lag
        return any(r.policy_version < floor for r in self._records.values())

    def _start_eviction(self) -> None:
        """Drop stale and oldest records, then rebuild the global tree from the survivors (in slices)."""
        cfg = self.config
        victims: list[int] = []
        if cfg.max_policy_lag is not None:
            floor = self._policy_version - cfg.max_policy_lag
            victims = [s for s, r in self._records.items() if r.policy_version < floor]
            for s in victims:
                self._global_tokens -= int(self._records.pop(s).tokens.size)
        n_stale = len(victims)
        if self._global_tokens > cfg.token_budget:
            target = int(cfg.token_budget * cfg.evict_to_fraction)
            while self._records and self._global_tokens > target:
                s, r = self._records.popitem(last=False)
                self._global_tokens -= int(r.tokens.size)
                victims.append(s)
        if not victims:
            return
        self._stats["records_evicted"] += len(victims) - n_stale
        self._stats["records_stale_dropped"] += n_stale
        self._stats["rebuilds"] += 1
        # The old tree keeps drafting until the new one holds every survivor.
        self._rebuilding = [SuffixTree(self._depth), list(self._records.values()), 0, 0, 0.0]
        if cfg.group_trees:
            self._rebuild_groups()

    def _rebuild_step(self) -> int:
        t0 = time.perf_counter()
        job = self._rebuilding
        tree, survivors, i, offset = job[0], job[1], job[2], job[3]
        done = 0
        while i < len(survivors) and done < self._CHUNK:
            r = survivors[i]
            chunk = r.tokens[offset : offset + self._CHUNK - done]
            tree.extend_ndarray(r.seq & _SEQ_MASK, chunk)
            done += int(chunk.size)
            offset += int(chunk.size)
            if offset >= r.tokens.size:
                i, offset = i + 1, 0
        job[2], job[3] = i, offset
        job[4] += time.perf_counter() - t0
        if i >= len(survivors):
            self._global = tree
            self._rebuilding = None
            self._stats["rebuild_seconds"] += job[4]
        return done

    def _rebuild_groups(self) -> None:
        alive: dict[str, list[int]] = {}
        for s, r in self._records.items():
            alive.setdefault(r.group_id, []).append(s)
        groups: dict[str, tuple[SuffixTree, list[int]]] = {}
        for gid, seqs in alive.items():
            old = self._groups.get(gid)
            if old is not None and old[1] == seqs:
                groups[gid] = old  # untouched group keeps its tree
                continue
            tree = SuffixTree(self._depth)
            for s in seqs:
                tree.extend_ndarray(s & _SEQ_MASK, self._records[s].tokens)
            groups[gid] = (tree, seqs)
        self._groups = groups

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
        extended by the new tokens only, when the new prompt extends what it holds.
        """
        request_id = _check_id(request_id, "request_id")
        if request_id in self._requests:
            raise ValueError(f"request_id: '{request_id}' is already active; stop_request it first")
        prompt = as_token_array(prompt_token_ids, "prompt_token_ids")
        group = None if group_id is None else _check_id(group_id, "group_id")
        key = ("traj:" + _check_id(trajectory_id, "trajectory_id")) if trajectory_id is not None else ("req:" + request_id)
        ttree = self._trajectories.get(key)
        if ttree is None or not ttree.is_prefix_of(prompt):
            ttree = _TrajectoryTree(self._depth)
            self._trajectories[key] = ttree
        self._trajectories.move_to_end(key)
        ttree.append(prompt[ttree.length :])
        while len(self._trajectories) > self.config.max_trajectory_trees:
            old_key = next(iter(self._trajectories))
            if any(st.trajectory_key == old_key for st in self._requests.values()):
                break  # never drop a tree a live request uses
            del self._trajectories[old_key]
        live_seq = None
        if self.config.live_responses:
            live_seq = self._next_live_seq
            self._next_live_seq = (self._next_live_seq + 1) & _SEQ_MASK
        self._requests[request_id] = _RequestState(key, group, live_seq)

    def extend_request(self, request_id: str, token_ids: Sequence[int] | np.ndarray) -> None:
        """Append tokens the request just generated (to its own tree and the live tree)."""
        state = self._request(request_id)
        tokens = as_token_array(token_ids, "token_ids", allow_empty=True)
        if tokens.size == 0:
            return
        self._trajectories[state.trajectory_key].append(tokens)
        if state.live_seq is not None:
            self._live.extend_ndarray(state.live_seq, tokens)
            state.live_tokens += int(tokens.size)

    def stop_request(self, request_id: str) -> None:
        """The request finished (its record arrives through the log)."""
        state = self._request(request_id)
        del self._requests[request_id]
        if state.live_seq is not None and state.live_tokens:
            self._live.remove(state.live_seq)
        if state.trajectory_key.startswith("req:"):
            self._trajectories.pop(state.trajectory_key, None)

    def end_trajectory(self, trajectory_id: str) -> None:
        """Free a finished trajectory's tree (otherwise it ages out LRU)."""
        self._trajectories.pop("traj:" + _check_id(trajectory_id, "trajectory_id"), None)

    def _request(self, request_id: Any) -> _RequestState:
        state = self._requests.get(request_id) if isinstance(request_id, str) else None
        if state is None:
            raise ValueError(
                f"request_id: unknown request {request_id!r}; call start_request first "
                f"({len(self._requests)} active)"
            )
        return state

    # ================================================================ speculation
    def speculate(self, request_id: str, context: Sequence[int] | np.ndarray, max_tokens: int) -> Draft:
        """Best draft for the request's ``context`` from its own tree, its group's
        tree (if enabled), the engine's live tree and the global tree.

        The highest score wins (group scores times ``group_bias``); ties go to the
        earlier source in that order, as arctic-inference prefers the prompt tree.
        """
        state = self._requests.get(request_id) if type(request_id) is str else None
        if state is None:
            state = self._request(request_id)  # raises with the reason
        if type(max_tokens) is not int:
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, np.integer):
                raise ValueError(f"max_tokens: must be an int >= 0, got {max_tokens!r}")
            max_tokens = int(max_tokens)
        if max_tokens < 0:
            raise ValueError(f"max_tokens: must be an int >= 0, got {max_tokens!r}")
        return self._speculate(state, as_token_array(context, "context"), max_tokens)

    def speculate_engine(self, request_id: str, context: np.ndarray, max_tokens: int) -> Draft:
        """:meth:`speculate` for the engine's hot path: ``context`` is a 1-D int32 slice of
        the engine's own token buffer (ids the engine sampled, so never negative) and
        ``max_tokens`` an int; only the request id is checked."""
        state = self._requests.get(request_id)
        if state is None:
            state = self._request(request_id)
        if context.dtype != np.int32 or context.ndim != 1 or not context.size:
            context = as_token_array(context, "context")
        return self._speculate(state, context, max_tokens)

    def _speculate(self, state: _RequestState, ctx: np.ndarray, max_tokens: int) -> Draft:
        if max_tokens <= 0:
            return Draft()
        cfg = self.config
        window = cfg.match_window or max(2, self._depth - max_tokens + 1)
        if ctx.size > window:
            ctx = ctx[-window:]
        if not ctx.flags.c_contiguous:
            ctx = np.ascontiguousarray(ctx)
        args = (ctx, max_tokens, cfg.max_spec_factor, cfg.max_spec_offset, cfg.min_token_prob, False)
        # Candidates in tie-break order, each with its score weight.
        best = self._trajectories[state.trajectory_key].tree.speculate_ndarray(*args)
        best_score, source = best.score, "request"
        full = float(max_tokens)  # no draft scores more than max_tokens
        if cfg.group_trees and state.group_id is not None and best_score < full * cfg.group_bias:
            group = self._groups.get(state.group_id)
            if group is not None:
                d = group[0].speculate_ndarray(*args)
                if d.score * cfg.group_bias > best_score:
                    best, best_score, source = d, d.score * cfg.group_bias, "group"
        # The live tree holds this engine's in-flight responses; when the only one is this
        # request's own (already in its trajectory tree) it can add nothing: skip the lookup.
        if state.live_seq is not None and best_score < full and self._live.num_seqs() > (state.live_tokens > 0):
            d = self._live.speculate_ndarray(*args)
            if d.score > best_score:
                best, best_score, source = d, d.score, "live"
        if self._records and best_score < full:
            d = self._global.speculate_ndarray(*args)
            if d.score > best_score:
                best, best_score, source = d, d.score, "global"
        token_ids = best.token_ids
        if not token_ids:
            return Draft(match_len=best.match_len)
        return Draft(token_ids, best.probs, float(best.score), int(best.match_len), source)

    # ================================================================ memory & stats
    @property
    def num_records(self) -> int:
        return len(self._records)

    @property
    def indexed_tokens(self) -> int:
        """Tokens held in the global tree (the quantity the budget bounds)."""
        return self._global_tokens

    def memory_bytes(self) -> int:
        """Bytes held by the replicated trees (walks the C++ trees: not for hot paths)."""
        total = self._global.estimate_memory()
        if self.config.group_trees:
            total += sum(tree.estimate_memory() for tree, _ in self._groups.values())
        total += sum(r.tokens.nbytes for r in self._records.values())
        return int(total)

    def bytes_per_indexed_token(self) -> float:
        return self.memory_bytes() / self._global_tokens if self._global_tokens else 0.0

    def stats(self) -> dict[str, Any]:
        return {
            **self._stats,
            "applied_seq": self._applied_seq,
            "pending_entries": self.pending_entries,
            "pending_tokens": self._queued_tokens,
            "policy_version": self._policy_version,
            "records": len(self._records),
            "indexed_tokens": self._global_tokens,
            "groups": len(self._groups),
            "active_requests": len(self._requests),
            "trajectory_trees": len(self._trajectories),
        }

    # ================================================================ persistence
    def save(self, path: str | Path) -> Path:
        """Write the replicated state (config, records, log position) to ``path`` (.npz).

        Queued entries are applied first, so the file holds everything this replica was given.
        The write is atomic: a temporary file in the same directory, flushed to disk, then
        renamed over ``path`` (a failed or interrupted save leaves the last good index). The
        header records the array shapes and a SHA-256 of the arrays, which :meth:`load` checks."""
        import hashlib
        import os
        import tempfile

        path = Path(path)
        self.work(None)
        recs = list(self._records.values())
        arrays = {
            "seqs": np.array([r.seq for r in recs], dtype=np.int64),
            "versions": np.array([r.policy_version for r in recs], dtype=np.int64),
            "lengths": np.array([r.tokens.size for r in recs], dtype=np.int64),
            "tokens": np.concatenate([r.tokens for r in recs]) if recs else np.zeros(0, dtype=np.int32),
        }
        digest = hashlib.sha256()
        for name in _ARRAYS:
            digest.update(np.ascontiguousarray(arrays[name]).tobytes())
        meta = {
            "format": _FORMAT,
            "config": asdict(self.config),
            "applied_seq": self._applied_seq,
            "policy_version": self._policy_version,
            "trajectory_ids": [r.trajectory_id for r in recs],
            "group_ids": [r.group_id for r in recs],
            "shapes": {name: list(arrays[name].shape) for name in _ARRAYS},
            "sha256": digest.hexdigest(),
        }
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent or "."))
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        try:  # the rename itself durable
            dir_fd = os.open(str(path.parent or "."), os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError:
            pass
        return path

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> "GlobalSuffixIndex":
        """Rebuild a replica from :meth:`save` output; it resumes the log after its seq.

        Every problem with the file is one :class:`IndexFileError` naming the file and what is
        wrong (unreadable, not an index, another format, a checksum or shape mismatch,
        inconsistent arrays); a file is never loaded into a wrong index."""
        import hashlib

        path = Path(path)

        def bad(what: str) -> IndexFileError:
            return IndexFileError(f"{path}: {what}")

        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                arrays = {name: np.asarray(z[name]) for name in _ARRAYS}
        except FileNotFoundError:
            raise bad("no such file") from None
        except Exception as exc:  # noqa: BLE001 - BadZipFile, EOFError, KeyError, ValueError, ...
            raise bad(f"not a saved suffix index ({type(exc).__name__}: {str(exc)[:160]})") from None
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
            raise bad(f"format {found!r}, expected {_FORMAT!r} (saved by another version?)")
        digest = hashlib.sha256()
        for name in _ARRAYS:
            if list(arrays[name].shape) != list(meta.get("shapes", {}).get(name, [-1])):
                raise bad(f"array '{name}' has shape {list(arrays[name].shape)}, the header says "
                          f"{meta.get('shapes', {}).get(name)}")
            digest.update(np.ascontiguousarray(arrays[name]).tobytes())
        if digest.hexdigest() != meta.get("sha256"):
            raise bad("checksum mismatch: the arrays changed after the save")
        seqs, versions, lengths, tokens = (arrays[n] for n in _ARRAYS)
        n = len(seqs)
        if not (len(versions) == len(lengths) == n == len(meta["trajectory_ids"]) == len(meta["group_ids"])):
            raise bad("per-record arrays of different lengths")
        if (lengths < 0).any() or int(lengths.sum()) != len(tokens):
            raise bad(f"record lengths (sum {int(lengths.sum())}) do not cover the {len(tokens)} tokens")
        if len(set(seqs.tolist())) != n:
            raise bad("duplicate record sequence numbers")
        if n and int(seqs.max()) > int(meta["applied_seq"]):
            raise bad(f"a record's sequence number {int(seqs.max())} is past the applied position "
                      f"{meta['applied_seq']}")
        try:
            config = SuffixIndexConfig.from_dict({**meta["config"], **overrides})
        except ValueError as exc:
            raise bad(f"config: {exc}") from None
        index = cls(config)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for i, seq in enumerate(seqs.tolist()):
            toks = np.ascontiguousarray(tokens[offsets[i] : offsets[i + 1]], dtype=np.int32)
            stored = _StoredRecord(seq, meta["trajectory_ids"][i], meta["group_ids"][i], int(versions[i]), toks)
            index._records[seq] = stored
            index._global.extend_ndarray(seq & _SEQ_MASK, toks)
            index._global_tokens += int(toks.size)
        if config.group_trees:
            index._rebuild_groups()
        index._applied_seq = index._queued_seq = int(meta["applied_seq"])
        index._policy_version = int(meta["policy_version"])
        return index
