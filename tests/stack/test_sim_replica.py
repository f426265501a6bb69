"""Real ``kvroute replica --engine sim`` processes over HTTP: prefill and decode times within
tolerance of their profile, cache hits that save the predicted time, exact output lengths,
deterministic text, the same Redis reporting as a torch replica, no torch in the process, and
``kvroute calibrate --quick``.

The test profile is slow on purpose (a millisecond per prompt token, tens of milliseconds per
step), so the simulated sleeps dominate HTTP and scheduling noise on a busy machine.
"""

from __future__ import annotations

import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from kvroute.protocol import EventKind, Keys, block_hashes, decode_event, model_seed
from kvroute.text.tokenizer import TextTokenizer
from launcher.cli import main
from launcher.local_redis import RedisServer
from replica.sim.runner import COEFFICIENTS, SimProfile, StepShape
from tests.helpers.processes import ReplicaProcess
from tests.helpers.waiting import wait_until

PROFILE = {
    "name": "slow-http-test",
    "prefill_base_s": 0.03,
    "prefill_token_s": 1e-3,
    "prefill_pair_s": 1e-6,
    "prefill_seq_s": 0.005,
    "decode_base_s": 0.02,
    "decode_seq_s": 0.004,
    "decode_context_s": 1e-5,
}
KV_TOKENS = 8192
BLOCK = 16


def token_prompt(length: int, start: int) -> list[int]:
    return [3 + (start + i * 11) % 450 for i in range(length)]


