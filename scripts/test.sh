#!/usr/bin/env bash
# The test command: sets up a fresh machine, then lint + the whole suite (slow benchmarks excluded).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k radix`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh test
ruff check .
ruff format --check .
python -m pytest -q -rs "$@"  # -rs: why each skipped test was skipped
