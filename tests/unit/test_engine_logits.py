"""The engine's logits against transformers' eager fp32 forward, to 1e-4 relative error.

Covers a plain prefill, the same prompt prefilled in uneven chunks, several prompts prefilled
in the same steps (chunks of one shape run as one attention group), 20 decode steps (batched
with other sequences of different lengths, so padding masks are exercised), and a prompt whose
prefix comes from the radix cache. Both the tiny Llama (tied embeddings, plain rope) and the
tiny Qwen3 (q/k norms, untied head) are checked; further architectures in test_model_loading.
The bf16 decode path (K/V widened to fp32 for attention) is held to bf16 rounding of the same
reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from replica.engine.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.engine.sampling_params import SamplingParams
from replica.engine.scheduler import ScheduledBatch
from replica.engine.sequence import Sequence, SequenceStatus
from tests.conftest import EngineFactory

TOLERANCE = 1e-4
BF16_TOLERANCE = 3e-2  # as the SmolLM2 bf16 check: a few bf16 roundings per layer


def reference_logits(model_dir: Path, token_ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0]


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    error = ((actual - expected).abs().max() / expected.abs().max()).item()
    assert error <= TOLERANCE, f"relative error {error:.2e} > {TOLERANCE}"


def start(engine: LLMEngine, token_ids: list[int]) -> Sequence:
    """Admits a sequence by hand (with its radix-cache hit) so single steps can be inspected."""
    seq = engine._new_sequence(
        f"s{len(engine.scheduler.running)}", 0, token_ids, SamplingParams(temperature=0)
    )
    engine.kv.admit(seq)
    seq.status = SequenceStatus.RUNNING
    engine.scheduler.running.append(seq)
    return seq


def run_chunk(engine: LLMEngine, seq: Sequence, end: int) -> torch.Tensor:
    """Computes tokens up to ``end`` in one chunk; returns the logits at position end - 1."""
    full = seq.token_ids
    seq.token_ids = full[:end]
    assert engine.kv.reserve(seq, end)
    samplers, logits = engine.runner.run(ScheduledBatch(prefills=[(seq, end - seq.num_computed)]))
    seq.token_ids = full
    engine.kv.commit(seq)
    assert samplers == [seq]
    return logits[0]


def random_prompt(length: int, seed: int, vocab: int = 450) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


@pytest.fixture(params=["llama", "qwen3"])
def model_dir(request: pytest.FixtureRequest, llama_dir: Path, qwen3_dir: Path) -> Path:
    return llama_dir if request.param == "llama" else qwen3_dir


def test_plain_prefill(model_dir: Path, make_engine: EngineFactory) -> None:
    prompt = random_prompt(150, seed=1)
    engine = make_engine(model_dir)
    seq = start(engine, prompt)
    assert_close(run_chunk(engine, seq, len(prompt)), reference_logits(model_dir, prompt)[-1])
    engine.check_integrity()


def test_chunked_prefill(model_dir: Path, make_engine: EngineFactory) -> None:
    prompt = random_prompt(150, seed=2)
    expected = reference_logits(model_dir, prompt)
    engine = make_engine(model_dir)
    seq = start(engine, prompt)
    for end in (37, 48, 101, 150):  # chunk edges inside and on page boundaries
        assert_close(run_chunk(engine, seq, end), expected[end - 1])
    engine.check_integrity()


def test_prompts_prefilled_together(model_dir: Path, make_engine: EngineFactory) -> None:
    """Four prompts in the same two steps, three of one length: the first chunks (no earlier
    context) and the second ones (after those, read back from the pool) are grouped by shape."""
    prompts = [random_prompt(length, seed=10 + i) for i, length in enumerate((70, 70, 45, 70))]
    engine = make_engine(model_dir)
    seqs = [start(engine, p) for p in prompts]
    for seq in seqs:
        seq.token_ids = seq.token_ids[:37]
        assert engine.kv.reserve(seq, 37)
    engine.runner.run(ScheduledBatch(prefills=[(seq, 37) for seq in seqs]))
    for seq, prompt in zip(seqs, prompts, strict=True):
        engine.kv.commit(seq)
        seq.token_ids = list(prompt)
        assert engine.kv.reserve(seq, len(prompt))
    rests = [(seq, len(seq.token_ids) - 37) for seq in seqs]
    samplers, logits = engine.runner.run(ScheduledBatch(prefills=rests))
    assert samplers == seqs
    for row, prompt in enumerate(prompts):
        assert_close(logits[row], reference_logits(model_dir, prompt)[-1])
    for seq in seqs:
        engine.kv.commit(seq)
    engine.check_integrity()


def twenty_batched_decode_steps(engine: LLMEngine) -> tuple[list[Sequence], torch.Tensor]:
    """Three prompts of different lengths prefilled, then decoded together 20 steps (padding masks);
    returns the sequences and the last step's logits."""
    prompts = [random_prompt(length, seed=length) for length in (40, 63, 17)]
    seqs = [start(engine, p) for p in prompts]
    for seq in seqs:
        run_chunk(engine, seq, len(seq.token_ids))
    generator = torch.Generator().manual_seed(3)
    for _ in range(20):
        for seq in seqs:
            seq.token_ids.append(int(torch.randint(0, 450, (1,), generator=generator)))
            assert engine.kv.reserve(seq, len(seq.token_ids))
        samplers, logits = engine.runner.run(ScheduledBatch(decodes=seqs))
        assert samplers == seqs
        for seq in seqs:
            engine.kv.commit(seq)
    return seqs, logits