class SimStack:
    def __init__(self, replica: ReplicaProcess, redis_url: str, model_dir: Path) -> None:
        self.replica = replica
        self.url = replica.url
        self.redis = redis.Redis.from_url(redis_url)
        self.replica_id = f"127.0.0.1:{replica.port}"
        self.model = model_dir.name
        self.seed = model_seed(self.model, TextTokenizer.from_dir(model_dir).fingerprint)
        self.profile = SimProfile.from_dict(PROFILE)

    def complete(self, prompt: list[int], max_tokens: int, **extra: Any) -> tuple[dict[str, Any], float]:
        # A batch of one prompt: openai_protocol checks a bare id list against the 64-prompt limit.
        body = {"model": self.model, "prompt": [prompt], "max_tokens": max_tokens, "temperature": 0} | extra
        started = time.perf_counter()
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)
        elapsed = time.perf_counter() - started
        assert response.status_code == 200, response.text
        return response.json(), elapsed

    def stream_times(self, prompt: list[int], max_tokens: int, n: int) -> tuple[list[float], dict[str, Any]]:
        """Arrival times of choice 0's chunks, and the usage of the whole stream."""
        body = {
            "model": self.model,
            "prompt": [prompt],
            "max_tokens": max_tokens,
            "temperature": 0,
            "n": n,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        arrivals, usage = [], {}
        with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any(c["index"] == 0 and c["text"] for c in chunk["choices"]):
                    arrivals.append(time.perf_counter())
        return arrivals, usage


@pytest.fixture(scope="module")
def sim(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimStack]:
    workdir = tmp_path_factory.mktemp("sim-replica")
    profile = workdir / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    server = RedisServer(workdir)
    server.start()
    try:
        replica = ReplicaProcess(
            llama_dir,
            workdir / "replica.log",
            "--engine", "sim", "--profile", str(profile),
            "--kv-cache-tokens", str(KV_TOKENS), "--max-num-batched-tokens", "1024",
            "--redis", server.url, "--heartbeat-interval", "0.2",
        )  # fmt: skip
        with replica:
            stack = SimStack(replica, server.url, llama_dir)
            stack.complete(token_prompt(20, 999), 2)  # first-request costs out of the way
            yield stack
    finally:
        server.stop()


def test_prefill_time_and_the_time_a_cache_hit_saves(sim: SimStack) -> None:
    prompt = token_prompt(600, 0)
    cold, cold_s = sim.complete(prompt, 1)
    warm, warm_s = sim.complete(prompt, 1)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 592  # 37 whole pages
    predicted_cold = sim.profile.step_seconds(StepShape(600, 600 * 601 // 2, 1))  # 0.815 s
    predicted_warm = sim.profile.step_seconds(StepShape(8, 8 * 592 + 36, 1))  # 0.048 s
    assert predicted_cold <= cold_s <= predicted_cold + 0.25
    assert predicted_warm <= warm_s <= predicted_warm + 0.25
    saved = cold_s - warm_s
    assert saved == pytest.approx(predicted_cold - predicted_warm, abs=0.15)


def chat_events(sim: SimStack, content: str, **options: Any) -> list[tuple[float, dict[str, Any]]]:
    """Each chunk of a streamed chat with its arrival time (seconds after the request was sent)."""
    body = {"model": sim.model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    events = []
    started = time.perf_counter()
    with httpx.stream("POST", f"{sim.url}/v1/chat/completions", json=body | options, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append((time.perf_counter() - started, json.loads(line.removeprefix("data: "))))
    return events


def test_the_role_chunk_comes_with_the_first_token_not_before_the_prefill(sim: SimStack) -> None:
    """As OpenAI and vLLM send it: a client timing the first chunk with choices (vllm bench serve
    --backend openai-chat) measures the real time to first token."""
    events = chat_events(sim, "x " * 600 + "(role)", stream=True)  # ~0.6 s of simulated prefill
    (role_at, role), (text_at, text) = events[0], events[1]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert text["choices"][0]["delta"].get("content")
    assert role_at > 0.5, "the role chunk waited for the prefill"
    assert text_at - role_at < 0.05, "and the first token followed it at once"


def test_continuous_usage_stats_puts_usage_in_every_chunk(sim: SimStack) -> None:
    options = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = [chunk for _, chunk in chat_events(sim, "count with me", **options)]
    assert all(chunk["usage"] is not None for chunk in events)
    completed = [chunk["usage"]["completion_tokens"] for chunk in events]
    assert completed == sorted(completed) and completed[-1] == 4
    assert {chunk["usage"]["prompt_tokens"] for chunk in events} == {events[-1]["usage"]["prompt_tokens"]}
    plain = [
        chunk
        for _, chunk in chat_events(sim, "count with me", stream=True, stream_options={"include_usage": True})
    ]
    assert [chunk["usage"] is None for chunk in plain] == [True] * (len(plain) - 1) + [False]


def test_decode_step_times_by_batch_size(sim: SimStack) -> None:
    prompt = token_prompt(100, 7)
    for n in (1, 8):
        arrivals, usage = sim.stream_times(prompt, 25, n)
        assert usage["completion_tokens"] == 25 * n
        # Steady state: all n choices decode together; context = prompt + tokens so far, each.
        intervals = [b - a for a, b in itertools.pairwise(arrivals[8:])]
        context = n * (len(prompt) + 17)
        predicted = sim.profile.step_seconds(StepShape(decode_seqs=n, decode_context=context))
        assert len(intervals) >= 14
        measured = statistics.median(intervals)
        assert 0.9 * predicted <= measured <= 1.2 * predicted + 0.01, (n, measured, predicted)


def test_exact_lengths_and_deterministic_text(sim: SimStack) -> None:
    chat = {
        "model": sim.model,
        "messages": [{"role": "user", "content": "Tell me about routing."}],
        "max_tokens": 12,
        "temperature": 0.8,
    }
    replies = [httpx.post(f"{sim.url}/v1/chat/completions", json=chat, timeout=30).json() for _ in range(2)]
    for reply in replies:
        assert reply["usage"]["completion_tokens"] == 12
        assert reply["choices"][0]["finish_reason"] == "length"
        assert reply["choices"][0]["message"]["content"].strip()
    assert replies[0]["choices"][0]["message"]["content"] == replies[1]["choices"][0]["message"]["content"]
    assert replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    models = httpx.get(f"{sim.url}/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == [sim.model]
    assert "SIMULATED replica" in sim.replica.log_path.read_text()


def test_redis_sees_the_cache_as_from_a_torch_replica(sim: SimStack) -> None:
    prompt = token_prompt(200, 3)
    sim.complete(prompt, 1)
    expected = block_hashes(prompt, BLOCK, sim.seed)
    keys = Keys()

    def held() -> set[int]:
        return {int.from_bytes(m, "little") for m in sim.redis.smembers(keys.blocks(sim.replica_id))}

    wait_until(lambda: set(expected) <= held(), "the prompt's blocks in Redis", timeout=10)
    assert set(expected) <= held()
    events = [decode_event(fields) for _, fields in sim.redis.xrange(keys.events(sim.model))]
    ours = [e for e in events if e.replica_id == sim.replica_id]
    stored = {h for e in ours if e.kind is EventKind.STORED for h in e.hashes}
    assert set(expected) <= stored
    heartbeat = {k.decode(): v.decode() for k, v in sim.redis.hgetall(keys.heartbeat(sim.replica_id)).items()}
    assert heartbeat["kv_total_pages"] == str(KV_TOKENS // BLOCK)
    assert heartbeat["model"] == sim.model and heartbeat["block_size"] == str(BLOCK)


def test_the_process_is_small_and_has_no_torch(sim: SimStack) -> None:
    pid = sim.replica.process.pid
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "libtorch" not in maps, "a sim replica must not load torch"
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(next(line for line in status.splitlines() if line.startswith("VmRSS:")).split()[1])
    assert rss_kib < 150 * 1024, f"a sim replica uses {rss_kib / 1024:.0f} MiB"


def test_profile_needs_the_sim_engine(llama_dir: Path) -> None:
    with pytest.raises(SystemExit, match="--profile needs --engine sim"):
        main(["replica", "--model", str(llama_dir), "--profile", "instant"])


def test_calibrate_quick_writes_a_usable_profile(llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    command = [
        sys.executable,
        "-m",
        "launcher.cli",
        "calibrate",
        "--model",
        str(llama_dir),
        "--quick",
        "--dtype",
    ]
    result = subprocess.run(
        [*command, "float32", "--threads", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "R² prefill" in result.stdout and "decode batch=8" in result.stdout
    profile = SimProfile.load(out)
    assert profile.name == f"cpu-{llama_dir.name.lower()}"
    assert all(getattr(profile, name) >= 0 for name in COEFFICIENTS)
    assert profile.step_seconds(StepShape(decode_seqs=1, decode_context=40)) > 0
    assert profile.step_seconds(StepShape(128, 128 * 129 // 2, 1)) > 0
    assert profile.calibration["plan"] == "quick" and profile.calibration["configurations"] == 10
    assert profile.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # tiny Llama: 2 layers, 2 KV heads of 16, fp32
