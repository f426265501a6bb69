"""Real ``kvroute`` services (a replica, a gateway) in subprocesses, for tests that talk HTTP."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from launcher.local_redis import RedisServer, free_port


class KvrouteProcess:
    """Starts ``kvroute SUBCOMMAND ...`` on a free port and waits until /health answers."""

    def __init__(self, subcommand: str, log_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [
            sys.executable, "-m", "launcher.cli", subcommand,
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

    def __enter__(self) -> KvrouteProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.terminate()

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


@dataclass
class StackProcesses:
    """Redis, replicas and a gateway, each a real process (what several test files need)."""

    model: str
    redis: RedisServer
    gateway: KvrouteProcess
    replicas: list[ReplicaProcess]
    workdir: Path

    def replica(self, replica_id: str) -> ReplicaProcess:
        return next(r for r in self.replicas if f"127.0.0.1:{r.port}" == replica_id)


def start_replicas(
    model_dir: Path, workdir: Path, redis_url: str, count: int, *args: str
) -> list[ReplicaProcess]:
    """Starts ``count`` replicas side by side (model loading overlaps), each publishing to Redis."""
    with ThreadPoolExecutor(count) as pool:
        futures = [
            pool.submit(
                ReplicaProcess,
                model_dir,
                workdir / f"replica{i}.log",
                "--dtype",
                "float32",
                "--kv-cache-tokens",
                "8192",
                "--redis",
                redis_url,
                "--heartbeat-interval",
                "0.2",
                *args,
            )
            for i in range(count)
        ]
    replicas = [f.result() for f in futures if f.exception() is None]
    failures = [f.exception() for f in futures if f.exception() is not None]
    if failures:
        for replica in replicas:
            replica.kill()
        raise failures[0]  # type: ignore[misc]
    return replicas


@contextmanager
def running_stack(
    model_dir: Path, workdir: Path, replicas: int, replica_args: tuple[str, ...] = (), *gateway_args: str
) -> Iterator[StackProcesses]:
    """A private Redis, ``replicas`` replicas and a gateway that sees them all; torn down after."""
    redis = RedisServer(workdir)
    redis.start()
    started: list[ReplicaProcess] = []
    gateway = None
    try:
        started = start_replicas(model_dir, workdir, redis.url, replicas, *replica_args)
        gateway = KvrouteProcess("gateway", workdir / "gateway.log", "--redis", redis.url, *gateway_args)
        deadline = time.monotonic() + 20
        while httpx.get(f"{gateway.url}/health", timeout=5).json()["replicas"] < replicas:
            assert time.monotonic() < deadline, "the gateway never saw every replica"
            time.sleep(0.1)
        yield StackProcesses(model_dir.name, redis, gateway, started, workdir)
    finally:
        if gateway is not None:
            gateway.terminate()
        for replica in started:
            replica.kill()
        redis.stop()
