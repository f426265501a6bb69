"""How much GPU memory a dense decoder model needs: weights, KV cache per token, and what fits.

Works from an HF config.json alone (no weights, no torch), so capacity can be planned before a
model is downloaded. Byte figures use binary units throughout (1 KiB = 1024 bytes, 1 GiB = 2**30
bytes), the units in which KV-cache sizes are usually published: Llama-3.1-8B needs 128 KiB of
fp16 KV per token, 16 GiB at 131072 tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30
# Share of GPU memory kept free of weights and KV for the CUDA context, activations, sampling
# buffers and allocator fragmentation (vLLM's default gpu_memory_utilization of 0.9 leaves the same).
GPU_OVERHEAD_FRACTION = 0.10
# Config keys that announce a mixture-of-experts model, whose parameters this planner does not count.
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_WEIGHT_BYTES_PER_PARAM = {"fp16": 2.0, "int8": 1.0, "int4": 0.5}
_KV_DTYPE_NAMES = {1: "fp8/int8", 2: "fp16/bf16", 4: "fp32"}


@dataclass(frozen=True)
class MemoryPlan:
    """Sizes in bytes and counts in tokens; the GPU fields are None when no GPU size was given."""

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    params: dict[str, int]  # embeddings, lm_head, attention, mlp, norms
    num_params: int
    weight_bytes: dict[str, int]  # fp16, int8, int4 (no quantization scales counted)
    kv_dtype_bytes: int
    kv_bytes_per_token: int
    context_tokens: int
    kv_bytes_context: int
    gpu_memory_bytes: int | None
    overhead_bytes: int | None
    kv_budget_bytes: int | None  # beside fp16 weights and the overhead
    max_kv_tokens: int | None


def load_config(path: str | Path) -> dict[str, Any]:
    """Read an HF config from a model directory or a config.json path."""
    path = Path(path)
    config_file = path / "config.json" if path.is_dir() else path
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} does not hold a JSON object")
    return config


def context_window(config: dict[str, Any]) -> int:
    """The model's own context window: ``max_position_embeddings`` of its config (what the replica
    serves when no --max-model-len is given)."""
    window = config.get("max_position_embeddings")
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(
            "the config gives no max_position_embeddings (its context window): give --context TOKENS"
        )
    return window


def count_params(config: dict[str, Any]) -> dict[str, int]:
    """Parameter count per part of a dense Llama/Qwen/Mistral-style decoder.

    Attention counts GQA (fewer K/V heads) and an explicit head_dim; biases follow
    ``attention_bias`` / ``mlp_bias``, plus Qwen2's built-in Q/K/V biases and Qwen3's Q/K norms.
    """
    shape = _Shape.of(config)
    hidden, model_type = shape.hidden, config.get("model_type", "")
    q_out, kv_out = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention_bias = bool(config.get("attention_bias", False))
    qkv_bias = attention_bias or model_type == "qwen2"
    attention = hidden * (q_out + 2 * kv_out) + q_out * hidden
    attention += (q_out + 2 * kv_out) * qkv_bias + hidden * attention_bias
    norms = 2 * hidden
    if model_type == "qwen3":
        norms += 2 * shape.head_dim  # q_norm and k_norm
    intermediate = shape.intermediate
    mlp = 3 * hidden * intermediate + (2 * intermediate + hidden) * bool(config.get("mlp_bias", False))

    embeddings = shape.vocab * hidden
    return {
        "embeddings": embeddings,
        "lm_head": 0 if config.get("tie_word_embeddings", False) else embeddings,
        "attention": shape.layers * attention,
        "mlp": shape.layers * mlp,
        "norms": shape.layers * norms + hidden,
    }


def plan_memory(
    config: dict[str, Any], context_tokens: int, gpu_memory_gb: float | None, kv_dtype_bytes: int = 2
) -> MemoryPlan:
    """Plan weights and KV for ``context_tokens`` tokens on a GPU of ``gpu_memory_gb`` GiB (binary).

    The KV budget is what is left of the GPU after fp16 weights and GPU_OVERHEAD_FRACTION.
    """
    if context_tokens < 0:
        raise ValueError("context_tokens must be >= 0")
    params = count_params(config)
    num_params = sum(params.values())
    shape = _Shape.of(config)
    weight_bytes = {name: int(num_params * size) for name, size in _WEIGHT_BYTES_PER_PARAM.items()}
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * kv_dtype_bytes  # K and V

    gpu_bytes = overhead = budget = max_tokens = None
    if gpu_memory_gb is not None:
        gpu_bytes = int(gpu_memory_gb * GIB)
        overhead = int(gpu_bytes * GPU_OVERHEAD_FRACTION)
        budget = max(0, gpu_bytes - overhead - weight_bytes["fp16"])
        max_tokens = budget // kv_per_token

    return MemoryPlan(
        model_type=str(config.get("model_type", "unknown")),
        num_layers=shape.layers,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        params=params,
        num_params=num_params,
        weight_bytes=weight_bytes,
        kv_dtype_bytes=kv_dtype_bytes,
        kv_bytes_per_token=kv_per_token,
        context_tokens=context_tokens,
        kv_bytes_context=kv_per_token * context_tokens,
        gpu_memory_bytes=gpu_bytes,
        overhead_bytes=overhead,
        kv_budget_bytes=budget,
        max_kv_tokens=max_tokens,
    )


def format_plan(plan: MemoryPlan) -> str:
    """A short human-readable report of a plan (binary units, said so on the first line)."""
    parts = ", ".join(f"{name} {_count(value)}" for name, value in plan.params.items() if value)
    weights = " | ".join(f"{name} {_bytes(size)}" for name, size in plan.weight_bytes.items())
    kv_name = _KV_DTYPE_NAMES.get(plan.kv_dtype_bytes, f"{plan.kv_dtype_bytes}-byte")
    lines = [
        f"Model {plan.model_type}: {plan.num_layers} layers, {plan.num_kv_heads} KV heads x head_dim "
        f"{plan.head_dim} (sizes in binary units: 1 KiB = 1024 B, 1 GiB = 2^30 B)",
        f"Parameters: {_count(plan.num_params)} ({parts})",
        f"Weights: {weights}",
        f"KV cache ({kv_name}, {plan.kv_dtype_bytes} B/value): {_bytes(plan.kv_bytes_per_token)} per token, "
        f"{_bytes(plan.kv_bytes_context)} at {plan.context_tokens:,} tokens",
    ]
    if plan.gpu_memory_bytes is not None and plan.max_kv_tokens is not None:
        contexts = plan.max_kv_tokens / plan.context_tokens if plan.context_tokens else float("inf")
        lines.append(
            f"GPU {_bytes(plan.gpu_memory_bytes)}: {_bytes(plan.overhead_bytes or 0)} overhead "
            f"({GPU_OVERHEAD_FRACTION:.0%}) + {_bytes(plan.weight_bytes['fp16'])} fp16 weights leave "
            f"{_bytes(plan.kv_budget_bytes or 0)} for KV = {plan.max_kv_tokens:,} tokens "
            f"({contexts:.2f}x the {plan.context_tokens:,}-token context)"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class _Shape:
    """The config fields the counts need, read once with HF's defaults for the optional ones."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @classmethod
    def of(cls, config: dict[str, Any]) -> _Shape:
        """Read the shape, refusing MoE configs and configs that lack a required field."""
        experts = [key for key in _EXPERT_KEYS if config.get(key)]
        if experts:
            raise ValueError(
                f"mixture-of-experts configs ({', '.join(experts)}) are out of scope for this planner"
            )
        required = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        missing = [key for key in required if not isinstance(config.get(key), int)]
        if missing:
            raise ValueError(f"config lacks integer {', '.join(missing)}; is it a decoder-only HF config?")
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        return cls(
            hidden=hidden,
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate=config["intermediate_size"],
            vocab=config["vocab_size"],
        )


def _bytes(size: int) -> str:
    """Binary-unit size with the largest unit that keeps the number >= 1."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def _count(value: int) -> str:
    """Parameter counts in decimal units (M, B), as models are named."""
    if value >= 1e9:
        return f"{value / 1e9:.2f}B"
    if value >= 1e6:
        return f"{value / 1e6:.1f}M"
    return f"{value:,}"
