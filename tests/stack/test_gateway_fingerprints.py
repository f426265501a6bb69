"""Replicas that serve one model name with different tokenizers: the minority gets no cache credit,
and a metric counts every decision that had to score one that way."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.helpers.metrics import samples, scrape
from tests.helpers.processes import REPLICA_DEFAULTS, ReplicaProcess, running_stack
from tests.helpers.waiting import wait_until


def test_a_replica_with_another_tokenizer_is_counted(
    llama_dir: Path, qwen3_dir: Path, tmp_path: Path
) -> None:
    shared = ("--served-model-name", "shared", "--kv-cache-tokens", "4096")
    with (
        running_stack(llama_dir, tmp_path, 1, replica_args=shared) as stack,
        ReplicaProcess(
            qwen3_dir, tmp_path / "qwen3.log", *REPLICA_DEFAULTS, *shared, "--redis", stack.redis.url
        ),
    ):
        gateway = stack.gateway
        wait_until(
            lambda: httpx.get(f"{gateway.url}/health", timeout=5).json()["replicas"] >= 2,
            "the gateway to see both replicas",
            timeout=20,
        )
        body = {"model": "shared", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for _ in range(3):
            assert httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        counted = samples(scrape(gateway.url), "kvroute_gateway_fingerprint_mismatches_total")
        assert len(counted) == 1 and counted[0].value == 3.0, counted
