"""``kvroute up``: a private Redis, N replicas and the gateway on one machine, as one command.

Each component is a child process whose output is printed with a ``[name]`` prefix. The stack is
ready when every replica answers /health and the gateway's index sees all of them; then the base
URL and two snippets are printed. Ctrl-C or SIGTERM stops the gateway, the replicas, then Redis
(whose data of a private instance lived only in memory and its temporary directory). If any
component dies, the stack reports it and stops the rest: a half-working stack behind a healthy
looking URL would only hide the failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

import httpx

from kvroute.local_redis import RedisServer, free_port

READY_TIMEOUT_S = 600  # a cold CPU start loads the model and warms up; the gateway only needs seconds


class StackError(RuntimeError):
    """The stack could not start (busy port, a component that died or never became healthy)."""


@dataclass
class StackSettings:
    replicas: int = 2
    model: Path | None = None  # None: the prepared default model
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str | None = None  # None: a private redis-server on a free loopback port
    policy: str = "kv"
    replica_args: list[str] = field(default_factory=list)  # extra `kvroute replica` flags
    gateway_args: list[str] = field(default_factory=list)  # extra `kvroute gateway` flags
    log_dir: Path | None = None  # each component's output to NAME.log there instead of stdout


@dataclass
class _Child:
    name: str
    process: subprocess.Popen[bytes]
    url: str | None = None


class LocalStack:
    def __init__(self, settings: StackSettings) -> None:
        self.settings = settings
        self.children: list[_Child] = []
        self.redis: RedisServer | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._stopping = threading.Event()

    @property
    def base_url(self) -> str:
        return f"http://{self.settings.host}:{self.settings.port}/v1"

    @property
    def replica_urls(self) -> list[str]:
        return [child.url for child in self.children if child.name.startswith("replica-") and child.url]

    def start(self, model: Path) -> None:
        _require_free_port(self.settings.host, self.settings.port)
        redis_url = self.settings.redis_url or self._start_redis()
        threads = max(1, (os.cpu_count() or 1) // self.settings.replicas)
        for index in range(self.settings.replicas):
            port = free_port()
            self._spawn(
                f"replica-{index}",
                ["replica", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
                 "--redis", redis_url, "--threads", str(threads), *self.settings.replica_args],
                f"http://127.0.0.1:{port}",
            )  # fmt: skip
        for child in self.children:
            self._wait_healthy(child, lambda response: response.status_code == 200)
        self._spawn(
            "gateway",
            ["gateway", "--host", self.settings.host, "--port", str(self.settings.port), "--redis", redis_url,
             "--policy", self.settings.policy, *self.settings.gateway_args],
            f"http://{self.settings.host}:{self.settings.port}",
        )  # fmt: skip
        wanted = self.settings.replicas
        self._wait_healthy(
            self.children[-1], lambda r: r.status_code == 200 and r.json()["replicas"] >= wanted
        )

    def _start_redis(self) -> str:
        self._workdir = tempfile.TemporaryDirectory(prefix="kvroute-redis-")
        self.redis = RedisServer(Path(self._workdir.name))
        self.redis.start()
        print(f"[stack] private redis-server at {self.redis.url}", flush=True)
        return self.redis.url

    def _spawn(self, name: str, args: list[str], url: str) -> None:
        log_dir = self.settings.log_dir
        with open(log_dir / f"{name}.log", "wb") if log_dir else contextlib.nullcontext() as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "kvroute.cli", *args],
                stdout=log or subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # our signals reach children only through stop()
            )
        self.children.append(_Child(name, process, url))
        if log_dir is None:
            threading.Thread(target=_prefix_output, args=(name, process), daemon=True).start()

    def _wait_healthy(self, child: _Child, ready: Callable[[httpx.Response], bool]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not self._stopping.is_set():
            self.check_alive()
            try:
                if ready(httpx.get(f"{child.url}/health", timeout=2)):
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise StackError(f"{child.name} did not become healthy")

    def check_alive(self) -> None:
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                where = f" (log: {self.settings.log_dir / child.name}.log)" if self.settings.log_dir else ""
                raise StackError(f"{child.name} exited with code {code}{where}")

    def stop(self) -> None:
        """Gateway first (no new work), then replicas (they deregister), then Redis."""
        self._stopping.set()
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.terminate()
        for child in reversed(self.children):
            try:
                child.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        if self.redis is not None:
            self.redis.stop()
        if self._workdir is not None:
            self._workdir.cleanup()


def _prefix_output(name: str, process: subprocess.Popen[bytes]) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        sys.stdout.write(f"[{name}] {line.decode(errors='replace')}")
        sys.stdout.flush()


def _require_free_port(host: str, port: int) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            raise StackError(
                f"port {port} on {host} is busy ({error.strerror}); choose another with --port"
            ) from None


def _snippets(base_url: str, model: str) -> str:
    return f"""
kvroute is up: OpenAI base URL {base_url} (model "{model}")

  curl -s {base_url}/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "max_tokens": 64,
         "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  from openai import OpenAI
  client = OpenAI(base_url="{base_url}", api_key="unused")
  reply = client.chat.completions.create(model="{model}", max_tokens=64,
      messages=[{{"role": "user", "content": "What is the capital of France?"}}])
  print(reply.choices[0].message.content)

Ctrl-C stops everything.
"""


def run_stack(settings: StackSettings) -> None:
    """Starts the stack, prints how to use it, and serves until a signal or a component dies."""
    model = settings.model
    if model is None:
        from replica.prepare_model import default_model_dir

        # In a child process: converting loads transformers, which this supervisor need not keep.
        subprocess.run([sys.executable, "-m", "kvroute.cli", "prepare-model"], check=True)
        model = default_model_dir()
    stack = LocalStack(settings)
    stop_requested = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_requested.set()
        stack._stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack.start(model)
        if not stop_requested.is_set():
            print(_snippets(stack.base_url, model.name), flush=True)
        while not stop_requested.wait(0.5):
            stack.check_alive()
    except StackError as error:
        print(f"[stack] {error}; stopping", file=sys.stderr, flush=True)
        stack.stop()
        sys.exit(1)
    stack.stop()
    print("[stack] stopped", flush=True)
