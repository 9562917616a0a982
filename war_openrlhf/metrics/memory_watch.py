"""The machine's memory in use, sampled while a job runs: its peak, and what the job added.

A training run is many processes (Ray's GCS and raylet, the trainer and reference actors, the
vLLM engines' front-end, core and worker processes, Ray's shared-memory object store), so the
peak of any one process's RSS says little and a sum of RSS counts shared pages more than once.
What a user sizes a machine by is the machine's own figure: memory in use
(``MemTotal - MemAvailable`` of ``/proc/meminfo``, the kernel's estimate of what could not be
handed to a new program without swapping). :class:`MemoryWatch` samples it on a thread and
keeps the baseline (before the job) and the peak. The kernel folds each CPU's page counts into
these figures about once a second (``vm.stat_interval``): a spike shorter than that can be
missed, which a job of minutes does not notice.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

GIB = 2 ** 30
MEMINFO = Path("/proc/meminfo")


def memory_in_use_bytes(meminfo: Path = MEMINFO) -> int:
    """``MemTotal - MemAvailable`` in bytes; a clear error where the file lacks either field."""
    fields: dict[str, int] = {}
    for line in meminfo.read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("MemTotal", "MemAvailable"):
            parts = rest.split()
            if len(parts) != 2 or parts[1] != "kB" or not parts[0].isdigit():
                raise ValueError(f"{meminfo}: field {name} is {rest.strip()!r}, expected '<number> kB'")
            fields[name] = int(parts[0]) * 1024
    missing = [f for f in ("MemTotal", "MemAvailable") if f not in fields]
    if missing:
        raise ValueError(f"{meminfo}: no {' or '.join(missing)} field")
    return fields["MemTotal"] - fields["MemAvailable"]


class MemoryWatch:
    """Sample the machine's memory in use every ``interval_s`` on a daemon thread.

    ``with MemoryWatch() as w: ...`` then ``w.summary()``: the baseline (the first sample,
    taken on entry), the peak and the peak less the baseline, in GiB. Other work on the
    machine counts too: read the figures from a machine the job has to itself."""

    def __init__(self, interval_s: float = 0.5, meminfo: Path = MEMINFO) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.interval_s = interval_s
        self.meminfo = meminfo
        self.baseline = 0
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> int:
        used = memory_in_use_bytes(self.meminfo)
        self.samples += 1
        if used > self.peak:
            self.peak = used
        return used

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> "MemoryWatch":
        self.baseline = self.peak = memory_in_use_bytes(self.meminfo)
        self.samples = 1
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="memory-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.sample()  # the state at the end counts too

    def __enter__(self) -> "MemoryWatch":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def summary(self) -> dict:
        return {"baseline_gib": round(self.baseline / GIB, 3), "peak_gib": round(self.peak / GIB, 3),
                "peak_added_gib": round((self.peak - self.baseline) / GIB, 3),
                "interval_s": self.interval_s, "samples": self.samples,
                "measure": "machine memory in use (MemTotal - MemAvailable, /proc/meminfo)"}
