"""CPU time of a rollout's processes, by kind: where a step's CPU goes besides the model.

Why: on a node whose cores are shared (a CPU test machine; on GPU nodes the CPU that drives
the accelerators), every process of a rollout path competes with the engines' own forward
passes, so a path that burns CPU in its driver, engine actors or RPCs slows the engines down
even when each piece looks cheap. Comparing two paths on the same work therefore needs the
CPU seconds of each kind of process per step, not only the wall time.

A process's kind is its own name (``ray::<Actor>``, ``VLLM::EngineCore``, ``VLLM::Worker``) or,
for vLLM's processes, prefixed by the actor that owns them (``ray::WarEngine/VLLM::Worker``), so
that two engine sets alive in one benchmark are told apart; the calling process is ``driver``.
"""

from __future__ import annotations

import os
from typing import Iterable

import psutil

__all__ = ["cpu_seconds_by_kind", "cpu_delta"]


def _name(p: psutil.Process) -> str:
    try:
        cmdline = p.cmdline()
        name = cmdline[0] if cmdline else p.name()
    except psutil.Error:
        return "other"
    name = name.split(" ")[0]
    if name.startswith("ray::"):
        return name.split(".")[0]  # ray::WarEngine.generate -> ray::WarEngine (the method changes)
    if name.startswith("VLLM::"):
        return name
    return "other"


def cpu_seconds_by_kind(processes: Iterable[psutil.Process] | None = None) -> dict[str, float]:
    """User + system CPU seconds so far of this machine's processes (alive now), summed by kind;
    processes of other kinds (Ray's own daemons, the shell) are ``other``."""
    me = os.getpid()
    out: dict[str, float] = {}
    procs = list(processes) if processes is not None else list(psutil.process_iter())
    names: dict[int, str] = {}
    for p in procs:
        try:
            names[p.pid] = "driver" if p.pid == me else _name(p)
        except psutil.Error:
            continue
    for p in procs:
        kind = names.get(p.pid)
        if kind is None:
            continue
        try:
            if kind.startswith("VLLM::"):  # whose engine: the nearest ray:: ancestor
                for parent in p.parents():
                    owner = names.get(parent.pid) or _name(parent)
                    if owner.startswith("ray::"):
                        kind = f"{owner}/{kind}"
                        break
            t = p.cpu_times()
        except psutil.Error:
            continue
        out[kind] = out.get(kind, 0.0) + float(t.user + t.system)
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per kind between two readings (kinds whose processes died count from 0)."""
    return {k: round(after[k] - before.get(k, 0.0), 3) for k in sorted(after) if after[k] - before.get(k, 0.0) > 0}
