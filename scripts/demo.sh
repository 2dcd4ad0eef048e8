#!/usr/bin/env bash
# The main job, live: two local clusters, the chart, a PrfaasDeployment, traffic, both loops.
# Usage: scripts/demo.sh [--duration SECONDS] [--time-scale X] [--nodes-per-instance N] [--keep]
# The first run installs everything and builds the testbed (~20 min); later runs reach traffic in ~1 min.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m prfaas_testbed.demo "$@"
