"""Settings of one replica engine: which model, where it runs, and how big its KV pool is."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvroute.protocol import DEFAULT_BLOCK_SIZE


@dataclass
class EngineConfig:
    """Everything ``LLMEngine`` needs; the CLI flags of ``kvroute replica`` map onto these fields."""

    model: Path
    served_model_name: str | None = None  # defaults to the model directory's name
    device: str = "cpu"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (see engine.resolve_dtype)
    threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per KV page = tokens per hashed block
    kv_cache_tokens: int | None = None  # KV pool size in tokens; overrides kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0  # KV pool budget when kv_cache_tokens is not given
    max_num_seqs: int = 64  # sequences decoded together at most
    max_num_batched_tokens: int = 512  # per-step token budget (prefill chunks + decodes)
    max_model_len: int | None = None  # context window; defaults to the model's max_position_embeddings
    seed: int = 0  # seeds requests that bring no seed of their own
    engine: str = "torch"  # torch | sim: a simulation, a cost model instead of the forward pass (replica.sim)
    sim_profile: str = "cpu-smollm2"  # sim only: a built-in profile name or a profile JSON file

    def __post_init__(self) -> None:
        if self.engine not in ("torch", "sim"):
            raise ValueError(f"unknown engine {self.engine!r}; choose torch or sim")
        if self.block_size < 1 or self.max_num_seqs < 1:
            raise ValueError("block_size and max_num_seqs must be positive")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # every running sequence must be able to decode its token in one step, or some starve
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs})"
            )

    def resolved_model_name(self) -> str:
        return self.served_model_name or Path(self.model).name
