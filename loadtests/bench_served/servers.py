"""Starting the servers the served benchmark compares, each alone on the machine while measured."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from launcher.local_redis import free_port
from loadtests.bench_served.settings import Settings, progress
from loadtests.services import Service, gateway_sees_replica, health_ok, kvroute_command
from loadtests.vllm_server import VLLM_START_TIMEOUT, vllm_service


def replica_command(s: Settings, port: int, name: str) -> list[str]:
    return kvroute_command(
        "replica", port, "--model", s.model, "--served-model-name", name,
        "--dtype", s.dtype, "--threads", str(s.threads),
    )  # fmt: skip


@contextmanager
def running(server: str, s: Settings, workdir: Path, name: str) -> Iterator[str]:
    """The base URL of ``server`` (see ``SERVERS``), stopped on exit."""
    services: list[Service] = []
    try:
        if server == "vllm":
            assert s.vllm is not None
            vllm = vllm_service(
                s.vllm, s.model, free_port(), workdir / "vllm.log",
                name=name, dtype=s.dtype, cores=f"0-{s.threads - 1}",
            )  # fmt: skip
            services.append(vllm)
            progress("starting vLLM (its warm-up takes a minute or two)")
            services[-1].wait(health_ok, timeout=VLLM_START_TIMEOUT)
        else:
            port = free_port()
            services.append(Service("replica", replica_command(s, port, name), port, workdir / "replica.log"))
            services[-1].wait(health_ok)
            if server == "gateway":
                port = free_port()
                command = kvroute_command("gateway", port, "--replica", services[0].url)
                services.append(Service("gateway", command, port, workdir / "gateway.log"))
                services[-1].wait(gateway_sees_replica)
        yield services[-1].url
    finally:
        for service in reversed(services):
            service.kill()
