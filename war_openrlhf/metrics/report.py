"""Benchmark reports: one JSON document plus a fixed-width table, written the same way by every tool."""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path
from typing import Any, Sequence


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


def machine_info() -> dict[str, Any]:
    import os

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


def write_json(path: str | Path | None, payload: dict[str, Any]) -> Path | None:
    if path is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**payload, "machine": machine_info(), "command": " ".join(sys.argv)}, indent=2))
    return path
