"""A replica's replicated state and the sliced application of the log to it.

The replicated state is deterministic from the log: the stored records (oldest first), the
global tree of them, optionally one tree per GRPO group, and the in-flight trees: per group,
the tokens its turns still generating have produced so far (chunks on the log; a turn's
record closes it, a new policy version clears them all; never saved, they are transient). Log entries wait in a queue and
:meth:`ReplicatedTrees.work` applies them in bounded slices, so an engine applies the log
between steps without stalling one (see worker_extension): a record is inserted in chunks of
``chunk`` tokens, and an eviction's rebuild is a shadow tree filled chunk by chunk while the
old tree keeps drafting, then swapped in (:mod:`.rebuild`). Entries are applied strictly in
order, so the state after a full drain is the same however it was sliced.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from .index_config import SuffixIndexConfig
from .log import LogEntry
from .rebuild import SEQ_MASK, GroupTree, RebuildJob, StoredRecord, rebuild_group_trees
from .suffix_tree import SuffixTree, tree_class


@dataclass
class InflightGroup:
    """A group's turns still generating: one tree, a sequence per turn (key -> [seq id, tokens, trajectory])."""

    tree: SuffixTree
    turns: dict[str, list] = field(default_factory=dict)


@dataclass
class InsertJob:
    """The record being inserted into the global tree, ``offset`` tokens in so far."""

    record: StoredRecord
    offset: int
    stale_evict: bool  # its version made older records stale: evict once it is in