def test_twenty_batched_decode_steps(model_dir: Path, make_engine: EngineFactory) -> None:
    engine = make_engine(model_dir)
    seqs, logits = twenty_batched_decode_steps(engine)
    for row, seq in enumerate(seqs):
        assert_close(logits[row], reference_logits(model_dir, seq.token_ids)[-1])
    engine.check_integrity()


def test_bf16_batched_decode_tracks_fp32(model_dir: Path) -> None:
    """bf16 decode (a KV head's query heads as one bf16 matmul per sequence) must stay as close to
    the fp32 reference as transformers' own bf16 model does on the same tokens (with a floor for
    tiny errors)."""
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="bfloat16", kv_cache_tokens=4096))
    seqs, logits = twenty_batched_decode_steps(engine)
    their_bf16 = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation="eager", dtype=torch.bfloat16
    )
    for row, seq in enumerate(seqs):
        expected = reference_logits(model_dir, seq.token_ids)[-1]
        with torch.no_grad():
            theirs = their_bf16(torch.tensor([seq.token_ids])).logits[0, -1].float()
        error = ((logits[row] - expected).abs().max() / expected.abs().max()).item()
        their_error = ((theirs - expected).abs().max() / expected.abs().max()).item()
        limit = max(BF16_TOLERANCE, 1.5 * their_error)
        assert error < limit, f"relative error {error:.2e} (transformers bf16: {their_error:.2e})"
    engine.check_integrity()


def test_prefix_cache_hit_matches_miss(model_dir: Path, make_engine: EngineFactory) -> None:
    shared = random_prompt(96, seed=4)
    first, second = shared + random_prompt(10, seed=5), shared + random_prompt(21, seed=6)
    engine = make_engine(model_dir)
    engine.add_request("first", first, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    seq = start(engine, second)
    assert seq.num_computed == 96, "the shared 6 pages should come from the cache"
    hit = run_chunk(engine, seq, len(second))
    miss_engine = make_engine(model_dir)
    miss = run_chunk(miss_engine, start(miss_engine, second), len(second))
    expected = reference_logits(model_dir, second)[-1]
    assert_close(hit, expected)
    assert_close(miss, expected)
    engine.check_integrity()


def test_greedy_generation_matches_transformers(model_dir: Path, make_engine: EngineFactory) -> None:
    prompt = random_prompt(30, seed=7)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    expected = model.generate(
        torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    engine = make_engine(model_dir)
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += [t for delta in out.deltas for t in delta.token_ids]
    assert tokens == expected
    engine.check_integrity()
