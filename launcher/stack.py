"""``kvroute up``: a private Redis, N replicas and the gateway on one machine, as one command.

Each component is a child process whose output is printed with a ``[name]`` prefix. The stack is
ready when every replica answers /health and the gateway's index sees all of them; then the base
URL, the replicas, the policy and two snippets are printed. Ctrl-C, SIGTERM or SIGHUP (the
terminal closed) stops the gateway, then the replicas, then Redis (whose data of a private
instance lived only in memory and its temporary directory); children die with the supervisor
even when it is killed outright (``launcher.children``). If any component dies, the stack reports
it and stops the rest: a half-working stack behind a healthy looking URL would only hide the
failure.
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
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TextIO

import httpx

from gateway.settings import POLICIES
from kvroute.settings import option
from launcher.children import spawn
from launcher.local_redis import RedisServer, free_port
from replica.engine.config import MODEL_HELP

READY_TIMEOUT_S = 600  # a cold CPU start loads the model and warms up; the gateway only needs seconds
PROGRESS_EVERY_S = 5.0  # while replicas load, say so this often
STOP_TIMEOUT_S = 30.0  # per stage of the stop; then the stage's children are killed


class StackError(RuntimeError):
    """The stack could not start (busy port, a component that died or never became healthy)."""


@dataclass
class StackSettings:
    """What ``kvroute up`` starts: the fields with a flag are its options (``kvroute.settings``)."""

    # (option() returns a dataclasses.field, which RUF009 cannot see: the noqa below)
    replicas: int = option(2, "--replicas", "replicas to start")
    model: Path | None = option(None, "--model", MODEL_HELP)
    host: str = option("127.0.0.1", "--host", "where the gateway listens")
    port: int = option(8000, "--port", "the gateway's port")
    redis_url: str | None = option(  # None: a private redis-server on a free loopback port
        None, "--redis", "use this Redis instead of starting a private one (default: a private one)"
    )
    policy: str = option("kv", "--policy", "the gateway's routing policy", choices=POLICIES)
    # Keys reach the gateway through its environment (KVROUTE_API_KEYS, KVROUTE_ADMIN_KEY), not its
    # command line, which every local user can read; None keeps what the environment already says.
    api_keys: tuple[str, ...] | None = option(
        None,
        "--api-key",
        "Bearer key clients must send on /v1 (repeatable; default: env KVROUTE_API_KEYS; none: open)",
        metavar="KEY",
    )
    admin_key: str | None = option(
        None,
        "--admin-key",
        "Bearer key for /admin (default: env KVROUTE_ADMIN_KEY; none: off)",
        metavar="KEY",
    )
    replica_args: list[str] = option(
        [],
        "--replica-arg",
        "pass ARG to every `kvroute replica` (repeatable; e.g. --replica-arg=--max-num-seqs=32)",
        metavar="ARG",
    )
    gateway_args: list[str] = option(
        [],
        "--gateway-arg",
        "pass ARG to `kvroute gateway` (repeatable; e.g. --gateway-arg=--lam=2)",
        metavar="ARG",
    )
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
        _say(f"[stack] loading the model in {self.settings.replicas} replica(s): {model}\n")
        started = time.monotonic()
        for child in self.children:
            self._wait_healthy(child, lambda response: response.status_code == 200, started)
            _say(f"[stack] {child.name} ready at {child.url} ({time.monotonic() - started:.0f} s)\n")
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
        _say(f"[stack] private redis-server at {self.redis.url}\n")
        return self.redis.url

    def _spawn(self, name: str, args: list[str], url: str) -> None:
        log_dir = self.settings.log_dir
        with open(log_dir / f"{name}.log", "wb") if log_dir else contextlib.nullcontext() as log:
            process = spawn(
                [sys.executable, "-m", "launcher.cli", *args],
                stdout=log or subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=self._environment(),
            )
        self.children.append(_Child(name, process, url))
        if log_dir is None:
            threading.Thread(target=_prefix_output, args=(name, process), daemon=True).start()

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.settings.api_keys is not None:
            env["KVROUTE_API_KEYS"] = ",".join(self.settings.api_keys)
        if self.settings.admin_key is not None:
            env["KVROUTE_ADMIN_KEY"] = self.settings.admin_key
        return env

    def _wait_healthy(
        self, child: _Child, ready: Callable[[httpx.Response], bool], since: float | None = None
    ) -> None:
        """Polls the child's /health; with ``since``, says every few seconds that it is still waiting."""
        now = time.monotonic()
        deadline, next_word = now + READY_TIMEOUT_S, now + PROGRESS_EVERY_S
        while time.monotonic() < deadline and not self._stopping.is_set():
            self.check_alive()
            try:
                if ready(httpx.get(f"{child.url}/health", timeout=2)):
                    return
            except httpx.TransportError:
                pass
            if since is not None and time.monotonic() >= next_word:
                next_word += PROGRESS_EVERY_S
                _say(f"[stack] waiting for {child.name} ({time.monotonic() - since:.0f} s)\n")
            time.sleep(0.2)
        raise StackError(f"{child.name} did not become healthy")

    def check_alive(self) -> None:
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                where = f" (log: {self.settings.log_dir / child.name}.log)" if self.settings.log_dir else ""
                raise StackError(f"{child.name} exited with code {code}{where}")

    def stop(self) -> None:
        """Gateway first (no new work), then the replicas (they deregister from Redis), then Redis."""
        self._stopping.set()
        gateways = [child for child in self.children if child.name == "gateway"]
        _terminate([child.process for child in gateways])
        _terminate([child.process for child in self.children if child not in gateways])
        if self.redis is not None:
            self.redis.stop()
        if self._workdir is not None:
            self._workdir.cleanup()


