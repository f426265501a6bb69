"""Settings of one replica engine: which model, where it runs, and how big its KV pool is.

Each field that ``kvroute replica`` sets is declared with its flag and help (``kvroute.settings``):
its default is written here once, for the engine, the command line and its help.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvroute.protocol import DEFAULT_BLOCK_SIZE
from kvroute.settings import REQUIRED, option

ENGINES = ("torch", "sim")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # see replica.model.runner.resolve_dtype
MODEL_HELP = "HF model directory (default: prepared SmolLM2-135M-Instruct)"  # the commands prepare it


@dataclass
class EngineConfig:
    """Everything ``LLMEngine`` needs."""

    # (option() returns a dataclasses.field, which RUF009 cannot see: the noqa)
    model: Path = option(REQUIRED, "--model", MODEL_HELP)
    engine: str = option(
        "torch",
        "--engine",
        "torch: run the model; sim: a SIMULATION with the real scheduler, cache, Redis reporting and"
        " server but a cost model instead of the forward pass: it loads no weights (--model gives the"
        " tokenizer and config only), sleeps each step's predicted time and emits filler text"
        " (docs/SIMULATION.md)",
        choices=ENGINES,
    )  # sim: replica.sim
    sim_profile: str = option(
        "cpu-smollm2",
        "--profile",
        "--engine sim only: the cost profile, a built-in name (cpu-smollm2, h100-llama3-8b,"
        " a100-llama3-8b, instant) or a JSON file from `kvroute calibrate`",
        metavar="NAME_OR_PATH",
        track_given=True,  # given with --engine torch, it is an error
    )
    served_model_name: str | None = option(
        None, "--served-model-name", "model name clients ask for (default: the directory name)"
    )
    device: str = option("cpu", "--device", "cpu or cuda[:N]")
    dtype: str = option(
        "auto",
        "--dtype",
        "weights and activations; auto: the checkpoint's dtype on CUDA, on CPU bfloat16 where"
        " the CPU computes it natively, else float32",
        choices=DTYPES,
    )
    threads: int | None = option(None, "--threads", "torch CPU threads (default: torch's choice)")
    block_size: int = option(DEFAULT_BLOCK_SIZE, "--block-size", "tokens per KV page / hashed block")
    kv_cache_tokens: int | None = option(
        None,
        "--kv-cache-tokens",
        "KV pool size in tokens, overriding --kv-cache-memory-gb (default: what that budget holds)",
    )
    kv_cache_memory_gb: float = option(1.0, "--kv-cache-memory-gb", "KV pool memory budget in GiB")
    decode_context_mb: float = option(
        256.0,
        "--decode-context-mb",
        "memory for the decodes' gathered K/V kept from step to step where the fused CPU kernel "
        "is off (CUDA, fp16, no C++ compiler); 0: gathered every step",
    )
    max_num_seqs: int = option(64, "--max-num-seqs", "sequences decoded together at most")
    # per step: prefill chunks and decodes
    max_num_batched_tokens: int = option(512, "--max-num-batched-tokens", "per-step token budget")
    max_prefill_step_tokens: int = option(
        1024,
        "--max-prefill-step-tokens",
        "per-step token budget while more prompts wait for their first token than streams for "
        "their next (a burst); at least --max-num-batched-tokens",
    )
    # the model's: its max_position_embeddings
    max_model_len: int | None = option(None, "--max-model-len", "context window (default: the model's)")
    seed: int = option(0, "--seed", "seeds requests that bring no seed")

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
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
