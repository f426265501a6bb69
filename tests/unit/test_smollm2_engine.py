"""The engine on the real default model (SmolLM2-135M-Instruct), in fp32 and bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from replica.engine.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.engine.sampling_params import SamplingParams
from replica.model.runner import cpu_native_dtype
from tests.unit.test_engine_logits import run_chunk, start

pytestmark = pytest.mark.smollm

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.parametrize("dtype", sorted({"float32", cpu_native_dtype()}))
def test_answers_paris(smollm2_dir: Path, dtype: str) -> None:
    """In the dtypes ``--dtype auto`` runs on this CPU. Emulated bf16 (AVX2 only) is left to the
    logits test below: its first greedy token here is a tie at 25.25 between "The" and "L", which
    one bf16 ulp anywhere in 30 layers decides either way."""
    engine = LLMEngine(EngineConfig(model=smollm2_dir, dtype=dtype, kv_cache_tokens=2048))
    prompt = engine.tokenizer.encode_chat(QUESTION)
    engine.add_request("q", prompt, SamplingParams(temperature=0, max_tokens=20))
    text = ""
    while engine.has_unfinished():
        text += "".join(delta.text for out in engine.step() for delta in out.deltas)
    assert "Paris" in text
    engine.check_integrity()


def test_bf16_logits_are_as_close_to_fp32_as_transformers_bf16(smollm2_dir: Path) -> None:
    """30 layers amplify low-precision shortcuts (e.g. normalising in bf16) that 2 layers hide.
    Measured against transformers' fp32 run, the engine's bf16 logits must be as close as
    transformers' own bf16 (eager) run: to the bit where every op rounds as eager's does, closer
    where prefill attention is the native kernel (its scores stay fp32; eager rounds them to bf16,
    0.04 of the largest logit apart from fp32 here, against the kernel's 0.014)."""
    engine = LLMEngine(EngineConfig(model=smollm2_dir, dtype="bfloat16", kv_cache_tokens=2048))
    prompt = engine.tokenizer.encode_chat(QUESTION)
    ours = run_chunk(engine, start(engine, prompt), len(prompt))
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        reference = AutoModelForCausalLM.from_pretrained(
            smollm2_dir, dtype=dtype, attn_implementation="eager"
        )
        with torch.no_grad():
            logits[dtype] = reference(torch.tensor([prompt])).logits[0, -1].float()
    exact = logits[torch.float32]

    def error(got: torch.Tensor) -> float:
        return ((got - exact).abs().max() / exact.abs().max()).item()

    theirs = error(logits[torch.bfloat16])
    assert 0 < theirs < 0.06, "transformers' bf16 is off fp32 as bf16 is"
    assert error(ours) <= theirs + 1e-3, (
        f"relative error {error(ours):.4f} against transformers' {theirs:.4f}"
    )
