#!/usr/bin/env python
"""Build the tiny trained agent policy and record its held-out check as a result file.

    python tools/bench_tiny_policy.py --out .cache/war_tiny_policy \\
        --json benchmarks/results/tiny_policy/build.json

The build (``war_openrlhf.fixtures.tiny_policy``) is deterministic for a spec and a torch
thread count; an existing build of the same spec is reused (``--force`` rebuilds), and the file
says which (``reused_existing_build``). Its results are the build's own: data, training and
the held-out check (greedy first turns, temperature-1 samples, whole episodes per task).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from war_openrlhf.fixtures.tiny_policy import DEFAULT_PATH, build_tiny_policy, read_manifest  # noqa: E402
from war_openrlhf.metrics import write_json  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_PATH)
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    ap.add_argument("--force", action="store_true", help="rebuild even if --out holds this build")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    before = read_manifest(args.out) if args.out.exists() else None
    out = build_tiny_policy(args.out, force=args.force, num_threads=args.threads)
    manifest = read_manifest(out)
    if manifest is None:
        raise SystemExit(f"{out}: no manifest after the build")
    reused = before is not None and before == manifest
    write_json(args.json, {"benchmark": "tiny_policy", "reused_existing_build": reused, **manifest})
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
