"""What every benchmark script shares: progress lines, the machine description, the load check."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

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


def add_size_options(
    parser: argparse.ArgumentParser, full: dict[str, Any], quick: dict[str, Any], out: str
) -> None:
    """``--NAME`` for every size (default from ``full``, or ``quick`` with --quick), --quick, --out."""
    for name, default in full.items():
        kind = type(default)
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=kind, help=f"default {default} (--quick: {quick[name]})"
        )
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--out", default=out, help="JSON report path")


def chosen_sizes(args: argparse.Namespace, full: dict[str, Any], quick: dict[str, Any]) -> dict[str, Any]:
    """Each size from its option, else from ``quick`` (with --quick) or ``full``."""
    defaults = quick if args.quick else full
    return {name: value if (value := getattr(args, name)) is not None else defaults[name] for name in full}


def publish(bench: str, report: dict[str, Any], out: str) -> None:
    """Prints the report's table (stdout) and writes the whole report as JSON."""
    print(report["table"])
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    progress(bench, f"wrote {path}")
