#!/usr/bin/env bash
# The test command: static checks, then every test tier on the local testbed.
# Usage: scripts/test.sh [pytest args...]   (e.g. scripts/test.sh tests/unit)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
echo "== static checks"
ruff check .
ruff format --check .
mypy core operator router engine-sim testbed sim
lint-imports
python -m prfaas_operator.crd --check
echo "== tests"
python -m pytest -q -p no:cacheprovider --durations=25 "$@"
