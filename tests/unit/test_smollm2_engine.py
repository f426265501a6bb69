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


def test_bf16_logits_track_transformers_bf16(smollm2_dir: Path) -> None:
    """30 layers amplify low-precision shortcuts (e.g. normalising in bf16) that 2 layers hide."""
    engine = LLMEngine(EngineConfig(model=smollm2_dir, dtype="bfloat16", kv_cache_tokens=2048))
    prompt = engine.tokenizer.encode_chat(QUESTION)
    ours = run_chunk(engine, start(engine, prompt), len(prompt))
    reference = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.bfloat16, attn_implementation="eager"
    )
    with torch.no_grad():
        theirs = reference(torch.tensor([prompt])).logits[0, -1].float()
    error = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert error < 0.03, f"relative error {error:.3f}"
