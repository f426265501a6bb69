"""The simulated backend in process: the cost model's arithmetic, the built-in profiles, the engine
driving ``SimRunner`` (exact lengths, deterministic filler, real cache and events, step times that
match the profile) and the calibration fit."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvroute.protocol import EventKind, block_hashes
from replica.engine.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.engine.outputs import ChoiceDelta, RequestOutput
from replica.engine.sampling_params import SamplingParams
from replica.engine.scheduler import ScheduledBatch
from replica.engine.sequence import Sequence
from replica.kvcache.events import KVEventOutbox
from replica.sim.calibrate import nonnegative_lstsq
from replica.sim.runner import COEFFICIENTS, SimProfile, StepShape, builtin_profiles

# Large enough that the sleeps dominate the engine's own overhead on a busy 2-core machine.
SLOW = {
    "name": "slow-test",
    "prefill_base_s": 0.02,
    "prefill_token_s": 5e-4,
    "prefill_pair_s": 1e-6,
    "prefill_seq_s": 0.004,
    "decode_base_s": 0.015,
    "decode_seq_s": 0.003,
    "decode_context_s": 2e-5,
}


def sim_engine(model: Path, profile: str | Path = "instant", **settings: Any) -> LLMEngine:
    settings.setdefault("kv_cache_tokens", 4096)
    config = EngineConfig(model=model, engine="sim", sim_profile=str(profile), **settings)
    return LLMEngine(config, outbox=KVEventOutbox())


@dataclass
class Result:
    """A request's whole output: per choice its text, tokens, logprobs and finish reason."""

    last: RequestOutput
    choices: dict[int, ChoiceDelta] = field(default_factory=dict)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Result]:
    """Runs the requests to the end and merges each choice's deltas."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    results: dict[str, Result] = {}
    while engine.has_unfinished():
        for output in engine.step():
            result = results.setdefault(output.request_id, Result(output))
            result.last = output
            for delta in output.deltas:
                whole = result.choices.setdefault(delta.index, ChoiceDelta(delta.index, "", [], [], None))
                whole.text += delta.text
                whole.token_ids += delta.token_ids
                whole.logprobs = (whole.logprobs or []) + (delta.logprobs or [])
                whole.finish_reason = delta.finish_reason
    engine.check_integrity()
    return results


def prompt(length: int, start: int = 3) -> list[int]:
    return [start + (i * 7) % 400 for i in range(length)]


def write_profile(tmp_path: Path, **overrides: Any) -> Path:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(SLOW | overrides))
    return path


# -- the cost model --------------------------------------------------------------------------------


def test_step_shape_counts_tokens_pairs_and_context(llama_dir: Path) -> None:
    engine = sim_engine(llama_dir)

    def sequence(computed: int, total: int) -> Sequence:
        seq = engine._new_sequence("r", 0, list(range(total)), SamplingParams())
        seq.num_computed = computed
        return seq

    batch = ScheduledBatch(
        decodes=[sequence(10, 11), sequence(99, 100)],
        prefills=[(sequence(0, 50), 50), (sequence(32, 80), 16)],
    )
    shape = StepShape.of(batch)
    assert shape == StepShape(
        prefill_tokens=66,
        prefill_pairs=50 * 51 // 2 + (16 * 32 + 16 * 17 // 2),
        prefill_seqs=2,
        decode_seqs=2,
        decode_context=11 + 100,
    )


def test_step_seconds_adds_the_parts_with_one_base() -> None:
    profile = SimProfile.from_dict(SLOW)
    prefill = StepShape(prefill_tokens=100, prefill_pairs=5050, prefill_seqs=1)
    decode = StepShape(decode_seqs=4, decode_context=400)
    prefill_s = 0.02 + 100 * 5e-4 + 5050 * 1e-6 + 0.004
    decode_s = 0.015 + 4 * 0.003 + 400 * 2e-5
    assert profile.step_seconds(prefill) == pytest.approx(prefill_s)
    assert profile.step_seconds(decode) == pytest.approx(decode_s)
    mixed = StepShape(100, 5050, 1, 4, 400)
    assert profile.step_seconds(mixed) == pytest.approx(prefill_s + decode_s - 0.015)
    assert profile.step_seconds(StepShape()) == 0.0


def test_builtin_profiles_load() -> None:
    assert {"cpu-smollm2", "h100-llama3-8b", "a100-llama3-8b", "instant"} <= set(builtin_profiles())
    for name in builtin_profiles():
        profile = SimProfile.load(name)
        assert profile.name == name
        assert profile.description and profile.source
    assert all(getattr(SimProfile.load("instant"), name) == 0 for name in COEFFICIENTS)
    h100, a100 = SimProfile.load("h100-llama3-8b"), SimProfile.load("a100-llama3-8b")
    assert 0.005 < h100.decode_base_s < a100.decode_base_s < 0.02  # a few ms per step, H100 faster
    assert h100.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # Llama 3 8B in bf16


def test_bad_profiles_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="built-in profiles are"):
        SimProfile.load("no-such-profile")
    with pytest.raises(ValueError, match="decode_seq_s must be a number >= 0"):
        SimProfile.load(write_profile(tmp_path, decode_seq_s=-1.0))
    with pytest.raises(ValueError, match="unknown fields prefil_base_s"):
        SimProfile.load(write_profile(tmp_path, prefil_base_s=1.0))
    raw = dict(SLOW)
    del raw["decode_base_s"]
    (tmp_path / "missing.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="missing fields decode_base_s"):
        SimProfile.load(tmp_path / "missing.json")


def test_nonnegative_fit_recovers_coefficients() -> None:
    rng = np.random.default_rng(0)
    features = np.column_stack([np.ones(40), rng.uniform(0, 1000, 40), rng.uniform(0, 1e5, 40)])
    truth = np.array([0.01, 2e-4, 0.0])  # the last feature does not matter
    target = features @ truth + rng.normal(0, 1e-4, 40)
    fitted = nonnegative_lstsq(features, target)
    assert np.all(fitted >= 0)
    assert fitted[0] == pytest.approx(0.01, rel=0.05)
    assert fitted[1] == pytest.approx(2e-4, rel=0.01)
    assert fitted[2] < 1e-9
    assert np.linalg.lstsq(features, target, rcond=None)[0][2] < 0, "plain least squares goes negative here"


# -- the engine on SimRunner ------------------------------------------------------------------------


def test_exact_lengths_and_deterministic_filler(llama_dir: Path) -> None:
    engine = sim_engine(llama_dir)
    greedy = SamplingParams(max_tokens=37, temperature=0)
    sampled = SamplingParams(max_tokens=25, temperature=0.9, n=3, logprobs=2)
    first = run(engine, {"a": (prompt(70), greedy), "b": (prompt(70), sampled), "c": (prompt(71), greedy)})
    again = run(sim_engine(llama_dir), {"a": (prompt(70), greedy)})
    assert first["a"].last.completion_tokens == 37 and first["b"].last.completion_tokens == 75
    a = first["a"].choices[0]
    assert a.finish_reason == "length" and len(a.token_ids) == 37 and a.text.strip()
    assert again["a"].choices[0].text == a.text, "same request, same text"
    assert first["c"].choices[0].text != a.text, "another prompt starts elsewhere in the filler"
    b = first["b"].choices
    assert sorted(b) == [0, 1, 2] and all(len(c.token_ids) == 25 for c in b.values())
    assert len({c.text for c in b.values()}) == 3, "the n choices differ"
    eos, special = engine.eos_token_ids, set(engine.tokenizer.all_special_ids)
    assert not {t for c in b.values() for t in c.token_ids} & {*eos, *special}
    logprobs = b[0].logprobs
    assert logprobs is not None and len(logprobs) == 25
    assert logprobs[0].logprob == 0.0 and logprobs[0].top[0] == (logprobs[0].token_id, 0.0)
    assert len(logprobs[0].top) == 2 and logprobs[0].top[1][1] == -math.inf


def test_stop_strings_and_prefix_cache_work_as_in_the_torch_engine(llama_dir: Path) -> None:
    engine = sim_engine(llama_dir)
    params = SamplingParams(max_tokens=30, temperature=0)
    text = run(engine, {"a": (prompt(70), params)})["a"].choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stopped = run(engine, {"b": (prompt(70), SamplingParams(max_tokens=30, temperature=0, stop=[stop]))})
    assert stopped["b"].choices[0].finish_reason == "stop"
    assert stopped["b"].choices[0].text == text[: text.index(stop)]
    assert stopped["b"].last.cached_tokens == 64
    assert engine.cache.outbox is not None
    stored = [h for e in engine.cache.outbox.drain() if e.kind is EventKind.STORED for h in e.block_hashes]
    expected = block_hashes(prompt(70), 16, engine.block_seed)
    assert stored[: len(expected)] == expected, "the same block hashes a torch replica publishes"


def test_cache_pressure_evicts(llama_dir: Path) -> None:
    engine = sim_engine(llama_dir, kv_cache_tokens=256)
    assert engine.pool.num_pages == 16
    for i in range(6):
        run(engine, {f"r{i}": (prompt(100, start=3 + i), SamplingParams(max_tokens=8, temperature=0))})
    assert engine.cache.outbox is not None
    assert any(e.kind is EventKind.REMOVED for e in engine.cache.outbox.drain())


def test_pool_size_from_the_profile(llama_dir: Path) -> None:
    """--kv-cache-memory-gb sizes the pool with the profile's KV bytes per token when it has one."""
    h100 = sim_engine(llama_dir, "h100-llama3-8b", kv_cache_tokens=None, kv_cache_memory_gb=1.0)
    assert h100.pool.num_pages == 1024**3 // (16 * 131072)
    own = sim_engine(llama_dir, kv_cache_tokens=None, kv_cache_memory_gb=0.001)  # the model's bf16 KV
    assert own.pool.num_pages == int(0.001 * 1024**3) // (16 * own.model_config.kv_bytes_per_token(2))


