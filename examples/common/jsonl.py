"""JSONL output shared by the example datasets (standard library only, like tool_protocol)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Mapping


def write_jsonl(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """Write ``rows`` to ``path`` as UTF-8 JSONL, one object per line (non-ASCII kept as is),
    creating the parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
