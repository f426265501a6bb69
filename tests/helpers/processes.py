"""Real ``kvroute`` services in subprocesses, for tests that talk HTTP: one replica or gateway at a
time (``KvrouteProcess``, ``ReplicaProcess``), or a whole stack started by the launcher's own code
(``running_stack``, on ``kvroute up``'s ``LocalStack``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import httpx
import pytest

from launcher.local_redis import RedisServer, free_port
from launcher.stack import LocalStack, StackError, StackSettings
from tests.helpers.waiting import wait_until

# What every replica of a test stack runs with: exact fp32 numbers, a small cache, fast heartbeats.
REPLICA_DEFAULTS = ("--dtype", "float32", "--kv-cache-tokens", "8192", "--heartbeat-interval", "0.2")


class Service:
    """A running ``kvroute`` process listening on 127.0.0.1:``port``, its output in ``log_path``."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, log_path: Path) -> None:
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path

    @property
    def replica_id(self) -> str:
        """What a gateway calls it (``x-kvroute-replica``, the admin API): ``host:port``."""
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else "(no log)"

    def __enter__(self) -> Self:
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


class KvrouteProcess(Service):
    """Starts ``kvroute SUBCOMMAND ...`` on a free port and waits until /health answers."""

    def __init__(self, subcommand: str, log_path: Path, *args: str) -> None:
        port = free_port()
        command = [
            sys.executable, "-m", "launcher.cli", subcommand,
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *args,
        ]  # fmt: skip
        with log_path.open("wb") as log:
            super().__init__(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), port, log_path)
        try:
            wait_until(
                self._healthy, f"{subcommand} to answer /health", timeout=120, interval=0.05, detail=self.log
            )
        except BaseException:
            self.kill()
            raise

    def _healthy(self) -> bool:
        if self.process.poll() is not None:
            pytest.fail(f"process exited with {self.process.returncode}:\n{self.log()}")
        try:
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False


class ReplicaProcess(KvrouteProcess):
    """``kvroute replica --model DIR ...``."""

    def __init__(self, model_dir: Path, log_path: Path, *args: str) -> None:
        super().__init__("replica", log_path, "--model", str(model_dir), *args)


@dataclass
class StackProcesses:
    """Redis, replicas and a gateway, each a real process (what several test files need)."""

    model: str
    redis: RedisServer
    gateway: Service
    replicas: list[Service]
    workdir: Path

    def replica(self, replica_id: str) -> Service:
        return next(r for r in self.replicas if r.replica_id == replica_id)


@contextmanager
def stopped(*pids: int) -> Iterator[None]:
    """The processes SIGSTOPped until the block ends: hung, their sockets open, nothing answering."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


@contextmanager
def running_stack(
    model_dir: Path,
    workdir: Path,
    replicas: int = 1,
    *,
    replica_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
) -> Iterator[StackProcesses]:
    """What ``kvroute up`` starts, started by its own code: a private Redis, ``replicas`` replicas
    on ``model_dir`` (``REPLICA_DEFAULTS``, then ``replica_args``) and a gateway that sees them all
    (``gateway_args``), each logging to ``workdir/NAME.log``; stopped in the launcher's order after."""
    port = free_port()
    settings = StackSettings(
        replicas=replicas,
        model=model_dir,
        port=port,
        replica_args=[*REPLICA_DEFAULTS, *replica_args],
        gateway_args=list(gateway_args),
        log_dir=workdir,
    )
    stack = LocalStack(settings)
    try:
        try:
            stack.start(model_dir)
        except StackError as error:
            logs = "\n".join(
                f"--- {log.name}\n{log.read_text(errors='replace')}" for log in workdir.glob("*.log")
            )
            pytest.fail(f"the stack did not start: {error}\n{logs}")
        assert stack.redis is not None
        services = [
            Service(child.process, int(child.url.rsplit(":", 1)[1]), workdir / f"{child.name}.log")
            for child in stack.children
            if child.url is not None
        ]
        *replica_services, gateway = services
        yield StackProcesses(model_dir.name, stack.redis, gateway, replica_services, workdir)
    finally:
        stack.stop()
