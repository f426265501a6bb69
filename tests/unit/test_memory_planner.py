"""The memory planner reproduces published KV figures and the real parameter counts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from replica.tools.memory_planner import GIB, context_window, format_plan, load_config, plan_memory

KIB = 1024
LLAMA3_ROPE_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
# meta-llama/Llama-3.1-8B-Instruct config.json.
LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": LLAMA3_ROPE_SCALING,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.42.3",
    "use_cache": True,
    "vocab_size": 128256,
}
# meta-llama/Llama-3.3-70B-Instruct config.json.
LLAMA_3_3_70B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 28672,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": LLAMA3_ROPE_SCALING,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.47.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}
# HuggingFaceTB/SmolLM2-135M-Instruct: tied embeddings, 134,515,008 parameters.
SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576,
    "intermediate_size": 1536,
    "model_type": "llama",
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
    "vocab_size": 49152,
}


def test_llama_3_1_8b_matches_published_figures() -> None:
    plan = plan_memory(LLAMA_3_1_8B, context_tokens=131072, gpu_memory_gb=None)
    assert plan.kv_bytes_per_token == 128 * KIB
    assert plan.kv_bytes_context == 16 * GIB
    assert plan.num_params == pytest.approx(8.03e9, rel=0.01)
    assert plan.weight_bytes["fp16"] == 2 * plan.num_params
    assert plan.max_kv_tokens is None


def test_llama_3_3_70b_matches_published_figures() -> None:
    plan = plan_memory(LLAMA_3_3_70B, context_tokens=128 * 1024, gpu_memory_gb=None)
    assert plan.kv_bytes_per_token == 320 * KIB
    assert plan.kv_bytes_context == 40 * GIB
    assert plan.num_params == pytest.approx(70.6e9, rel=0.01)


def test_smollm2_parameter_count_is_exact() -> None:
    plan = plan_memory(SMOLLM2_135M, context_tokens=8192, gpu_memory_gb=None)
    assert plan.num_params == 134_515_008
    assert plan.params["lm_head"] == 0
    assert plan.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2


def test_gpu_budget_and_kv_dtype() -> None:
    plan = plan_memory(LLAMA_3_1_8B, context_tokens=131072, gpu_memory_gb=80, kv_dtype_bytes=1)
    assert plan.kv_bytes_per_token == 64 * KIB
    assert plan.gpu_memory_bytes == 80 * GIB
    assert plan.kv_budget_bytes == 80 * GIB - plan.overhead_bytes - plan.weight_bytes["fp16"]
    assert plan.max_kv_tokens == plan.kv_budget_bytes // plan.kv_bytes_per_token
    assert 0 < plan.overhead_bytes < 10 * GIB

    too_small = plan_memory(LLAMA_3_3_70B, context_tokens=1024, gpu_memory_gb=80)
    assert too_small.kv_budget_bytes == 0
    assert too_small.max_kv_tokens == 0


def test_format_plan_says_its_units() -> None:
    text = format_plan(plan_memory(LLAMA_3_1_8B, context_tokens=131072, gpu_memory_gb=80))
    assert "binary units" in text
    assert "128.00 KiB per token" in text
    assert "16.00 GiB at 131,072 tokens" in text
    assert "8.03B" in text
    assert "GPU 80.00 GiB" in text


def test_load_config_from_dir_or_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
    assert load_config(tmp_path) == LLAMA_3_1_8B
    assert load_config(tmp_path / "config.json") == LLAMA_3_1_8B


def test_context_window_is_the_models_own() -> None:
    assert context_window(LLAMA_3_1_8B) == 131072
    assert context_window({**LLAMA_3_1_8B, "max_position_embeddings": 8192}) == 8192
    without = {key: value for key, value in LLAMA_3_1_8B.items() if key != "max_position_embeddings"}
    for config in (without, {**LLAMA_3_1_8B, "max_position_embeddings": None}):
        with pytest.raises(ValueError, match="--context"):
            context_window(config)


def test_moe_configs_are_refused() -> None:
    mixtral = {**LLAMA_3_1_8B, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
    with pytest.raises(ValueError, match="mixture-of-experts"):
        plan_memory(mixtral, context_tokens=1024, gpu_memory_gb=None)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("qwen3", {"tie_word_embeddings": True, "attention_bias": True}),
    ],
)
def test_count_matches_transformers(tmp_path: Path, arch: str, overrides: dict[str, Any]) -> None:
    transformers = pytest.importorskip("transformers")
    from replica.tools.tiny_models import make_test_model

    model_dir = make_test_model(arch, tmp_path / arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    plan = plan_memory(load_config(model_dir), context_tokens=16, gpu_memory_gb=None)
    assert plan.num_params == sum(p.numel() for p in model.parameters())
