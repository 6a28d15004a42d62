#!/usr/bin/env bash
# Load test of a running stack (start one with `.venv/bin/rollout-service up`):
#   bench/loadtest.sh [extra rollout-service loadtest flags]
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/rollout-service loadtest --service "${SERVICE:-http://127.0.0.1:8080}" \
  --trainers 4 --batch 4 --n 8 --duration 120 --plot results/loadtest.png --json results/loadtest.json "$@"
