"""Replicas that serve one model name with different tokenizers: the minority gets no cache credit,
and a metric counts every decision that had to score one that way."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from launcher.local_redis import RedisServer
from tests.helpers.processes import KvrouteProcess, ReplicaProcess


def test_a_replica_with_another_tokenizer_is_counted(
    llama_dir: Path, qwen3_dir: Path, tmp_path: Path
) -> None:
    redis = RedisServer(tmp_path)
    redis.start()
    processes: list[KvrouteProcess] = []
    try:
        for name, model_dir in (("llama", llama_dir), ("qwen3", qwen3_dir)):
            processes.append(
                ReplicaProcess(
                    model_dir,
                    tmp_path / f"{name}.log",
                    "--served-model-name",
                    "shared",
                    "--dtype",
                    "float32",
                    "--kv-cache-tokens",
                    "4096",
                    "--redis",
                    redis.url,
                    "--heartbeat-interval",
                    "0.2",
                )
            )
        gateway = KvrouteProcess("gateway", tmp_path / "gateway.log", "--redis", redis.url)
        processes.append(gateway)
        deadline = time.monotonic() + 20
        while httpx.get(f"{gateway.url}/health", timeout=5).json()["replicas"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        body = {"model": "shared", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for _ in range(3):
            assert httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        counted = [
            line
            for line in httpx.get(f"{gateway.url}/metrics", timeout=5).text.splitlines()
            if line.startswith("kvroute_gateway_fingerprint_mismatches_total{")
        ]
        assert len(counted) == 1 and counted[0].endswith(" 3.0"), counted
    finally:
        for process in reversed(processes):
            process.terminate()
        redis.stop()
