"""A vLLM process killed by a signal, reported as such: which signal, which engine, what to try.

When a vLLM worker dies from a fatal signal (SIGILL from an instruction the CPU refuses, SIGSEGV,
SIGBUS, SIGFPE, SIGABRT), vLLM says only "Worker proc VllmWorker-0 died unexpectedly" and raises
``EngineDeadError`` after pages of stack. :class:`~war_openrlhf.engine.engine.WarEngine` sets
``WAR_ENGINE_FAULT_DIR`` to a directory of its own before it starts vLLM; the
``war_engine_faults`` vLLM plugin (:func:`register`, loaded in every process vLLM starts) then
points Python's :mod:`faulthandler` at ``<dir>/<pid>.log`` in each of them. A fatal signal writes
"Fatal Python error: Illegal instruction" there before the process dies; :func:`explain_engine_death`
turns those files into one sentence. A process killed by SIGKILL (the kernel's OOM killer) leaves
no record: the sentence then says so.
"""

from __future__ import annotations

import faulthandler
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ENV_FAULT_DIR", "WorkerFault", "WorkerKilled", "register", "read_worker_faults", "explain_engine_death"]

#: Directory for fault records; set by the engine before vLLM starts, inherited by its processes.
ENV_FAULT_DIR = "WAR_ENGINE_FAULT_DIR"

_FILES: list = []  # the open record files (faulthandler writes to their descriptors at the fault)

#: faulthandler's words -> the signal's name
_SIGNALS = {
    "Illegal instruction": "SIGILL",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Floating-point exception": "SIGFPE",
    "Floating point exception": "SIGFPE",
    "Aborted": "SIGABRT",
}

#: what to try, per signal
_ADVICE = {
    "SIGILL": ("the CPU refused an instruction of a compiled kernel. On an AMX CPU (Xeon with amx_tile) run "
               "`war-train --preflight` to see the CPU attention decision; WAR_CPU_ATTN_ISA=vec selects the "
               "non-AMX kernel; dtype float32 avoids the bfloat16 kernels"),
    "SIGSEGV": "a compiled kernel read invalid memory: check the model's dtype and max_model_len, and the KV size",
    "SIGBUS": "shared memory ran out or a mapped file vanished: check /dev/shm's size and the disk",
    "SIGFPE": "a compiled kernel divided by zero: check the model config (head sizes, block size)",
    "SIGABRT": "a library aborted: the lines above the fault in the record say which",
}


class WorkerKilled(RuntimeError):
    """An engine's vLLM process was killed by a signal (the message says which, where, what to try)."""


@dataclass(frozen=True)
class WorkerFault:
    """One fault record: the process, its command line, the signal and the record file."""

    pid: int
    process: str
    signal: str
    path: Path


def register() -> None:
    """vLLM general-plugin entry point: record fatal signals of this process, when an engine asked."""
    directory = os.environ.get(ENV_FAULT_DIR)
    if not directory or _FILES:
        return
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        f = open(Path(directory) / f"{os.getpid()}.log", "w", buffering=1)  # noqa: SIM115 - kept open
        f.write(f"pid {os.getpid()}: {' '.join(sys.argv)[:300]}\n")
        f.flush()
        faulthandler.enable(file=f, all_threads=True)
        _FILES.append(f)
    except OSError:  # a fault record is a diagnosis aid: never stop an engine for it
        pass


def read_worker_faults(directory: str | os.PathLike | None) -> list[WorkerFault]:
    """The fatal signals recorded under ``directory`` (empty when none or no directory)."""
    if not directory or not Path(directory).is_dir():
        return []
    faults = []
    for path in sorted(Path(directory).glob("*.log")):
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        match = re.search(r"Fatal Python error: ([A-Za-z -]+)", text)
        if not match:
            continue
        words = match.group(1).strip()
        header = text.splitlines()[0] if text else ""
        pid_match = re.match(r"pid (\d+): (.*)", header)
        faults.append(WorkerFault(
            pid=int(pid_match.group(1)) if pid_match else int(path.stem) if path.stem.isdigit() else -1,
            process=pid_match.group(2) if pid_match else "?",
            signal=_SIGNALS.get(words, words),
            path=path,
        ))
    return faults


def explain_engine_death(engine_index: int, directory: str | os.PathLike | None, exc: BaseException) -> str | None:
    """One sentence on why engine ``engine_index``'s vLLM died, from its fault records; None when the
    error is not a dead engine or no record explains it."""
    faults = read_worker_faults(directory)
    if faults:
        f = faults[0]
        return (f"engine {engine_index}: its vLLM process (pid {f.pid}) was killed by {f.signal}; "
                f"what to try: {_ADVICE.get(f.signal, 'see the record')}. Fault record with the stack: {f.path}")
    dead = type(exc).__name__ in ("EngineDeadError", "EngineGenerateError") or "died unexpectedly" in str(exc)
    if dead:
        return (f"engine {engine_index}: its vLLM process died without a fault record: killed by SIGKILL "
                "(the kernel's out-of-memory killer: check `dmesg`, the KV size and the number of engines per "
                "node) or exited; the engine's log above has vLLM's last words")
    return None
