"""The HF-format loader across architectures, rope scalings, shardings and dtypes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from replica.engine.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.model.config import ModelConfig, UnsupportedModelError
from replica.tools.tiny_models import make_test_model
from tests.unit.test_engine_logits import assert_close, random_prompt, reference_logits, run_chunk, start

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    ("arch", "options"),
    [
        ("llama", {"rope_scaling": LLAMA3_ROPE, "tie_word_embeddings": False}),
        ("llama", {"num_shards": 3}),
        ("qwen2", {}),
        ("qwen3", {"tie_word_embeddings": True}),
    ],
    ids=["llama3-rope-untied", "llama-sharded", "qwen2-qkv-bias", "qwen3-tied"],
)
def test_architectures_match_transformers(arch: str, options: dict, tmp_path: Path) -> None:
    model_dir = make_test_model(arch, tmp_path, **options)
    prompt = random_prompt(200, seed=11)
    engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", kv_cache_tokens=1024))
    assert_close(
        run_chunk(engine, start(engine, prompt), len(prompt)), reference_logits(model_dir, prompt)[-1]
    )


def test_llama3_rope_scaling_changes_the_result(tmp_path: Path) -> None:
    """Guards the test above: a model whose scaling were ignored would give other logits."""
    plain = make_test_model("llama", tmp_path / "plain")
    scaled = make_test_model("llama", tmp_path / "scaled", rope_scaling=LLAMA3_ROPE)
    prompt = random_prompt(200, seed=11)
    assert not torch.allclose(reference_logits(plain, prompt)[-1], reference_logits(scaled, prompt)[-1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_stays_close_to_fp32(dtype: str, llama_dir: Path) -> None:
    prompt = random_prompt(64, seed=12)
    engine = LLMEngine(EngineConfig(model=llama_dir, dtype=dtype, kv_cache_tokens=512))
    assert engine.pool.kv.dtype == getattr(torch, dtype)
    logits = run_chunk(engine, start(engine, prompt), len(prompt))
    expected = reference_logits(llama_dir, prompt)[-1]
    error = ((logits - expected).abs().max() / expected.abs().max()).item()
    assert error < 0.05


def test_unsupported_architecture_is_named(tmp_path: Path, llama_dir: Path) -> None:
    config = json.loads((llama_dir / "config.json").read_text())
    config["architectures"] = ["MixtralForCausalLM"]
    with pytest.raises(UnsupportedModelError, match="MixtralForCausalLM"):
        ModelConfig.from_dict(config)


def test_unsupported_rope_scaling_is_named(llama_dir: Path) -> None:
    config = json.loads((llama_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelConfig.from_dict(config)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model_dir = make_test_model("llama", tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LLMEngine(EngineConfig(model=model_dir, dtype="float32", kv_cache_tokens=256))


def test_kv_pool_sized_by_tokens_or_memory(llama_dir: Path) -> None:
    by_tokens = LLMEngine(EngineConfig(model=llama_dir, dtype="float32", kv_cache_tokens=1000))
    assert by_tokens.pool.capacity_tokens == 1008  # rounded up to whole 16-token pages
    per_token = by_tokens.model_config.kv_bytes_per_token(4)  # 2 * 2 layers * 2 heads * 16 * 4 B = 512
    by_memory = LLMEngine(EngineConfig(model=llama_dir, dtype="float32", kv_cache_memory_gb=0.001))
    assert by_memory.pool.capacity_tokens == (1024**3 // 1000) // (16 * per_token) * 16
    assert by_memory.max_model_len == min(4096, by_memory.pool.capacity_tokens)


def test_token_budget_must_cover_every_running_decode(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model=llama_dir, max_num_seqs=64, max_num_batched_tokens=32)
