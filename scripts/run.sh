#!/usr/bin/env bash
# The run command: sets up a fresh machine, prepares the default model (SmolLM2-135M-Instruct)
# if needed, and serves it. Extra arguments go to `kvroute replica`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh prepare
exec kvroute replica --host "${KVROUTE_HOST:-127.0.0.1}" --port "${KVROUTE_PORT:-8000}" "$@"
