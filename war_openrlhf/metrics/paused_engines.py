"""Engine sets a benchmark keeps alive but is not measuring, stopped (SIGSTOP) while another runs.

Why: a benchmark that compares rollout paths on the same machine keeps every path's engines up
and runs one at a time. An idle vLLM engine is not free: its worker spins on vLLM's shared-memory
queue and its actor and engine core wake up on their own timers, and the idle sets of different
paths burn different amounts (measured on two cores: 0.2-0.6 CPU seconds per 4-second step). On a
machine whose cores the engines share, that CPU comes out of the measured path's forward passes,
so the comparison would depend on which *other* paths the run included. A user runs one path;
stopping the others' processes for the length of a run measures that.

Stopped processes keep their memory, sockets and Ray registration; they continue (SIGCONT)
before their own runs and when the benchmark ends, also on an error.
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from typing import Iterable, Iterator, Mapping, Sequence

import psutil

__all__ = ["actor_process_trees", "idle_while", "paused"]


def actor_process_trees(handles: Sequence) -> list[int]:
    """The pids of Ray actors ``handles`` and of every process they started (vLLM's engine core
    and workers), each actor asked for its own pid."""
    import ray

    pids = ray.get([h.__ray_call__.remote(lambda self: os.getpid()) for h in handles])
    out: list[int] = []
    for pid in pids:
        try:
            proc = psutil.Process(int(pid))
            out += [proc.pid] + [c.pid for c in proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return out


def idle_while(engine_sets: Mapping[str, object], trees: Mapping[int, Sequence[int]]) -> dict[str, list[int]]:
    """For each configuration (``engine_sets``: its name -> the engine handles it runs on), the pids
    of every *other* engine set (``trees``: ``id(handles)`` -> pids): what is stopped while it runs.
    Configurations that share one set (``--same-engines``) stop nothing of it."""
    return {name: [pid for key, pids in trees.items() if key != id(handles) for pid in pids]
            for name, handles in engine_sets.items()}


def _signal_all(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(int(pid), sig)
        except ProcessLookupError:  # gone meanwhile: nothing to stop or continue
            pass


@contextmanager
def paused(pids: Sequence[int]) -> Iterator[None]:
    """Stop ``pids`` for the body of the ``with``; they continue afterwards, whatever happened."""
    pids = list(pids)
    _signal_all(pids, signal.SIGSTOP)
    try:
        yield
    finally:
        _signal_all(pids, signal.SIGCONT)
