#!/usr/bin/env bash
# The main job: install what is missing, then run it.
# Today: the speculation benchmark on real tau-bench agent traces (8 engines, K=16):
# tokens per verification step of no speculation, vLLM ngram, vLLM's per-engine
# suffix decoding and WAR's global suffix index. Extra arguments go to the tool,
# e.g. --traces FILE --engines 4.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/install.sh"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" tools/bench_speculation.py --engines 8 --k 16 \
    --json results/bench_speculation.json "$@"
