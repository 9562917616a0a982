"""What the index replicas hold, kept by the pool too, so that a restarted job drafts at once.

The replicas live in the engines and the pool's log drops what every replica has applied, so
after a crash nothing outside the dead engines remembers the index. The archive keeps the
records a replica would keep (the same token budget, eviction to the same fraction, the same
policy-version lag, oldest first: ``SuffixIndexConfig``), and saves them beside a training
checkpoint; on resume the pool appends them to its new log, which ships them to the new
engines' replicas before the first turn of the resumed step.

File: ``.npz`` with the arrays ``versions``, ``lead_lengths``, ``response_lengths``, ``tokens``
(every record's lead-in then response, concatenated) and a JSON header (format, the ids, the
array shapes and a SHA-256 of the arrays); a file that fails any check is refused with its
name and the reason, never half-loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import deque
from pathlib import Path
from typing import Iterable

import numpy as np

from ..speculation import CompletedSequence, SuffixIndexConfig

__all__ = ["RecordArchive", "ArchiveFileError", "FORMAT"]

FORMAT = "war-record-archive/1"
ARRAYS = ("versions", "lead_lengths", "response_lengths", "tokens")


class ArchiveFileError(ValueError):
    """A saved archive that cannot be loaded: names the file and what is wrong."""


def _digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in ARRAYS:
        h.update(np.ascontiguousarray(arrays[name]).tobytes())
    return h.hexdigest()


class RecordArchive:
    """The records a replica with ``config`` keeps, oldest first, evicted as it evicts them."""

    def __init__(self, config: SuffixIndexConfig) -> None:
        self.config = config
        self._records: deque[CompletedSequence] = deque()
        self.tokens = 0
        self.policy_version = 0

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> list[CompletedSequence]:
        return list(self._records)

    def add(self, record: CompletedSequence) -> None:
        """A finished turn as the log carries it (lead-in + response); evicts past the budget."""
        self._records.append(record)
        self.tokens += record.num_tokens
        self.policy_version = max(self.policy_version, record.policy_version)
        if self.tokens > self.config.token_budget:
            target = self.config.token_budget * self.config.evict_to_fraction
            while self._records and self.tokens > target:
                self.tokens -= self._records.popleft().num_tokens

    def clear(self) -> None:
        """Drop every record (the replicas were emptied); the policy version stays."""
        self._records.clear()
        self.tokens = 0

    def advance_policy_version(self, version: int) -> None:
        """New weights: records more than ``max_policy_lag`` versions old go (none when the lag is null)."""
        self.policy_version = max(self.policy_version, int(version))
        lag = self.config.max_policy_lag
        if lag is None:
            return
        floor = self.policy_version - lag
        kept = [r for r in self._records if r.policy_version >= floor]
        if len(kept) != len(self._records):
            self._records = deque(kept)
            self.tokens = sum(r.num_tokens for r in kept)

    # ------------------------------------------------------------------ files
    def save(self, path: str | Path) -> Path:
        """Write the archive to ``path`` atomically (a temporary file renamed over it)."""
        path = Path(path)
        recs = list(self._records)
        arrays = {
            "versions": np.asarray([r.policy_version for r in recs], dtype=np.int64),
            "lead_lengths": np.asarray([r.prompt_token_ids.size for r in recs], dtype=np.int64),
            "response_lengths": np.asarray([r.response_token_ids.size for r in recs], dtype=np.int64),
            "tokens": (np.concatenate([np.concatenate([r.prompt_token_ids, r.response_token_ids]) for r in recs])
                       .astype(np.int32) if recs else np.zeros(0, dtype=np.int32)),
        }
        header = {"format": FORMAT, "policy_version": int(self.policy_version),
                  "trajectory_ids": [r.trajectory_id for r in recs], "group_ids": [r.group_id for r in recs],
                  "shapes": {k: list(v.shape) for k, v in arrays.items()}, "sha256": _digest(arrays)}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, header=np.frombuffer(json.dumps(header).encode(), dtype=np.uint8), **arrays)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @staticmethod
    def load_records(path: str | Path) -> tuple[list[CompletedSequence], int]:
        """``(records, policy version at save)`` of a saved archive; :class:`ArchiveFileError`
        naming ``path`` for anything wrong with it."""
        path = Path(path)

        def bad(why: str) -> ArchiveFileError:
            return ArchiveFileError(f"{path}: {why}")

        try:
            with np.load(path, allow_pickle=False) as z:
                header = json.loads(bytes(z["header"]).decode())
                arrays = {k: z[k] for k in ARRAYS}
        except FileNotFoundError:
            raise bad("no such file") from None
        except KeyError as exc:
            raise bad(f"missing array {exc}") from None
        except Exception as exc:  # noqa: BLE001 - truncated zip, bad JSON, ...
            raise bad(f"unreadable ({type(exc).__name__}: {exc})") from None
        if header.get("format") != FORMAT:
            raise bad(f"format {header.get('format')!r}, expected {FORMAT!r}")
        for k, v in arrays.items():
            if list(v.shape) != header.get("shapes", {}).get(k):
                raise bad(f"array {k} has shape {list(v.shape)}, the header says {header.get('shapes', {}).get(k)}")
        if _digest(arrays) != header.get("sha256"):
            raise bad("checksum mismatch (the arrays were changed or cut short)")
        n = len(arrays["versions"])
        tids, gids = header.get("trajectory_ids", []), header.get("group_ids", [])
        if not (len(tids) == len(gids) == n == len(arrays["lead_lengths"]) == len(arrays["response_lengths"])):
            raise bad(f"{n} records but {len(tids)} trajectory ids and {len(gids)} group ids")
        total = int(arrays["lead_lengths"].sum() + arrays["response_lengths"].sum())
        if total != arrays["tokens"].size:
            raise bad(f"record lengths add up to {total} tokens, the file holds {arrays['tokens'].size}")
        out, pos = [], 0
        toks = arrays["tokens"]
        for i in range(n):
            a, b = int(arrays["lead_lengths"][i]), int(arrays["response_lengths"][i])
            out.append(CompletedSequence.create(tids[i], gids[i], int(arrays["versions"][i]),
                                                toks[pos:pos + a], toks[pos + a:pos + a + b]))
            pos += a + b
        return out, int(header.get("policy_version", 0))

    def extend(self, records: Iterable[CompletedSequence]) -> None:
        for r in records:
            self.add(r)
