"""The decoder-only transformer shared by Llama, Qwen2 and Qwen3 checkpoints.

Weights are plain tensors, q/k/v and gate/up fused into one matmul each, so a step costs few
kernel launches. The arithmetic follows transformers' eager implementation op for op (RMSNorm in
fp32, rotary tables in fp32), which is what lets tests compare logits to 1e-4; the residual add,
the norms, rotary and the gated activation are fused where ``ops`` can.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from replica.model.attention import AttentionBatch, paged_attention
from replica.model.config import ModelConfig
from replica.model.linear import Linear
from replica.model.ops import add_rms_norm_, rms_norm, rotate_, silu_and_mul
from replica.model.rotary import RotaryEmbedding
from replica.model.weights import iter_tensors


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: Linear
    post_norm: torch.Tensor
    gate_up: Linear
    down: Linear


class DecoderLM:
    """Forward pass over a flat batch of tokens with K/V kept in the paged pool."""

    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        norm: torch.Tensor,
        lm_head: Linear,
        rotary: RotaryEmbedding,
    ) -> None:
        self.config = config
        self.embed = embed
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head
        self.rotary = rotary
        self.q_size = config.num_heads * config.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def weight_bytes(self) -> int:
        """Bytes read per decode step: every matrix once (a tied head counts again, as it is read)."""
        total = self.lm_head.nbytes + _nbytes(self.norm)
        for layer in self.layers:
            for part in vars(layer).values():
                total += part.nbytes if isinstance(part, Linear) else _nbytes(part)
        return total

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Returns the final-normed hidden states [tokens, hidden]; kv_cache: [layers, slots, 2, ...]."""
        cfg = self.config
        heads, kv_heads = cfg.num_heads, cfg.num_kv_heads
        hidden = F.embedding(input_ids, self.embed)  # the residual stream, updated in place
        cos, sin = self.rotary.tables(positions)
        tokens = input_ids.shape[0]
        mlp_out: torch.Tensor | None = None
        for index, layer in enumerate(self.layers):
            if mlp_out is None:
                h = rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            else:
                h = add_rms_norm_(hidden, mlp_out, layer.input_norm, cfg.rms_norm_eps)
            # q, k and v heads side by side: [tokens, heads + 2 * kv_heads, head_dim]
            qkv = layer.qkv(h).view(tokens, heads + 2 * kv_heads, cfg.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                qkv[:, :heads] = rms_norm(qkv[:, :heads], layer.q_norm, cfg.rms_norm_eps)
                qkv[:, heads : heads + kv_heads] = rms_norm(
                    qkv[:, heads : heads + kv_heads], layer.k_norm, cfg.rms_norm_eps
                )
            rotate_(qkv[:, : heads + kv_heads], cos, sin)
            new_kv = qkv[:, heads:].view(tokens, 2, kv_heads, cfg.head_dim)
            attn = paged_attention(qkv[:, :heads], new_kv, kv_cache[index], batch, index)
            h = add_rms_norm_(
                hidden, layer.o(attn.view(tokens, self.q_size)), layer.post_norm, cfg.rms_norm_eps
            )
            mlp_out = layer.down(silu_and_mul(layer.gate_up(h)))
        assert mlp_out is not None
        return add_rms_norm_(hidden, mlp_out, self.norm, cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @classmethod
    def load(cls, model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: str) -> DecoderLM:
        """Reads the checkpoint; a missing or unexpected tensor is an error naming it."""
        tensors = dict(iter_tensors(model_dir, dtype, device))
        tensors = {name: t for name, t in tensors.items() if not name.endswith("rotary_emb.inv_freq")}
        take = _Taker(tensors)
        layers = [_load_layer(take, config, i) for i in range(config.num_layers)]
        embed = take("model.embed_tokens.weight")
        norm = take("model.norm.weight")
        if config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
            lm_head = Linear(embed)
        else:
            lm_head = Linear(take("lm_head.weight"))
        if tensors:
            raise ValueError(f"unexpected tensors in checkpoint: {sorted(tensors)[:8]}")
        rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
            dtype,
            device,
        )
        return cls(config, embed, layers, norm, lm_head, rotary)


class _Taker:
    """Pops tensors by name so leftovers can be reported as unexpected."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return self.tensors.pop(name)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, dim=0).contiguous()


def _load_layer(take: _Taker, config: ModelConfig, index: int) -> LayerWeights:
    prefix = f"model.layers.{index}."
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    qkv_bias = _cat([take(attn + f"{p}_proj.bias") for p in "qkv"]) if config.qkv_bias else None
    gate_up_bias = (
        _cat([take(mlp + "gate_proj.bias"), take(mlp + "up_proj.bias")]) if config.mlp_bias else None
    )
    down_bias = take(mlp + "down_proj.bias") if config.mlp_bias else None
    return LayerWeights(
        input_norm=take(prefix + "input_layernorm.weight"),
        qkv=Linear(_cat([take(attn + f"{p}_proj.weight") for p in "qkv"]), qkv_bias),
        q_norm=take(attn + "q_norm.weight") if config.qk_norm else None,
        k_norm=take(attn + "k_norm.weight") if config.qk_norm else None,
        o=Linear(take(attn + "o_proj.weight"), take(attn + "o_proj.bias") if config.o_bias else None),
        post_norm=take(prefix + "post_attention_layernorm.weight"),
        gate_up=Linear(_cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]), gate_up_bias),
        down=Linear(take(mlp + "down_proj.weight"), down_bias),
    )


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()
