"""The gateway benchmark's options and run: a private Redis, the replica, the gateway (and
sglang-router), both modes measured through them, then the tokenizer and the upstream clients alone."""

from __future__ import annotations

import argparse
import platform
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from launcher.local_redis import RedisServer
from loadtests.bench_gateway.clients import measure_upstream_clients
from loadtests.bench_gateway.load import measure_mode
from loadtests.bench_gateway.services import start_services
from loadtests.bench_gateway.settings import (
    BENCH,
    CHAT_CHARS,
    CONCURRENCY,
    FULL,
    MODES,
    QUICK,
    REPLICA_ENGINES,
    TOKENIZE_TURNS,
    Settings,
    progress,
)
from loadtests.bench_gateway.tables import checks, preamble, tables
from loadtests.bench_gateway.tokenization import measure_tokenization
from loadtests.harness import ComponentBenchmark, Measurement, package_version
from loadtests.options import Sizes
from loadtests.services import Service


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replica-engine",
        choices=sorted(REPLICA_ENGINES),
        default="sim",
        help="sim: the instant simulated replica (default); torch: the tiny test model on the real engine",
    )


def resolve_settings(args: argparse.Namespace, sizes: dict[str, Any]) -> Settings:
    if min(sizes.values()) < 1:
        raise SystemExit("every size must be positive")
    return Settings(out=args.out, replica_engine=args.replica_engine, **sizes)


def machine_details() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "httpx": package_version("httpx"),
        "uvicorn": package_version("uvicorn"),
        "uvloop": package_version("uvloop"),
        "httptools": package_version("httptools"),
        "sglang_router": package_version("sglang-router"),
    }


def measure_through_proxies(s: Settings, model_dir: Path, workdir: Path) -> tuple[dict[str, Any], bool]:
    """Both modes through the processes, which are killed afterwards; and whether sglang-router ran."""
    services: dict[str, Service] = {}
    redis = RedisServer(workdir)
    try:
        redis.start()
        progress("starting the replica and the gateway")
        start_services(model_dir, s.replica_engine, redis.url, workdir, services)
        results = {
            mode: measure_mode(s, services, model_dir.name, stream=mode == "streaming") for mode in MODES
        }
    finally:
        for service in reversed(services.values()):
            service.kill()
        redis.stop()
    return results, "sglang_router" in services


def measure(s: Settings) -> Measurement:
    from replica.tools.tiny_models import make_test_model

    with tempfile.TemporaryDirectory(prefix="bench_gateway.") as tmp:
        workdir = Path(tmp)
        model_dir = make_test_model("llama", workdir / "bench-llama")
        results, router = measure_through_proxies(s, model_dir, workdir)
        progress(f"tokenizing a {TOKENIZE_TURNS}-turn chat, {s.tokenize} requests per mode")
        tokenization = measure_tokenization(model_dir, s.tokenize)
    progress(f"upstream clients against an instant server, {s.client} requests per case")
    clients = measure_upstream_clients(s.client)
    report = {
        "settings": asdict(s) | {"concurrency": CONCURRENCY, "chat_chars": CHAT_CHARS},
        "sglang_router": router,
        "results": results,
        "tokenization": tokenization,
        "upstream_clients": clients,
        "checks": checks(results),
    }
    return Measurement(machine_details(), report)


DESCRIPTION = "Gateway overhead, direct vs through the gateway (needs redis-server)."
BENCHMARK = ComponentBenchmark(
    BENCH, DESCRIPTION, Sizes(FULL, QUICK), resolve_settings, measure, preamble, tables, add_options
)
main = BENCHMARK.main
