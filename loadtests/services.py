"""The servers a benchmark starts and measures: subprocesses on free loopback ports."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

CLK_TCK = os.sysconf("SC_CLK_TCK")
START_TIMEOUT = 60.0


class Service:
    """A subprocess listening on a loopback port; ``ready`` decides when its /health is good.
    ``env``: variables added to this process's environment. It runs in a process group of its
    own, killed whole: vLLM's engine core and workers are its children and would otherwise live
    on, spinning on the cores of every later measurement."""

    def __init__(
        self, name: str, command: list[str], port: int, log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )

    def wait(self, ready: Callable[[str], bool], timeout: float = START_TIMEOUT) -> None:
        """Polls until ``ready(self.url)``; any HTTP error counts as not ready yet."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if ready(self.url):
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def cpu_seconds(self) -> float:
        """utime + stime of the process, from /proc/PID/stat (fields 14 and 15)."""
        stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "; fields[0] is field 3
        return (int(fields[11]) + int(fields[12])) / CLK_TCK

    def kill(self) -> None:
        """SIGKILL to the whole process group (children included), even if the leader is gone."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


def kvroute_command(subcommand: str, port: int, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "launcher.cli", subcommand,
        "--host", "127.0.0.1", "--port", str(port), *args, "--log-level", "warning",
    ]  # fmt: skip


def health_ok(url: str) -> bool:
    return httpx.get(f"{url}/health", timeout=1).status_code == 200


def gateway_sees_replica(url: str) -> bool:
    """Its /health counts at least one replica; should /health itself fail, a model in /v1/models."""
    response = httpx.get(f"{url}/health", timeout=1)
    if response.status_code == 200:
        return response.json()["replicas"] >= 1
    return bool(httpx.get(f"{url}/v1/models", timeout=1).json()["data"])
