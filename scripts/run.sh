#!/usr/bin/env bash
# The run command: sets up a fresh machine (venv, CPU torch, redis-server, and what the README's
# examples use: the openai client and `kvroute bench`), prepares the default model
# (SmolLM2-135M-Instruct) if needed, and brings up the whole local stack: a private Redis, two
# replicas and the gateway on http://127.0.0.1:8000/v1. Extra arguments go to `kvroute up`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh all
exec kvroute up --host "${KVROUTE_HOST:-127.0.0.1}" --port "${KVROUTE_PORT:-8000}" "$@"
