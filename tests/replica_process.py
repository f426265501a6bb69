"""Real ``kvroute`` services (a replica, a gateway) in subprocesses, for tests that talk HTTP."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvroute.local_redis import free_port


class KvrouteProcess:
    """Starts ``kvroute SUBCOMMAND ...`` on a free port and waits until /health answers."""

    def __init__(self, subcommand: str, log_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            sys.executable, "-m", "kvroute.cli", subcommand,
            "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning", *args,
        ]  # fmt: skip
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy()
        except BaseException:
            self.kill()
            raise

    def _wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"process exited with {self.process.returncode}:\n{self.log_path.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        pytest.fail(f"process not healthy after {timeout} s:\n{self.log_path.read_text()}")

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM (graceful: drains, deregisters), then SIGKILL if it hangs; returns the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


class ReplicaProcess(KvrouteProcess):
    """``kvroute replica --model DIR ...``."""

    def __init__(self, model_dir: Path, log_path: Path, *args: str) -> None:
        super().__init__("replica", log_path, "--model", str(model_dir), *args)
