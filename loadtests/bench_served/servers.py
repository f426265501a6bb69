"""Starting the servers the served benchmark compares, each alone on the machine while measured."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from launcher.local_redis import free_port
from loadtests.bench_served.settings import Settings, progress
from loadtests.services import Service, gateway_sees_replica, health_ok, kvroute_command

VLLM_START_TIMEOUT = 600.0  # its torch.compile warm-up takes 1-2 minutes on 2 cores
VLLM_KV_CACHE_GIB = "4"
VLLM_MAX_MODEL_LEN = "4096"


def replica_command(s: Settings, port: int, name: str) -> list[str]:
    return kvroute_command(
        "replica", port, "--model", s.model, "--served-model-name", name,
        "--dtype", s.dtype, "--threads", str(s.threads),
    )  # fmt: skip


def vllm_service(s: Settings, workdir: Path, name: str) -> Service:
    """vLLM's CPU build as FACTS and its docs start it: prefix caching and cached-token counts on,
    its OpenMP threads bound to the same cores the replica uses."""
    assert s.vllm is not None
    port = free_port()
    command = [
        str(Path(s.vllm) / "bin" / "vllm"), "serve", s.model, "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", name, "--dtype", s.dtype, "--max-model-len", VLLM_MAX_MODEL_LEN,
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
    ]  # fmt: skip
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": VLLM_KV_CACHE_GIB,
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{s.threads - 1}",
    }
    return Service("vllm", command, port, workdir / "vllm.log", env=env)


@contextmanager
def running(server: str, s: Settings, workdir: Path, name: str) -> Iterator[str]:
    """The base URL of ``server`` (see ``SERVERS``), stopped on exit."""
    services: list[Service] = []
    try:
        if server == "vllm":
            services.append(vllm_service(s, workdir, name))
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
