"""Tables and figures of the docs, rendered from committed result files.

A rendered region of a markdown file names its result file(s) and a renderer::

    <!-- table: benchmarks/results/index/bench_index.json#index_summary -->
    | metric | ... |
    <!-- /table -->

``table`` and ``block`` regions are whole lines (a table, or a paragraph whose figures come
from the file); a ``value`` region is inline: ``<!-- value: FILE#NAME -->1.18x<!-- /value -->``.
``NAME`` is a renderer registered below, or for a value a dotted path into the file's JSON
with an optional format (``results.war_global.tokens_per_step:.3f``; ``:spread.1f`` prints a
:func:`~war_openrlhf.metrics.report.spread` as ``median (min-max)``). Several files are joined
with commas (``a.json,b.json#name``). Paths are relative to the repository root.

:func:`render_text` re-renders every region from the files; :func:`check_text` lists the
regions whose text no longer matches them (``tools/render_docs.py`` writes or checks the docs;
``tests/test_docs_tables.py`` checks them on every run).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .report import read_json

REGION_RE = re.compile(
    r"^<!-- (?P<kind>table|block): (?P<spec>\S+) -->\n(?P<body>.*?)^<!-- /(?P=kind) -->$",
    re.S | re.M)
VALUE_RE = re.compile(r"<!-- value: (?P<spec>\S+) -->(?P<body>.*?)<!-- /value -->", re.S)
#: declares that the markdown table right below it states no measured figure (definitions, rules)
STATIC_MARK = "<!-- static table: no measured figures -->"

Renderer = Callable[..., str]
RENDERERS: dict[str, Renderer] = {}


def renderer(name: str) -> Callable[[Renderer], Renderer]:
    def register(fn: Renderer) -> Renderer:
        if name in RENDERERS:
            raise ValueError(f"renderer {name!r} registered twice")
        RENDERERS[name] = fn
        return fn
    return register


@dataclass(frozen=True)
class Region:
    kind: str
    paths: tuple[str, ...]
    name: str
    body: str
    start: int  # offset in the text
    line: int


def parse_spec(spec: str) -> tuple[tuple[str, ...], str]:
    if "#" not in spec:
        raise ValueError(f"{spec!r}: a rendered region names FILE#RENDERER")
    paths, name = spec.split("#", 1)
    return tuple(p for p in paths.split(",") if p), name


def regions(text: str) -> list[Region]:
    out = []
    for rx in (REGION_RE, VALUE_RE):
        for m in rx.finditer(text):
            paths, name = parse_spec(m.group("spec"))
            kind = m.groupdict().get("kind") or "value"
            out.append(Region(kind, paths, name, m.group("body"), m.start(), text.count("\n", 0, m.start()) + 1))
    return sorted(out, key=lambda r: r.start)


# --------------------------------------------------------------------------- formatting
def num(v: Any, spec: str = ".2f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def ints(v: Any) -> str:
    return "-" if v is None else f"{int(v):,}"


def spread_text(s: dict[str, Any], spec: str = ".1f", scale: float = 1.0) -> str:
    """``median (min-max)`` of a :func:`~war_openrlhf.metrics.report.spread`."""
    if s is None or s.get("median") is None:
        return "-"
    return (f"{format(s['median'] * scale, spec)} "
            f"({format(s['min'] * scale, spec)}-{format(s['max'] * scale, spec)})")


def load_note(d: dict) -> str:
    """How busy the machine was as a timed run ended (its 5-minute load average against its cores)."""
    m = d.get("machine") or {}
    load, cpus = m.get("load_average"), m.get("cpus")
    if not load or not cpus:
        return "the machine's load was not recorded"
    return f"load average {load[1]:.1f} on {cpus} cores as the run ended"


def pct(x: float, spec: str = ".0f") -> str:
    return f"{format(100 * x, spec)}%"


def signed_pct(x: float, spec: str = ".0f") -> str:
    """A ratio as a change: 1.05 -> '+5%'."""
    return f"{'+' if x >= 1 else '-'}{format(abs(100 * (x - 1)), spec)}%"


def md_table(header: list[str], align: list[str], rows: list[list[str]]) -> str:
    """``align``: 'l' or 'r' per column."""
    seps = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(seps) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def lookup(data: Any, path: str) -> Any:
    """A dotted path into JSON (``results.war_global.tokens_per_step``; list items by index)."""
    cur = data
    for part in path.split("."):
        if isinstance(cur, list):
            cur = cur[int(part)]
        elif isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            raise KeyError(f"{path!r}: no {part!r}")
    return cur


def render_value(spec_name: str, docs: list[Any]) -> str:
    if spec_name in RENDERERS:
        return RENDERERS[spec_name](*docs)
    path, _, fmt = spec_name.partition(":")
    v = lookup(docs[0], path)
    if fmt.startswith("spread"):
        return spread_text(v, fmt[len("spread"):] or ".1f")
    if fmt == ",":
        return f"{v:,}"
    return format(v, fmt) if fmt else str(v)


# --------------------------------------------------------------------------- the engine
@dataclass
class Mismatch:
    file: str
    line: int
    spec: str
    found: str
    expected: str


def _load(root: Path, paths: tuple[str, ...], cache: dict) -> list[Any]:
    out = []
    for p in paths:
        if p not in cache:
            cache[p] = read_json(root / p)
        out.append(cache[p])
    return out


def render_region(region: Region, root: Path, cache: dict | None = None) -> str:
    docs = _load(root, region.paths, {} if cache is None else cache)
    if region.kind == "value":
        return render_value(region.name, docs)
    if region.name not in RENDERERS:
        raise KeyError(f"no renderer {region.name!r} (known: {', '.join(sorted(RENDERERS))})")
    body = RENDERERS[region.name](*docs)
    return body if body.endswith("\n") else body + "\n"


def render_text(text: str, root: str | Path) -> str:
    """``text`` with every rendered region re-rendered from its files."""
    root = Path(root)
    cache: dict = {}

    def block(m: re.Match) -> str:
        paths, name = parse_spec(m.group("spec"))
        r = Region(m.group("kind"), paths, name, m.group("body"), m.start(), 0)
        return f"<!-- {r.kind}: {m.group('spec')} -->\n{render_region(r, root, cache)}<!-- /{r.kind} -->"

    def value(m: re.Match) -> str:
        paths, name = parse_spec(m.group("spec"))
        r = Region("value", paths, name, m.group("body"), m.start(), 0)
        return f"<!-- value: {m.group('spec')} -->{render_region(r, root, cache)}<!-- /value -->"

    return VALUE_RE.sub(value, REGION_RE.sub(block, text))


def check_text(text: str, root: str | Path, name: str = "<text>") -> list[Mismatch]:
    """Every rendered region of ``text`` whose body differs from a fresh rendering."""
    root = Path(root)
    cache: dict = {}
    bad = []
    for r in regions(text):
        expected = render_region(r, root, cache)
        if r.body != expected:
            spec = ",".join(r.paths) + "#" + r.name
            bad.append(Mismatch(name, r.line, spec, r.body, expected))
    return bad


def unsourced_tables(text: str) -> list[int]:
    """Line numbers of markdown tables that are neither inside a rendered region nor declared
    static (:data:`STATIC_MARK` on the line before): tables typed by hand."""
    covered = set()
    for m in REGION_RE.finditer(text):
        a = text.count("\n", 0, m.start())
        b = text.count("\n", 0, m.end())
        covered.update(range(a, b + 1))
    lines = text.split("\n")
    out, in_code = [], False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code or i in covered:
            continue
        is_sep = re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|)+", line.strip()) is not None
        if is_sep and i >= 1 and lines[i - 1].lstrip().startswith("|"):
            head = i - 1
            if not (head >= 1 and lines[head - 1].strip() == STATIC_MARK):
                out.append(head + 1)
    return out


# the renderers register themselves by name on import (kept in their own module)
from . import docs_renderers  # noqa: E402,F401
