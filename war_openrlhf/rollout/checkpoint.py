"""The pool's state beside a training checkpoint: saved at every save, restored on resume.

A job that restarts from OpenRLHF's checkpoint gets back its model, optimizer and data
position; without this its rollouts would start cold: an empty suffix index (no drafts until
the new records accumulate), a dispatcher that has measured nothing (rates, survival curve,
workload shape, KV shares), turn priorities with no finished groups to learn from. What is
saved (``save_pool_state``), in one directory written atomically:

* ``index_records.npz``: the records the index replicas hold (:class:`~.record_archive.RecordArchive`);
* ``state.json``: the format, the pool's policy version, the dispatch policy's name and its
  measurements (``DispatchPolicy.state_dict``), the turn priorities' finished groups.

Not saved: the engines' prefix caches and the dispatcher's model of them (the engines restart
empty), and anything of the step that was in flight (OpenRLHF redoes it from the checkpoint's
data position: its samples were never trained).

On resume (``load_pool_state``) the records are appended to the new pool's log, their policy
versions shifted so that the newest saved version is the pool's current one (the engines
restart their weight versions from zero; ages between records are kept), and shipped to every
replica before the first turn. A missing or unreadable directory is a cold start with the
reason, never a failed job.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

from .record_archive import ArchiveFileError, RecordArchive

__all__ = ["STATE_FORMAT", "save_pool_state", "load_pool_state", "PoolStateError"]

log = logging.getLogger(__name__)

STATE_FORMAT = "war-pool-state/1"
RECORDS_FILE = "index_records.npz"
STATE_FILE = "state.json"


class PoolStateError(ValueError):
    """A saved pool state that cannot be restored: names the directory and what is wrong."""


def save_pool_state(pool: Any, directory: str | Path) -> Path:
    """Write ``pool``'s state to ``directory`` (replaced atomically: a reader sees the old
    state or the new one, never a mix)."""
    directory = Path(directory)
    tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        pool.shipper.archive.save(tmp / RECORDS_FILE)
        priorities = pool.router.priorities
        state = {
            "format": STATE_FORMAT,
            "policy_version": int(pool.policy_version),
            "dispatch_policy": pool.policy.name,
            "dispatch_state": pool.policy.state_dict(),
            "turn_priorities": priorities.records.state_dict() if priorities is not None else None,
            "batches": int(pool._batch_index),
        }
        with open(tmp / STATE_FILE, "w") as fh:
            json.dump(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        old = directory.with_name(f"{directory.name}.old-{os.getpid()}")
        if directory.exists():
            os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _read_state(directory: Path) -> dict:
    path = directory / STATE_FILE
    try:
        with open(path) as fh:
            state = json.load(fh)
    except FileNotFoundError:
        raise PoolStateError(f"{directory}: no {STATE_FILE} (not a saved pool state)") from None
    except (OSError, ValueError) as exc:
        raise PoolStateError(f"{path}: unreadable ({exc})") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise PoolStateError(f"{path}: format {got!r}, expected {STATE_FORMAT!r}")
    for key in ("policy_version", "dispatch_policy", "dispatch_state"):
        if key not in state:
            raise PoolStateError(f"{path}: missing field {key!r}")
    return state


def load_pool_state(pool: Any, directory: str | Path) -> dict[str, Any]:
    """Restore what :func:`save_pool_state` wrote into a new ``pool`` (before its first batch).
    Returns what was restored; raises :class:`PoolStateError` (naming the file) without
    changing the pool when the state cannot be read."""
    directory = Path(directory)
    state = _read_state(directory)
    try:
        records, saved_version = RecordArchive.load_records(directory / RECORDS_FILE)
    except ArchiveFileError as exc:
        raise PoolStateError(str(exc)) from None
    shift = int(pool.policy_version) - int(saved_version)
    restored = [replace(r, policy_version=max(0, r.policy_version + shift)) for r in records]
    for r in restored:
        pool.shipper.log.append(r)
        pool.shipper.archive.add(r)
    dispatch = "skipped"
    if state["dispatch_policy"] == pool.policy.name:
        pool.policy.load_state_dict(state["dispatch_state"])
        dispatch = "restored"
    else:
        log.warning("%s: saved with dispatch policy %r, the pool runs %r: its measurements start cold",
                    directory, state["dispatch_policy"], pool.policy.name)
    if state.get("turn_priorities") is not None and pool.router.priorities is not None:
        pool.router.priorities.records.load_state_dict(state["turn_priorities"])
    # trajectory and group ids continue where the saved job stopped: a new "b0-p0-s0" must not
    # draft from the saved one's trajectory tree as if it were its own earlier turns
    pool._batch_index = max(pool._batch_index, int(state.get("batches", 0)))
    return {"records": len(restored), "record_tokens": sum(r.num_tokens for r in restored),
            "saved_policy_version": int(saved_version), "dispatch": dispatch,
            "batches_before": int(state.get("batches", 0))}
