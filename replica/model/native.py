"""The fused CPU kernels of ``kernels.cpp`` and the fp32 linear layers of ``gemm.cpp``, compiled
for this CPU on first use and cached.

A C++ compiler turns them into one shared library under ``kvroute_home()/kernels`` in about a
second; the file's name carries a digest of the source, the flags, the compiler and the CPU, so
a change to any of them builds afresh. Where no compiler is found, the build fails, or
``KVROUTE_NATIVE_KERNELS=0`` is set, :func:`kernels` returns None and the decoder runs the same
arithmetic as eager PyTorch ops (``replica/model/ops.py``) and oneDNN's linears (``linear.py``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # loads torch's OpenMP runtime first, which the library then shares

from replica.home import kvroute_home

log = logging.getLogger("kvroute.replica")

SOURCES = tuple(Path(__file__).with_name(name) for name in ("kernels.cpp", "gemm.cpp"))
# -mprefer-vector-width=512: GCC vectorises for 256-bit registers on AVX-512 CPUs unless told;
# on an AVX-512 Xeon SiLU-and-multiply and add-and-norm ran ~20 % faster in 512 (BENCHMARKS.md).
FLAGS = (
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "-fopenmp",
    "-shared",
    "-fPIC",
)
DISABLE_ENV = "KVROUTE_NATIVE_KERNELS"

_VOID, _INT64, _FLOAT, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "rms_norm": [_VOID, _VOID, _VOID, _INT64, _INT64, _FLOAT, _INT],
    "add_rms_norm": [_VOID, _VOID, _VOID, _VOID, _INT64, _INT64, _FLOAT, _INT],
    "silu_and_mul": [_VOID, _VOID, _INT64, _INT64, _INT],
    "rotary": [_VOID, _VOID, _VOID, _INT64, _INT64, _INT64, _INT64, _INT],
    "decode_attention": [_VOID, _VOID, _VOID, _VOID, _VOID, *[_INT64] * 8, _FLOAT, _INT],
}
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# Entry points for one dtype only, with an int result (0: not run here).
_SINGLE = {
    "gemm_f32_supported": [],
    "gemm_f32": [_VOID, _INT64, _VOID, _VOID, _VOID, _INT64, _INT64, _INT64, _INT],
    "extend_attention_supported": [_INT64],
    "extend_attention_bf16": [_VOID, _VOID, _VOID, _VOID, _VOID, *[_INT64] * 8, _FLOAT, _INT, _INT64, _INT64],
}


@functools.cache
def kernels() -> ctypes.CDLL | None:
    """The loaded library (entry points ``NAME_f32`` and ``NAME_bf16``), or None: eager ops."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CXX") or "g++") or shutil.which("c++")
    if compiler is None:
        log.warning("no C++ compiler found: the fused CPU kernels are off (eager ops instead)")
        return None
    try:
        library = ctypes.CDLL(str(_built(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("the fused CPU kernels did not build, eager ops instead: %s", detail)
        return None
    for name, argtypes in _SIGNATURES.items():
        for suffix in SUFFIXES.values():
            entry = getattr(library, f"{name}_{suffix}")
            entry.argtypes, entry.restype = argtypes, None
    for name, argtypes in _SINGLE.items():
        entry = getattr(library, name)
        entry.argtypes, entry.restype = argtypes, _INT
    return library


def _built(compiler: str) -> Path:
    """The library for this source, compiler and CPU: built now unless already cached."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256()
    sources = [source.read_bytes() for source in SOURCES]
    for part in (*sources, " ".join(FLAGS).encode(), version.encode(), _cpu_signature()):
        digest.update(part)
    target = kvroute_home() / "kernels" / f"kvroute_kernels-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Built under a private name, then renamed: replicas starting together never load half a file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *FLAGS, "-o", partial, *map(str, SOURCES)], capture_output=True, text=True, check=True
        )
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
    log.info("built the fused CPU kernels: %s", target)
    return target


def _cpu_signature() -> bytes:
    """What -march=native compiles for: the CPU's model and instruction-set flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b""
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(wanted))).encode()