class ShapeRecorder:
    """Stands between the engine and its runner, noting the shape of each step it computes."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.shapes: list[StepShape] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def execute(self, batch: ScheduledBatch) -> Any:
        self.shapes.append(StepShape.of(batch))
        return self.runner.execute(batch)


def test_step_times_follow_the_profile(llama_dir: Path, tmp_path: Path) -> None:
    """A whole engine step lasts the profile's prediction for its shape, plus a little overhead:
    a long prefill, a batch admitted together, their decodes, and mixed steps in between."""
    engine = sim_engine(
        llama_dir, write_profile(tmp_path), max_num_batched_tokens=256, max_prefill_step_tokens=256
    )
    recorder = ShapeRecorder(engine.runner)
    engine.runner = recorder
    profile = SimProfile.from_dict(SLOW)
    engine.add_request("long", prompt(300), SamplingParams(max_tokens=4, temperature=0))
    for i in range(6):
        engine.add_request(f"short{i}", prompt(40, start=5 + i), SamplingParams(max_tokens=6, temperature=0))
    kinds = set()
    while engine.has_unfinished():
        started = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - started
        shape = recorder.shapes[-1]
        predicted = profile.step_seconds(shape)
        assert predicted <= elapsed <= predicted + 0.05, (shape, elapsed, predicted)
        kinds.add((shape.prefill_seqs > 0, shape.decode_seqs > 0))
    assert kinds == {(True, False), (True, True), (False, True)}, "prefill, mixed and decode steps"
