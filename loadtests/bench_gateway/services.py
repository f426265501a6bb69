"""The processes the gateway benchmark measures: a replica, a gateway and, when installed,
sglang-router, each on a free loopback port."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from launcher.local_redis import free_port
from loadtests.services import Service, gateway_sees_replica, health_ok, kvroute_command


def start_services(
    model_dir: Path, engine: str, redis_url: str, workdir: Path, services: dict[str, Service]
) -> None:
    """Fills ``services`` as it goes, so the caller's ``finally`` kills whatever did start."""
    port = free_port()
    backend = ["--engine", "sim", "--profile", "instant"] if engine == "sim" else ["--dtype", "float32"]
    services["direct"] = Service(
        "replica",
        kvroute_command(
            "replica",
            port,
            "--model",
            str(model_dir),
            *backend,
            "--kv-cache-tokens",
            "65536",
            "--redis",
            redis_url,
        ),
        port,
        workdir / "replica.log",
    )
    services["direct"].wait(health_ok)
    port = free_port()
    services["gateway"] = Service(
        "gateway", kvroute_command("gateway", port, "--redis", redis_url), port, workdir / "gateway.log"
    )
    services["gateway"].wait(gateway_sees_replica)
    if importlib.util.find_spec("sglang_router") is not None:
        port, metrics_port = free_port(), free_port()
        command = [
            sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", services["direct"].url, "--policy", "round_robin",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--tokenizer-path", str(model_dir),
        ]  # fmt: skip
        services["sglang_router"] = Service("sglang_router", command, port, workdir / "sglang_router.log")
        services["sglang_router"].wait(health_ok)
