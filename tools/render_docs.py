#!/usr/bin/env python
"""Render the docs' tables and figures from the committed result files, or check them.

    python tools/render_docs.py            # rewrite every rendered region of the docs
    python tools/render_docs.py --check    # exit 1 and show the difference where a region
                                           # no longer matches its result file

A rendered region names its file and renderer (``war_openrlhf/metrics/docs_tables.py``)::

    <!-- table: benchmarks/results/index/bench_index.json#index_summary -->
    ...
    <!-- /table -->
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from war_openrlhf.metrics.docs_tables import check_text, render_text, unsourced_tables  # noqa: E402

#: the pages that state measured figures: every table in them renders from a file or is marked static
TABLE_DOCS = ["README.md", "docs/benchmarks.md"]
#: every page whose rendered regions are kept in step with their files (as tests/test_docs_tables.py checks)
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 on any mismatch")
    ap.add_argument("files", nargs="*", default=DOCS, help=f"markdown files (default: {' '.join(DOCS)})")
    args = ap.parse_args(argv)
    bad = 0
    for name in args.files:
        path = ROOT / name
        text = path.read_text()
        for line in (unsourced_tables(text) if name in TABLE_DOCS else []):
            print(f"{name}:{line}: a table with neither a result file nor the static mark")
            bad += 1
        if args.check:
            for m in check_text(text, ROOT, name):
                bad += 1
                print(f"{name}:{m.line}: {m.spec} does not match its file")
                sys.stdout.writelines(difflib.unified_diff(m.found.splitlines(True), m.expected.splitlines(True),
                                                           "docs", "rendered"))
        else:
            new = render_text(text, ROOT)
            if new != text:
                path.write_text(new)
                print(f"rendered {name}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
