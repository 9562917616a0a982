"""Benchmark reports: one JSON document plus a fixed-width table, written the same way by every tool.

Every result file carries its provenance (:func:`provenance`): the command that wrote it, the
git commit of the checkout it ran from (and whether tracked files differed from it), the
machine (CPU model, cores, memory, load average while it ran) and the time. A name ending in
``.gz`` is written gzip-compressed; :func:`read_json` reads both.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

#: the checkout this package lives in (its commit is recorded in every result file)
REPO_ROOT = Path(__file__).resolve().parents[2]


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> str:
    """``columns``: (key, header, format spec). Missing values print as '-'."""
    def cell(row: dict[str, Any], key: str, spec: str) -> str:
        v = row.get(key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        return format(v, spec) if spec else str(v)

    body = [[cell(r, k, s) for k, _, s in columns] for r in rows]
    heads = [h for _, h, _ in columns]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(heads)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    out = [line(heads), line(["-" * w for w in widths])]
    out += [line(b) for b in body]
    return "\n".join(out)


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError):
        pass
    return None


def machine_info() -> dict[str, Any]:
    """The machine a result was measured on. ``load_average`` (1/5/15 min, at writing) tells
    whether other work shared the cores: timings taken under load are noisier."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu_model": _cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": usable,
        "memory_gib": _memory_gib(),
        "load_average": load,
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
    }


def git_commit(root: str | Path | None = None) -> dict[str, Any] | None:
    """``{"commit": sha, "dirty": bool, "changed_files": [...]}`` of the checkout at ``root``
    (default: this package's): ``dirty`` when tracked files differ from the commit, and which
    (the first 50); None outside a git checkout."""
    root = Path(root) if root is not None else REPO_ROOT
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    changed = sorted(line[3:] for line in status.splitlines() if line.strip())
    return {"commit": sha, "dirty": bool(changed), "changed_files": changed[:50]}


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as typed from the repository root: ``python tools/x.py --flag value``."""
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(".py"):
        try:
            argv[0] = str(Path(argv[0]).resolve().relative_to(Path.cwd().resolve()))
        except ValueError:
            pass
        return shlex.join(["python", *argv])
    return shlex.join(argv)


def provenance(command: str | None = None) -> dict[str, Any]:
    """What every result file records about how it came to be."""
    return {
        "command": command if command is not None else command_line(),
        "git": git_commit(),
        "machine": machine_info(),
        "written_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def _clean(value: Any) -> Any:
    """NaN and infinities become null (strict JSON: every reader parses the file)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _dumps(payload: Any, indent: int | None) -> str:
    return json.dumps(_clean(payload), indent=indent, default=str, allow_nan=False)


def write_json(path: str | Path | None, payload: dict[str, Any], *, command: str | None = None,
               stamp: bool = True, indent: int | None = 1) -> Path | None:
    """Write ``payload`` as JSON with its provenance (``command``, ``git``, ``machine``,
    ``written_at``: :func:`provenance`; ``command`` defaults to this process's command line).
    ``stamp=False`` writes ``payload`` as it is (a file that already holds its provenance).
    A path ending in ``.gz`` is gzip-compressed (large results). Returns the path, or None
    when ``path`` is None."""
    if path is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {**payload, **provenance(command)} if stamp else payload
    text = _dumps(doc, indent)
    tmp = path.with_name(path.name + ".tmp")
    if path.name.endswith(".gz"):
        # mtime=0: the same result compresses to the same bytes
        with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as fh:
            fh.write(text.encode())
    else:
        tmp.write_text(text)
    os.replace(tmp, path)
    return path


def read_json(path: str | Path) -> Any:
    """A result file written by :func:`write_json` (plain or ``.gz``)."""
    path = Path(path)
    if path.name.endswith(".gz"):
        with gzip.open(path, "rt") as fh:
            return json.load(fh)
    return json.loads(path.read_text())


def spread(values: Sequence[float]) -> dict[str, Any]:
    """A timed figure over repeated runs: ``{"median", "min", "max", "runs"}`` (every run kept;
    NaN runs, where nothing was measured, are left out of the median and the range)."""
    vals = [float(v) for v in values]
    if not vals:
        raise ValueError("spread: no runs")
    s = sorted(v for v in vals if math.isfinite(v))
    if not s:  # nothing measured (e.g. no call fell in the bucket)
        return {"median": None, "min": None, "max": None, "runs": vals}
    n = len(s)
    median = s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
    return {"median": median, "min": s[0], "max": s[-1], "runs": vals}


def timed_call(fn: Any, *args: Any) -> tuple[Any, float, float]:
    """``(result, wall_us, cpu_us)`` of one call. CPU time is this thread's
    (``time.thread_time_ns``): time the scheduler gives to other work on a shared machine is
    not in it, cache interference from that work still is. Both include the clocks' own
    cost; :func:`timer_overhead_us` measures it, to be subtracted."""
    import time

    c0 = time.thread_time_ns()
    w0 = time.perf_counter_ns()
    out = fn(*args)
    w1 = time.perf_counter_ns()
    c1 = time.thread_time_ns()
    return out, (w1 - w0) / 1e3, (c1 - c0) / 1e3


def _noop() -> None:
    return None


def timer_overhead_us(samples: int = 2000) -> tuple[float, float]:
    """Median ``(wall_us, cpu_us)`` that :func:`timed_call` reports for an empty call."""
    walls, cpus = [], []
    for _ in range(samples):
        _, w, c = timed_call(_noop)
        walls.append(w)
        cpus.append(c)
    return spread(walls)["median"], spread(cpus)["median"]
