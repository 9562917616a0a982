#!/usr/bin/env bash
# The main job: install what is missing, then the CPU demo -- the tiny agent policy built
# locally, 36 GRPO steps through OpenRLHF's Ray trainer with WAR rollouts (2 engines, the
# calculator tool-use task), one rollout step side by side against OpenRLHF's own rollout
# path, then where the TensorBoard logs and the summary plot are and a one-screen summary.
# Extra arguments go to the demo (--config FILE, --out DIR, --seed N, --no-compare, --json FILE).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
INSTALL_START=$(date +%s.%N)
bash "$ROOT/scripts/install.sh"
# the demo's run record keeps the install time (the whole job's time is install + demo)
WAR_INSTALL_S=$(awk -v a="$INSTALL_START" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
export WAR_INSTALL_S
source "$ROOT/scripts/env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m war_openrlhf.cli.cpu_demo "$@"
