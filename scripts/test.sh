#!/usr/bin/env bash
# Install what is missing, then run the test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/install.sh"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest -q "$@"
