"""What every benchmark script shares: progress lines, the machine description, the load check."""

from __future__ import annotations

import os
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

BUSY_LOAD = 0.5  # 1-minute load average above which other processes would skew the numbers


def progress(bench: str, message: str) -> None:
    """Progress goes to stderr, so stdout carries only the table."""
    print(f"[{bench} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def warn_if_busy(bench: str) -> float:
    """The 1-minute load average, with a warning when the machine is already busy."""
    load = os.getloadavg()[0]
    if load > BUSY_LOAD:
        progress(
            bench, f"warning: 1-minute load average is {load:.1f}; other processes will skew the numbers"
        )
    return load


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    return cpu or platform.processor() or "unknown"


def package_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"