def _terminate(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to all, then wait for each; those still running after ``STOP_TIMEOUT_S`` are killed."""
    for process in processes:
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _prefix_output(name: str, process: subprocess.Popen[bytes]) -> None:
    """Copies a child's output with its name in front. Once the terminal is gone (closed: writes
    fail) the output is still read and dropped, so a child never blocks on a full pipe."""
    assert process.stdout is not None
    for line in process.stdout:
        _say(f"[{name}] {line.decode(errors='replace')}")


def _say(text: str, stream: TextIO | None = None) -> None:
    """Writes to the terminal if it is still there (after SIGHUP it may not be)."""
    stream = stream or sys.stdout
    with contextlib.suppress(OSError, ValueError):
        stream.write(text)
        stream.flush()


def _require_free_port(host: str, port: int) -> None:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            raise StackError(
                f"port {port} on {host} is busy ({error.strerror}); choose another with --port"
            ) from None


def _banner(stack: LocalStack, model: str) -> str:
    """What the first screen says: where to send requests, what runs behind it, how to try it."""
    settings, base_url = stack.settings, stack.base_url
    keys = settings.api_keys if settings.api_keys is not None else _env_keys("KVROUTE_API_KEYS")
    admin_key = settings.admin_key if settings.admin_key is not None else os.environ.get("KVROUTE_ADMIN_KEY")
    key = "YOUR_API_KEY" if keys else "unused"
    auth = f" -H 'Authorization: Bearer {key}'" if keys else ""
    replicas = "\n".join(f"    {url}" for url in stack.replica_urls)
    admin = (
        f"on: {base_url.removesuffix('/v1')}/admin/replicas with the admin key"
        if admin_key
        else "off (turn it on with kvroute up --admin-key KEY, or KVROUTE_ADMIN_KEY)"
    )
    return f"""
kvroute is up: OpenAI base URL {base_url} (model "{model}")
  policy {settings.policy}; {len(stack.replica_urls)} replica(s):
{replicas}
  API keys: {"required" if keys else "none (open)"}; admin API: {admin}

  curl -s {base_url}/chat/completions -H 'Content-Type: application/json'{auth} \\
    -d '{{"model": "{model}", "max_tokens": 64, "temperature": 0,
         "messages": [{{"role": "user", "content": "What is the capital of France?"}}]}}'

  from openai import OpenAI
  client = OpenAI(base_url="{base_url}", api_key="{key}")
  reply = client.chat.completions.create(model="{model}", max_tokens=64, temperature=0,
      messages=[{{"role": "user", "content": "What is the capital of France?"}}])
  print(reply.choices[0].message.content)

Ctrl-C stops everything.
"""


def _env_keys(name: str) -> tuple[str, ...]:
    return tuple(key for key in os.environ.get(name, "").split(",") if key)


def run_stack(settings: StackSettings) -> None:
    """Starts the stack, prints how to use it, and serves until a signal or a component dies."""
    model = settings.model
    if model is None:
        from replica.tools.prepare_model import default_model_dir

        # In a child process: converting loads transformers, which this supervisor need not keep.
        # Its progress goes to stderr; stdout would only repeat the path the next line prints.
        subprocess.run(
            [sys.executable, "-m", "launcher.cli", "prepare-model"], check=True, stdout=subprocess.DEVNULL
        )
        model = default_model_dir()
    stack = LocalStack(settings)
    stop_requested = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_requested.set()
        stack._stopping.set()

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: the terminal closed
        signal.signal(signum, on_signal)
    try:
        stack.start(model)
        if not stop_requested.is_set():
            _say(_banner(stack, model.name))
        while not stop_requested.wait(0.5):
            stack.check_alive()
    except StackError as error:
        _say(f"[stack] {error}; stopping\n", sys.stderr)
        stack.stop()
        sys.exit(1)
    stack.stop()
    _say("[stack] stopped\n")
