"""Starting the servers the served benchmark compares, all at once: each idles while another is
measured, so the cases can take turns and the host's drift over the minutes of a run falls on
every server alike."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvroute.settings import to_argv
from launcher.local_redis import free_port
from loadtests.bench_served.settings import ENGINE_OPTIONS, Settings, progress
from loadtests.services import Service, gateway_sees_replica, health_ok, kvroute_command
from loadtests.vllm_server import VLLM_START_TIMEOUT, vllm_service
from replica.engine.config import EngineConfig


def replica_command(s: Settings, port: int, name: str) -> list[str]:
    """``kvroute replica`` on the settings the in-process engine also takes (``Settings.engine_config``)."""
    return kvroute_command(
        "replica", port, "--model", s.model, "--served-model-name", name,
        "--dtype", s.dtype, "--threads", str(s.threads),
        *to_argv(EngineConfig, argparse.Namespace(**s.engine_options()), ENGINE_OPTIONS),
    )  # fmt: skip


@dataclass(frozen=True)
class Server:
    name: str  # kvroute (the replica direct), gateway (one in front of it) or vllm
    url: str
    cache_url: str  # the server whose prefix cache it answers from (the gateway's: its replica)


@contextmanager
def running(s: Settings, workdir: Path, name: str) -> Iterator[list[Server]]:
    """The servers, all stopped on exit. The gateway stands in front of the replica that is also
    measured directly, so the two differ by the gateway alone."""
    services: list[Service] = []
    try:
        port = free_port()
        replica = Service("replica", replica_command(s, port, name), port, workdir / "replica.log")
        services.append(replica)
        replica.wait(health_ok)
        port = free_port()
        command = kvroute_command("gateway", port, "--replica", replica.url)
        gateway = Service("gateway", command, port, workdir / "gateway.log")
        services.append(gateway)
        gateway.wait(gateway_sees_replica)
        servers = [Server("kvroute", replica.url, replica.url), Server("gateway", gateway.url, replica.url)]
        if s.vllm is not None:
            vllm = vllm_service(
                s.vllm, s.model, free_port(), workdir / "vllm.log",
                name=name, dtype=s.dtype, cores=f"0-{s.threads - 1}",
            )  # fmt: skip
            services.append(vllm)
            progress("starting vLLM (its warm-up takes a minute or two)")
            vllm.wait(health_ok, timeout=VLLM_START_TIMEOUT)
            servers.append(Server("vllm", vllm.url, vllm.url))
        yield servers
    finally:
        for service in reversed(services):
            service.kill()


def empty_prefix_cache(url: str) -> None:
    """``/reset_prefix_cache`` (the replica's, and vLLM's in its dev mode): every case starts cold
    on every server, whatever an earlier case or server left cached."""
    httpx.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()


QUIET_BUSY = 0.1  # of all cores: what counts as idle
QUIET_WINDOW_S = 0.1


def wait_for_quiet_cores(timeout: float = 10.0) -> float:
    """Waits until the cores are idle for a window; returns the seconds waited. A server's OpenMP
    threads go on spinning for a while after its last request (vLLM's for a good part of a
    second), and the next turn must not start on cores still taken by the last one."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        before = _cpu_ticks()
        time.sleep(QUIET_WINDOW_S)
        after = _cpu_ticks()
        busy, total = after[0] - before[0], after[1] - before[1]
        if total and busy / total < QUIET_BUSY:
            break
    return time.monotonic() - started


def _cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of all cores, from /proc/stat's first line."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)
