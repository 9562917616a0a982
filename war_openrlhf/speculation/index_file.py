"""Saving and loading a replica's replicated state (``.npz`` with a JSON header).

The header records the config, the log position, the array shapes and a SHA-256 of the
arrays; loading checks all of it, so a file is never loaded into a wrong index.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from .index_config import SuffixIndexConfig
from .rebuild import StoredRecord
from .replica import ReplicatedTrees

FORMAT = "war-suffix-index/2"  # /2: array shapes and a SHA-256 in the header

#: The arrays of a saved index, in checksum order.
ARRAYS = ("seqs", "versions", "lengths", "tokens")


class IndexFileError(ValueError):
    """A saved index file that cannot be loaded: names the file and what is wrong."""


def _digest(arrays: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in ARRAYS:
        digest.update(np.ascontiguousarray(arrays[name]).tobytes())
    return digest.hexdigest()


def save_replica(replica: ReplicatedTrees, path: str | Path) -> Path:
    """Write ``replica`` (already drained) to ``path`` atomically: a temporary file in the same
    directory, flushed to disk, then renamed over ``path``."""
    path = Path(path)
    recs = list(replica.records.values())
    arrays = {
        "seqs": np.array([r.seq for r in recs], dtype=np.int64),
        "versions": np.array([r.policy_version for r in recs], dtype=np.int64),
        "lengths": np.array([r.tokens.size for r in recs], dtype=np.int64),
        "tokens": np.concatenate([r.tokens for r in recs]) if recs else np.zeros(0, dtype=np.int32),
    }
    meta = {
        "format": FORMAT,
        "config": asdict(replica.config),
        "applied_seq": replica.applied_seq,
        "policy_version": replica.policy_version,
        "trajectory_ids": [r.trajectory_id for r in recs],
        "group_ids": [r.group_id for r in recs],
        "shapes": {name: list(arrays[name].shape) for name in ARRAYS},
        "sha256": _digest(arrays),
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


def read_replica_file(
    path: str | Path, overrides: dict[str, Any]
) -> tuple[SuffixIndexConfig, list[StoredRecord], int, int]:
    """Read and check a :func:`save_replica` file: ``(config, records, applied_seq, policy_version)``.

    Every problem with the file is one :class:`IndexFileError` naming the file and what is wrong
    (unreadable, not an index, another format, a checksum or shape mismatch, inconsistent arrays)."""
    path = Path(path)

    def bad(what: str) -> IndexFileError:
        return IndexFileError(f"{path}: {what}")

    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            arrays = {name: np.asarray(z[name]) for name in ARRAYS}
    except FileNotFoundError:
        raise bad("no such file") from None
    except Exception as exc:  # noqa: BLE001 - BadZipFile, EOFError, KeyError, ValueError, ...
        raise bad(f"not a saved suffix index ({type(exc).__name__}: {str(exc)[:160]})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise bad(f"format {found!r}, expected {FORMAT!r} (saved by another version?)")
    for name in ARRAYS:
        if list(arrays[name].shape) != list(meta.get("shapes", {}).get(name, [-1])):
            raise bad(f"array '{name}' has shape {list(arrays[name].shape)}, the header says "
                      f"{meta.get('shapes', {}).get(name)}")
    if _digest(arrays) != meta.get("sha256"):
        raise bad("checksum mismatch: the arrays changed after the save")
    seqs, versions, lengths, tokens = (arrays[n] for n in ARRAYS)
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
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    records = [
        StoredRecord(seq, meta["trajectory_ids"][i], meta["group_ids"][i], int(versions[i]),
                     np.ascontiguousarray(tokens[offsets[i] : offsets[i + 1]], dtype=np.int32))
        for i, seq in enumerate(seqs.tolist())
    ]
    return config, records, int(meta["applied_seq"]), int(meta["policy_version"])
