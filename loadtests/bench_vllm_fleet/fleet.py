"""Two vLLM servers with their bridges and a private Redis, and a gateway per policy in front.

Each server gets one core of its own (its OpenMP threads bound to it) so the two do not fight
over the same cores; the bridges and the gateway are light. Between policies both servers' prefix
caches are emptied (vLLM's ``/reset_prefix_cache``, whose AllBlocksCleared the bridges publish),
so each policy starts cold.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from kvroute.protocol import Keys
from launcher.local_redis import RedisServer, free_port
from loadtests.bench_vllm_fleet.settings import VLLM_BLOCK_SIZE, Settings, progress
from loadtests.services import Service, gateway_sees_replica, health_ok, kvroute_command
from loadtests.vllm_server import VLLM_START_TIMEOUT, kv_events_config, vllm_service

SERVERS = 2


class VllmFleet:
    """Started by :func:`running_fleet`; ``servers`` are the vLLM services, ``bridges`` theirs."""

    def __init__(
        self, model: str, redis: RedisServer, servers: list[Service], bridges: list[Service], workdir: Path
    ) -> None:
        self.model = model  # the served name
        self.redis = redis
        self.servers = servers
        self.bridges = bridges
        self.workdir = workdir

    @property
    def replica_ids(self) -> list[str]:
        return [f"127.0.0.1:{server.port}" for server in self.servers]

    def indexed_blocks(self) -> int:
        client = self.redis.client()
        return sum(client.scard(Keys("kvroute").blocks(rid)) for rid in self.replica_ids)

    def reset_cache(self, index: int) -> None:
        """Empties one server's prefix cache. vLLM publishes events only after a scheduler step, so
        an idle server's AllBlocksCleared waits for its next request: one is sent, too short to
        fill a block, so that it leaves nothing cached."""
        url = self.servers[index].url
        httpx.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()
        poke = {"model": self.model, "prompt": "Hi", "max_tokens": 1}
        httpx.post(f"{url}/v1/completions", json=poke, timeout=60).raise_for_status()

    def reset_caches(self) -> None:
        """Both servers' prefix caches emptied, and the index with them."""
        for index in range(len(self.servers)):
            self.reset_cache(index)
        deadline = time.monotonic() + 10
        while self.indexed_blocks() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self.indexed_blocks():
            raise RuntimeError("the index still holds blocks after both caches were reset")

    @contextmanager
    def gateway(self, policy: str) -> Iterator[str]:
        port = free_port()
        command = kvroute_command("gateway", port, "--redis", self.redis.url, "--policy", policy)
        gateway = Service("gateway", command, port, self.workdir / f"gateway-{policy}.log")
        try:
            gateway.wait(lambda url: gateway_sees_replica(url) and _replicas(url) == SERVERS)
            yield gateway.url
        finally:
            gateway.kill()


def _replicas(url: str) -> int:
    return int(httpx.get(f"{url}/health", timeout=1).json()["replicas"])


@contextmanager
def running_fleet(s: Settings, workdir: Path, name: str) -> Iterator[VllmFleet]:
    with ExitStack() as stack:
        redis = RedisServer(workdir)
        redis.start()
        stack.callback(redis.stop)
        cores = [str(i % (os.cpu_count() or 1)) for i in range(SERVERS)]
        servers, bridges = [], []
        progress(f"starting {SERVERS} vLLM servers, one after the other (each warm-up takes minutes)")
        for index, core in enumerate(cores):
            events, replay = free_port(), free_port()
            server = vllm_service(
                s.vllm, s.model, free_port(), workdir / f"vllm-{index}.log", name=name, dtype=s.dtype,
                cores=core, kv_cache_gib=1, max_model_len=(s.kv_blocks - 1) * VLLM_BLOCK_SIZE,
                extra=(
                    "--num-gpu-blocks-override", str(s.kv_blocks),
                    "--kv-events-config", kv_events_config(events, replay),
                ),
            )  # fmt: skip
            stack.callback(server.kill)
            # one at a time: two compiling at once share torch.compile's cache directory. vLLM wants
            # a block beyond its longest request in the pool: the window is one block short of it.
            server.wait(health_ok, timeout=VLLM_START_TIMEOUT)
            servers.append((server, events, replay))
        for index, (server, events, replay) in enumerate(servers):
            port = free_port()
            command = kvroute_command(
                "bridge", port, "--engine-url", server.url, "--events", f"tcp://127.0.0.1:{events}",
                "--replay", f"tcp://127.0.0.1:{replay}", "--model", s.model, "--redis", redis.url,
            )  # fmt: skip
            bridge = Service("bridge", command, port, workdir / f"bridge-{index}.log")
            stack.callback(bridge.kill)
            bridge.wait(health_ok)
            bridges.append(bridge)
        yield VllmFleet(name, redis, [server for server, _, _ in servers], bridges, workdir)