class ReplicatedTrees:
    """Stored records, the global tree and the group trees, fed by log entries."""

    #: Tokens inserted per slice of work (a record's chunk, or a rebuild's).
    CHUNK = 256
    #: In-flight turns held at most (the oldest is dropped beyond), and closed turn keys
    #: remembered (a chunk that arrives after its turn's record is ignored).
    MAX_INFLIGHT_TURNS = 4096
    MAX_CLOSED_KEYS = 16384

    def __init__(self, config: SuffixIndexConfig) -> None:
        self.config = config
        self.depth = config.max_tree_depth
        tree = tree_class(config.suffix_tree)
        self.new_tree = lambda: tree(self.depth)  # every tree of this replica: one kind, one depth
        self.chunk = self.CHUNK
        self.records: OrderedDict[int, StoredRecord] = OrderedDict()
        self.global_tree = self.new_tree()
        self.global_tokens = 0
        self.groups: dict[str, GroupTree] = {}
        self.applied_seq = 0
        self.policy_version = 0
        self.inflight: dict[str, InflightGroup] = {}
        self._inflight_order: OrderedDict[str, tuple[str, str]] = OrderedDict()  # key -> (group, trajectory)
        self._inflight_closed: OrderedDict[str, None] = OrderedDict()
        self._inflight_by_trajectory: dict[str, list[str]] = {}
        self._inflight_next = 0
        # log entries waiting for work(); a record being inserted; a shadow rebuild
        self.queue: deque[LogEntry] = deque()
        self.queued_seq = 0
        self.queued_tokens = 0
        self.inserting: InsertJob | None = None
        self.rebuilding: RebuildJob | None = None
        self.stats: dict[str, Any] = {
            "records_applied": 0,
            "records_evicted": 0,
            "records_stale_dropped": 0,
            "records_truncated": 0,
            "rebuilds": 0,
            "rebuild_seconds": 0.0,
            "apply_seconds": 0.0,
            "inflight_chunks": 0,
            "inflight_tokens": 0,
            "inflight_late_chunks": 0,
        }

    # ------------------------------------------------------------------ log position
    def start_at(self, seq: int) -> None:
        if self.records or self.queued_seq:
            raise ValueError("start_at: only an empty replica can start in the middle of a log")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise ValueError(f"start_at: seq must be an int >= 0, got {seq!r}")
        self.applied_seq = self.queued_seq = seq

    def restore(self, records: Iterable[StoredRecord], applied_seq: int, policy_version: int) -> None:
        """Fill an empty replica with saved records (in log order) and its saved log position."""
        for stored in records:
            self.records[stored.seq] = stored
            self.global_tree.extend_ndarray(stored.seq & SEQ_MASK, stored.tokens)
            self.global_tokens += int(stored.tokens.size)
        if self.config.group_trees:
            self.groups = rebuild_group_trees(self.records.values(), self.groups, self.new_tree)
        self.applied_seq = self.queued_seq = applied_seq
        self.policy_version = policy_version

    # ------------------------------------------------------------------ queue
    def enqueue(self, entries: Iterable[LogEntry]) -> int:
        last = self.queued_seq
        fresh = []
        for entry in entries:
            if entry.seq <= last:
                continue
            if entry.seq != last + 1:
                raise ValueError(
                    f"seq: expected entry {last + 1}, got {entry.seq}; "
                    "apply entries in order without gaps (use sync(log))"
                )
            if entry.record is None and entry.policy_version is None and entry.chunk is None:
                raise ValueError(f"entry {entry.seq}: neither a record, a policy_version nor a chunk")
            fresh.append(entry)
            last = entry.seq
        self.queue.extend(fresh)
        self.queued_tokens += sum(int(e.record.response_token_ids.size) for e in fresh if e.record is not None)
        self.queued_seq = last
        return len(fresh)

    @property
    def pending_entries(self) -> int:
        return len(self.queue) + (self.inserting is not None)

    @property
    def has_pending_work(self) -> bool:
        return bool(self.queue) or self.inserting is not None or self.rebuilding is not None

    def work(self, budget_s: float | None) -> dict[str, Any]:
        """Apply queued entries for about ``budget_s`` seconds (``None``: until the queue is empty)."""
        t0 = time.perf_counter()
        deadline = None if budget_s is None else t0 + budget_s
        entries = tokens = 0
        while True:
            if self.rebuilding is not None:
                tokens += self._rebuild_step()
            elif self.inserting is not None:
                tokens += self._insert_step()
                if self.inserting is None:
                    entries += 1
            elif self.queue:
                if self._begin(self.queue.popleft()):
                    entries += 1
            else:
                break
            if deadline is not None and time.perf_counter() >= deadline:
                break
        seconds = time.perf_counter() - t0
        self.stats["apply_seconds"] += seconds
        return {"entries": entries, "tokens": tokens, "seconds": seconds}

    # ------------------------------------------------------------------ one entry
    def _begin(self, entry: LogEntry) -> bool:
        """Start applying ``entry``; True when it is already fully applied."""
        if entry.chunk is not None:
            self._apply_chunk(entry.chunk)
            self.applied_seq = entry.seq
            return True
        if entry.record is None:
            if self._advance_version(entry.policy_version):
                self._start_eviction()
            self.applied_seq = entry.seq
            return True
        record = entry.record
        self.queued_tokens -= int(record.response_token_ids.size)
        self._close_inflight(record.trajectory_id)
        cfg = self.config
        stale_evict = self._advance_version(record.policy_version)
        if cfg.max_policy_lag is not None and record.policy_version < self.policy_version - cfg.max_policy_lag:
            self.stats["records_stale_dropped"] += 1
            if stale_evict:
                self._start_eviction()
            self.applied_seq = entry.seq
            return True
        lead = record.prompt_token_ids[-cfg.prompt_lead_in :] if cfg.prompt_lead_in else record.prompt_token_ids[:0]
        tokens = np.concatenate([lead, record.response_token_ids]) if lead.size else record.response_token_ids
        if tokens.size > cfg.token_budget:
            tokens = tokens[-cfg.token_budget :]
            self.stats["records_truncated"] += 1
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        stored = StoredRecord(entry.seq, record.trajectory_id, record.group_id, record.policy_version, tokens)
        self.records[entry.seq] = stored
        self.global_tokens += int(tokens.size)
        self.inserting = InsertJob(stored, 0, stale_evict)
        return False

    def _insert_step(self) -> int:
        """Insert the next chunk of the record being applied; finish it when it is all in."""
        job = self.inserting
        stored = job.record
        chunk = stored.tokens[job.offset : job.offset + self.chunk]
        self.global_tree.extend_ndarray(stored.seq & SEQ_MASK, chunk)
        job.offset += int(chunk.size)
        if job.offset < stored.tokens.size:
            return int(chunk.size)
        self.inserting = None
        if self.config.group_trees:
            group = self.groups.get(stored.group_id) or GroupTree(self.new_tree(), [])
            group.tree.extend_ndarray(stored.seq & SEQ_MASK, stored.tokens)
            group.seqs.append(stored.seq)
            self.groups[stored.group_id] = group
        self.stats["records_applied"] += 1
        self.applied_seq = stored.seq
        if job.stale_evict or self.global_tokens > self.config.token_budget:
            self._start_eviction()
        return int(chunk.size)

    # ------------------------------------------------------------------ in-flight turns
    def _apply_chunk(self, chunk) -> None:
        """Extend the turn's sequence in its group's in-flight tree by the chunk's new tokens."""
        if not self.config.inflight_sharing:
            return
        if chunk.key in self._inflight_closed:
            self.stats["inflight_late_chunks"] += 1
            return
        group = self.inflight.get(chunk.group_id)
        if group is None:
            group = self.inflight[chunk.group_id] = InflightGroup(self.new_tree())
        turn = group.turns.get(chunk.key)
        if turn is None:
            turn = group.turns[chunk.key] = [self._inflight_next, 0, chunk.trajectory_id]
            self._inflight_next = (self._inflight_next + 1) & SEQ_MASK
            self._inflight_order[chunk.key] = (chunk.group_id, chunk.trajectory_id)
            self._inflight_by_trajectory.setdefault(chunk.trajectory_id, []).append(chunk.key)
            while len(self._inflight_order) > self.MAX_INFLIGHT_TURNS:
                old_key, (old_group, _) = next(iter(self._inflight_order.items()))
                self._drop_inflight(old_key, old_group)
        new = chunk.token_ids[max(turn[1] - chunk.offset, 0):]  # a repeat carries nothing new
        if new.size:
            group.tree.extend_ndarray(turn[0], np.ascontiguousarray(new, dtype=np.int32))
            turn[1] += int(new.size)
            self.stats["inflight_tokens"] += int(new.size)
        self.stats["inflight_chunks"] += 1

    def _drop_inflight(self, key: str, group_id: str) -> None:
        group = self.inflight.get(group_id)
        turn = group.turns.pop(key, None) if group is not None else None
        _, trajectory_id = self._inflight_order.pop(key, (None, None))
        keys = self._inflight_by_trajectory.get(trajectory_id)
        if keys is not None:
            keys.remove(key)
            if not keys:
                del self._inflight_by_trajectory[trajectory_id]
        if turn is not None and turn[1]:
            group.tree.remove(turn[0])
        if group is not None and not group.turns:
            del self.inflight[group_id]
        self._inflight_closed[key] = None
        while len(self._inflight_closed) > self.MAX_CLOSED_KEYS:
            self._inflight_closed.popitem(last=False)

    def _close_inflight(self, trajectory_id: str) -> None:
        """The trajectory's turn finished (its record arrived): its in-flight tokens are now a record."""
        for key in list(self._inflight_by_trajectory.get(trajectory_id, ())):
            self._drop_inflight(key, self._inflight_order[key][0])

    def _advance_version(self, version: int) -> bool:
        """Move to ``version`` if newer; True when that makes a held record stale."""
        if version <= self.policy_version:
            return False
        self.policy_version = version
        for key, (group_id, _) in list(self._inflight_order.items()):  # tokens of the old weights
            self._drop_inflight(key, group_id)
        lag = self.config.max_policy_lag
        if lag is None or not self.records:
            return False
        floor = version - lag
        return any(r.policy_version < floor for r in self.records.values())

    # ------------------------------------------------------------------ eviction
    def _start_eviction(self) -> None:
        """Drop stale and oldest records, then rebuild the global tree from the survivors (in slices)."""
        cfg = self.config
        victims: list[int] = []
        if cfg.max_policy_lag is not None:
            floor = self.policy_version - cfg.max_policy_lag
            victims = [s for s, r in self.records.items() if r.policy_version < floor]
            for s in victims:
                self.global_tokens -= int(self.records.pop(s).tokens.size)
        n_stale = len(victims)
        if self.global_tokens > cfg.token_budget:
            target = int(cfg.token_budget * cfg.evict_to_fraction)
            while self.records and self.global_tokens > target:
                s, r = self.records.popitem(last=False)
                self.global_tokens -= int(r.tokens.size)
                victims.append(s)
        if not victims:
            return
        self.stats["records_evicted"] += len(victims) - n_stale
        self.stats["records_stale_dropped"] += n_stale
        self.stats["rebuilds"] += 1
        # The old tree keeps drafting until the new one holds every survivor.
        self.rebuilding = RebuildJob(self.new_tree(), list(self.records.values()))
        if cfg.group_trees:
            self.groups = rebuild_group_trees(self.records.values(), self.groups, self.new_tree)

    def _rebuild_step(self) -> int:
        job = self.rebuilding
        done = job.step(self.chunk)
        if job.finished:
            self.global_tree = job.tree
            self.rebuilding = None
            self.stats["rebuild_seconds"] += job.seconds
        return done

    def memory_bytes(self) -> int:
        """Bytes held by the replicated trees (walks the C++ trees: not for hot paths)."""
        total = self.global_tree.estimate_memory()
        if self.config.group_trees:
            total += sum(g.tree.estimate_memory() for g in self.groups.values())
        total += sum(r.tokens.nbytes for r in self.records.values())
        total += sum(g.tree.estimate_memory() for g in self.inflight.values())
        return int(total)
