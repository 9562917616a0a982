"""The completed-sequence log: the single ordered source every index replica applies.

Why a log and not a shared tree: engines live in separate processes (one per GPU),
so each keeps its own replica of the suffix index. Replicas that apply the same
entries in the same order run the same deterministic operations on the C++ tree and
therefore give identical drafts. Sequence numbers make catch-up trivial: a replica
asks for everything after the last sequence number it applied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .records import CompletedSequence, InflightChunk, _check_version


@dataclass(frozen=True)
class LogEntry:
    """One log entry: a completed sequence, a policy-version advance, or a chunk of a turn
    still generating (:class:`InflightChunk`)."""

    seq: int
    record: CompletedSequence | None = None
    policy_version: int | None = None
    chunk: InflightChunk | None = None


class LogTruncatedError(LookupError):
    """A replica asked for entries the log has already dropped."""


class CompletedSequenceLog:
    """Append-only, sequence-numbered log of completed turns/trajectories.

    Sequence numbers start at 1 and increase by one per entry; ``last_seq`` is 0 for
    an empty log. Memory is bounded by :meth:`truncate`, called once every replica
    has applied a prefix (the rollout pool knows the slowest replica's position).
    """

    def __init__(self, start_seq: int = 0) -> None:
        if start_seq < 0:
            raise ValueError(f"start_seq: must be >= 0, got {start_seq}")
        self._entries: list[LogEntry] = []
        self._first_seq = start_seq + 1  # seq of self._entries[0]
        self._policy_version = 0

    # ------------------------------------------------------------------ writing
    def append(self, record: CompletedSequence | Mapping[str, Any]) -> int:
        """Append a completed sequence (validated) and return its sequence number."""
        if not isinstance(record, CompletedSequence):
            record = CompletedSequence.from_mapping(record)
        self._policy_version = max(self._policy_version, record.policy_version)
        return self._push(record=record)

    def append_many(self, records: Iterable[CompletedSequence | Mapping[str, Any]]) -> list[int]:
        return [self.append(r) for r in records]

    def append_chunk(self, chunk: InflightChunk) -> int:
        """Append new tokens of a turn still generating; returns the sequence number."""
        if not isinstance(chunk, InflightChunk):
            raise ValueError(f"chunk: expected an InflightChunk, got {type(chunk).__name__}")
        return self._push(chunk=chunk)

    def advance_policy_version(self, version: int) -> int:
        """Record that the trainer published policy ``version`` (drives version-based eviction)."""
        version = _check_version(version)
        if version < self._policy_version:
            raise ValueError(
                f"policy_version: cannot go back from {self._policy_version} to {version}"
            )
        self._policy_version = version
        return self._push(policy_version=version)

    def _push(self, **kwargs: Any) -> int:
        seq = self.last_seq + 1
        self._entries.append(LogEntry(seq=seq, **kwargs))
        return seq

    # ------------------------------------------------------------------ reading
    @property
    def last_seq(self) -> int:
        return self._first_seq + len(self._entries) - 1

    @property
    def first_seq(self) -> int:
        """Sequence number of the oldest entry still held."""
        return self._first_seq

    @property
    def policy_version(self) -> int:
        return self._policy_version

    def __len__(self) -> int:
        return len(self._entries)

    def read(self, after_seq: int, limit: int | None = None) -> list[LogEntry]:
        """Entries with sequence number > ``after_seq`` (at most ``limit``)."""
        if after_seq < 0:
            raise ValueError(f"after_seq: must be >= 0, got {after_seq}")
        if after_seq > self.last_seq:
            raise ValueError(
                f"after_seq: {after_seq} is beyond the log's last sequence number {self.last_seq}"
            )
        if after_seq + 1 < self._first_seq:
            raise LogTruncatedError(
                f"after_seq: entries {after_seq + 1}..{self._first_seq - 1} were truncated; "
                "rebuild the replica from a saved index (GlobalSuffixIndex.load) and resume from its seq"
            )
        start = after_seq + 1 - self._first_seq
        stop = len(self._entries) if limit is None else min(len(self._entries), start + limit)
        return self._entries[start:stop]

    def truncate(self, up_to_seq: int) -> int:
        """Drop entries with seq <= ``up_to_seq``; returns how many were dropped."""
        up_to_seq = min(up_to_seq, self.last_seq)
        n = up_to_seq - self._first_seq + 1
        if n <= 0:
            return 0
        del self._entries[:n]
        self._first_seq += n
        return n
