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
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from arctic_inference.suffix_decoding._C import SuffixTree

from ..config_checks import check_int, dataclass_from_dict
from .log import CompletedSequenceLog, LogEntry
from .records import CompletedSequence, _check_id, as_token_array

_SEQ_MASK = 0x7FFFFFFF
_FORMAT = "war-suffix-index/1"


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

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SuffixIndexConfig.{name}: {why}, got {getattr(self, name)!r}")

        for name in ("max_tree_depth", "token_budget", "max_trajectory_trees"):
            check_int("SuffixIndexConfig", name, getattr(self, name), 1)
        check_int("SuffixIndexConfig", "prompt_lead_in", self.prompt_lead_in, 0)
        check_int("SuffixIndexConfig", "max_policy_lag", self.max_policy_lag, 0, nullable=True)
        check_int("SuffixIndexConfig", "match_window", self.match_window, 2, nullable=True)
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
        import yaml

        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
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
        if self._records or self._applied_seq:
            raise ValueError("start_at: only an empty replica can start in the middle of a log")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise ValueError(f"start_at: seq must be an int >= 0, got {seq!r}")
        self._applied_seq = seq

    def sync(self, log: CompletedSequenceLog, limit: int | None = None) -> int:
        """Apply the log's entries after :attr:`applied_seq`; returns how many."""
        return self.apply(log.read(self._applied_seq, limit))

    def apply(self, entries: Iterable[LogEntry]) -> int:
        """Apply log entries in order. Already-applied entries are skipped; a gap raises."""
        n = 0
        for entry in entries:
            if entry.seq <= self._applied_seq:
                continue
            if entry.seq != self._applied_seq + 1:
                raise ValueError(
                    f"seq: expected entry {self._applied_seq + 1}, got {entry.seq}; "
                    "apply entries in order without gaps (use sync(log))"
                )
            if entry.record is not None:
                need_eviction = self._insert(entry.seq, entry.record)
            elif entry.policy_version is not None:
                need_eviction = self._advance_version(entry.policy_version)
            else:
                raise ValueError(f"entry {entry.seq}: neither a record nor a policy_version")
            # Evict per entry, so the state never depends on how entries were batched.
            if need_eviction:
                self._evict()
            self._applied_seq = entry.seq
            n += 1
        return n

    def _advance_version(self, version: int) -> bool:
        if version <= self._policy_version:
            return False
        self._policy_version = version
        lag = self.config.max_policy_lag
        if lag is None or not self._records:
            return False
        floor = version - lag
        return any(r.policy_version < floor for r in self._records.values())

    def _insert(self, seq: int, record: CompletedSequence) -> bool:
        cfg = self.config
        stale_evict = self._advance_version(record.policy_version)
        if cfg.max_policy_lag is not None and record.policy_version < self._policy_version - cfg.max_policy_lag:
            self._stats["records_stale_dropped"] += 1
            return stale_evict
        lead = record.prompt_token_ids[-cfg.prompt_lead_in :] if cfg.prompt_lead_in else record.prompt_token_ids[:0]
        tokens = np.concatenate([lead, record.response_token_ids]) if lead.size else record.response_token_ids
        if tokens.size > cfg.token_budget:
            tokens = tokens[-cfg.token_budget :]
            self._stats["records_truncated"] += 1
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        stored = _StoredRecord(seq, record.trajectory_id, record.group_id, record.policy_version, tokens)
        self._records[seq] = stored
        self._global.extend_ndarray(seq & _SEQ_MASK, tokens)
        self._global_tokens += int(tokens.size)
        if cfg.group_trees:
            tree, seqs = self._groups.get(stored.group_id) or (SuffixTree(self._depth), [])
            tree.extend_ndarray(seq & _SEQ_MASK, tokens)
            seqs.append(seq)
            self._groups[stored.group_id] = (tree, seqs)
        self._stats["records_applied"] += 1
        return stale_evict or self._global_tokens > cfg.token_budget

    def _evict(self) -> None:
        """Drop stale and oldest records, then rebuild the trees from the survivors."""
        cfg = self.config
        t0 = time.perf_counter()
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
        self._global = SuffixTree(self._depth)
        for s, r in self._records.items():
            self._global.extend_ndarray(s & _SEQ_MASK, r.tokens)
        if cfg.group_trees:
            self._rebuild_groups()
        self._stats["rebuilds"] += 1
        self._stats["rebuild_seconds"] += time.perf_counter() - t0

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
        ctx = as_token_array(context, "context")
        if max_tokens == 0:
            return Draft()
        cfg = self.config
        window = cfg.match_window or max(2, self._depth - max_tokens + 1)
        if ctx.size > window:
            ctx = ctx[-window:]
        args = (ctx, max_tokens, cfg.max_spec_factor, cfg.max_spec_offset, cfg.min_token_prob, False)
        # Candidates in tie-break order, each with its score weight.
        request_tree = self._trajectories[state.trajectory_key].tree
        group = self._groups.get(state.group_id) if cfg.group_trees and state.group_id is not None else None
        live = state.live_seq is not None and self._live.num_seqs() > 0
        best = request_tree.speculate_ndarray(*args)
        best_score, source = best.score, "request"
        full = float(max_tokens)  # no draft scores more than max_tokens
        if group is not None and best_score < full * cfg.group_bias:
            d = group[0].speculate_ndarray(*args)
            if d.score * cfg.group_bias > best_score:
                best, best_score, source = d, d.score * cfg.group_bias, "group"
        if live and best_score < full:
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
            "policy_version": self._policy_version,
            "records": len(self._records),
            "indexed_tokens": self._global_tokens,
            "groups": len(self._groups),
            "active_requests": len(self._requests),
            "trajectory_trees": len(self._trajectories),
        }

    # ================================================================ persistence
    def save(self, path: str | Path) -> Path:
        """Write the replicated state (config, records, log position) to ``path`` (.npz)."""
        path = Path(path)
        recs = list(self._records.values())
        lengths = np.array([r.tokens.size for r in recs], dtype=np.int64)
        meta = {
            "format": _FORMAT,
            "config": asdict(self.config),
            "applied_seq": self._applied_seq,
            "policy_version": self._policy_version,
            "trajectory_ids": [r.trajectory_id for r in recs],
            "group_ids": [r.group_id for r in recs],
        }
        with open(path, "wb") as fh:
            np.savez(
                fh,
                meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                seqs=np.array([r.seq for r in recs], dtype=np.int64),
                versions=np.array([r.policy_version for r in recs], dtype=np.int64),
                lengths=lengths,
                tokens=np.concatenate([r.tokens for r in recs]) if recs else np.zeros(0, dtype=np.int32),
            )
        return path

    @classmethod
    def load(cls, path: str | Path, **overrides: Any) -> "GlobalSuffixIndex":
        """Rebuild a replica from :meth:`save` output; it resumes the log after its seq."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                meta = json.loads(bytes(z["meta"]).decode())
                seqs, versions, lengths, tokens = z["seqs"], z["versions"], z["lengths"], z["tokens"]
        except (OSError, KeyError, ValueError) as exc:
            raise ValueError(f"path: {path} is not a saved suffix index ({exc})") from exc
        if meta.get("format") != _FORMAT:
            raise ValueError(f"path: {path} has format {meta.get('format')!r}, expected {_FORMAT!r}")
        config = SuffixIndexConfig.from_dict({**meta["config"], **overrides})
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
        index._applied_seq = int(meta["applied_seq"])
        index._policy_version = int(meta["policy_version"])
        return index
