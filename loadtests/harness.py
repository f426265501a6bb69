"""What every benchmark shares, and the skeleton of the three component benchmarks.

Shared: progress lines on stderr, the machine description, the load check, pass/fail checks, the
markdown table, the JSON report. The skeleton (:class:`ComponentBenchmark`) runs one benchmark the
same way each time, so each benchmark's own modules hold only what it measures and how it shows it:

1. parse its options (``python -m loadtests.<name>``): its own, then one per size (its
   :class:`loadtests.options.Sizes`), --quick and --out; resolve them into its settings;
2. warn when the machine is already busy (the load average goes into the report);
3. measure, giving its part of the machine description and its report's own keys;
4. assemble the report ``{"command", "machine", <its keys>, "table"}``, where the table is its
   preamble, a ``Command:`` line, then its markdown tables; print the table (stdout), write the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Generic, TypeVar

from kvroute.settings import HelpFormatter
from loadtests.options import Sizes

BUSY_LOAD = 0.5  # 1-minute load average above which other processes would skew the numbers

SettingsT = TypeVar("SettingsT")  # a benchmark's own settings class


def progress(bench: str, message: str) -> None:
    """Progress goes to stderr, so stdout carries only the table."""
    print(f"[{bench} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def reporter(bench: str) -> Callable[[str], None]:
    """:func:`progress` with its benchmark's name filled in."""
    return partial(progress, bench)


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


def machine_info(load: float, details: dict[str, Any]) -> dict[str, Any]:
    """The CPU and its cores, then a benchmark's own ``details``, then the load at its start."""
    return {"cpu": cpu_model(), "cores": os.cpu_count(), **details, "load_average_at_start": load}


# -- checks and tables ---------------------------------------------------------------------------


def passes(value: float | None, limit: float, at_least: bool) -> bool | None:
    """Whether ``value`` meets ``limit`` (from above with ``at_least``); None when not measured."""
    if value is None:
        return None
    return value >= limit if at_least else value <= limit


def check(name: str, value: float | None, limit: float, at_least: bool = False) -> dict[str, Any]:
    """One target, as the reports store it; passed is None when the value could not be measured."""
    target = f"{'>=' if at_least else '<='} {limit:g}"
    return {"check": name, "value": value, "target": target, "passed": passes(value, limit, at_least)}


def verdict(passed: bool | None) -> str:
    return {True: "pass", False: "FAIL", None: "n/a"}[passed]


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def publish(bench: str, report: dict[str, Any], out: str) -> None:
    """Prints the report's table (stdout) and writes the whole report as JSON."""
    print(report["table"])
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    progress(bench, f"wrote {path}")


# -- the skeleton --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measurement:
    """What a benchmark's ``measure`` gives the skeleton."""

    machine: dict[str, Any]  # its part of the machine description (versions, threads, ...)
    report: dict[str, Any]  # its report's own keys, in order, "settings" first


@dataclass(frozen=True)
class ComponentBenchmark(Generic[SettingsT]):
    """One component benchmark: its name, its options, and its steps (see the module docstring).

    Declared positionally, in this order, by each benchmark's ``bench`` module."""

    name: str  # "bench_engine": python -m loadtests.<name>, the progress tag, results/<name>.json
    description: str  # of its --help
    sizes: Sizes
    settings: Callable[[argparse.Namespace, dict[str, Any]], SettingsT]  # from its options and sizes
    measure: Callable[[SettingsT], Measurement]
    preamble: Callable[[dict[str, Any]], list[str]]  # the lines above the Command line
    tables: Callable[[dict[str, Any]], list[str]]  # the markdown tables below it
    add_options: Callable[[argparse.ArgumentParser], None] | None = None  # its own, before the sizes

    def parser(self) -> argparse.ArgumentParser:
        prog = f"python -m loadtests.{self.name}"
        parser = argparse.ArgumentParser(
            prog=prog, description=self.description, formatter_class=HelpFormatter
        )
        if self.add_options is not None:
            self.add_options(parser)
        self.sizes.add_options(parser, out=f"results/{self.name}.json")
        return parser

    def main(self, argv: list[str] | None = None) -> int:
        """``python -m loadtests.<name> ARGV``: runs the benchmark, prints its table, writes its report."""
        argv = sys.argv[1:] if argv is None else argv
        args = self.parser().parse_args(argv)
        self.run(args, ["python", "-m", f"loadtests.{self.name}", *argv])
        return 0

    def run(self, args: argparse.Namespace, command: list[str]) -> dict[str, Any]:
        settings = self.settings(args, self.sizes.chosen(args))  # may raise SystemExit: bad options
        load = warn_if_busy(self.name)
        measured = self.measure(settings)
        report: dict[str, Any] = {
            "command": shlex.join(command),
            "machine": machine_info(load, measured.machine),
            **measured.report,
        }
        preamble = "\n".join([*self.preamble(report), f"Command: `{report['command']}`"])
        report["table"] = "\n\n".join([preamble, *self.tables(report)])
        publish(self.name, report, args.out)
        return report
