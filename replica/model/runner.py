"""The torch engine's runner: loads the model and its KV pool, turns a scheduled batch into
tensors, runs the model and samples the next tokens (the engine's only torch-dependent part)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from replica.engine.config import EngineConfig
from replica.engine.outputs import TokenLogprob
from replica.engine.scheduler import ScheduledBatch
from replica.engine.sequence import Sequence
from replica.kvcache.pool import KVPool, pool_pages
from replica.model.attention import AttentionBatch, PrefillGroup, decode_bias
from replica.model.config import ModelConfig
from replica.model.decode_context import DecodeContext
from replica.model.decoder import DecoderLM
from replica.model.ops import native_decode_attention, native_prefill_attention
from replica.model.sampler import sample

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_native_dtype() -> str:
    """bf16 where this CPU computes it natively (AVX512-BF16/AMX: several times faster prefill,
    half the memory traffic); else fp32, as bf16 without those instructions is emulated and runs
    several times slower than fp32."""
    return "bfloat16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


def resolve_dtype(name: str, config: ModelConfig, device: str) -> torch.dtype:
    """``auto``: the checkpoint's dtype on CUDA; on CPU, ``cpu_native_dtype()``."""
    if name == "auto":
        if device.startswith("cuda"):
            name = config.torch_dtype if config.torch_dtype in _DTYPES else "bfloat16"
        else:
            name = cpu_native_dtype()
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose from auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, model: DecoderLM, pool: KVPool, device: str, decode_context_bytes: int = 0) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.page_size = pool.page_size
        self._page_offsets = torch.arange(pool.page_size, device=device)
        self._decode_context = DecodeContext(model.config.num_layers, decode_context_bytes)
        # The native kernel reads decodes' K/V from the pool's pages: no context to gather or carry.
        self._native_decode = native_decode_attention(model.dtype, device)
        self._native_prefill = native_prefill_attention(model.dtype, device, model.config.head_dim)

    @classmethod
    def load(cls, config: EngineConfig, model_config: ModelConfig) -> ModelRunner:
        """Loads the weights and allocates the KV pool (``kv_cache_tokens`` or the memory budget)."""
        if config.threads:
            torch.set_num_threads(config.threads)
        dtype = resolve_dtype(config.dtype, model_config, config.device)
        model = DecoderLM.load(Path(config.model), model_config, dtype, config.device)
        pages = pool_pages(config, model_config.kv_bytes_per_token(dtype.itemsize))
        pool = KVPool(
            model_config.num_layers,
            pages,
            config.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            dtype,
            config.device,
        )
        return cls(model, pool, config.device, int(config.decode_context_mb * 1024**2))

    @property
    def description(self) -> str:
        dtype = str(self.pool.kv.dtype).removeprefix("torch.")
        return f"{dtype}, {self.device}, weights {self.model.weight_bytes() / 1e6:.1f} MB"

    def generator(self, seed: int) -> torch.Generator:
        """The random stream of one sequence that samples (not greedy)."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """Runs the step and samples: each sequence whose tokens are all computed, with its next token."""
        seqs, logits = self.run(batch)
        if not seqs:
            return []
        picks = sample(logits, seqs)
        return [(seq, token, logprob) for seq, (token, logprob) in zip(seqs, picks, strict=True)]

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Computes this step's tokens; returns the sequences that sample and their logits [S, vocab]."""
        spans = batch.spans()
        input_ids: list[int] = []
        positions: list[int] = []
        for seq, start, length in spans:
            input_ids += seq.token_ids[start : start + length]
            positions += range(start, start + length)
        positions_t = torch.tensor(positions, device=self.device)
        attention = self._attention_batch(batch, spans)
        hidden = self.model.forward(
            torch.tensor(input_ids, device=self.device), positions_t, attention, self.pool.kv
        )
        self._decode_context.end()
        samplers: list[Sequence] = []
        rows: list[int] = []
        offset = 0
        for seq, start, length in spans:
            offset += length
            if start + length == len(seq.token_ids):
                samplers.append(seq)
                rows.append(offset - 1)
        for seq, start, length in spans:
            seq.num_computed = start + length
        if not rows:
            return [], hidden.new_empty((0, 0))
        return samplers, self.model.logits(hidden[torch.tensor(rows, device=self.device)])

    def _slots(self, page_table: list[int]) -> torch.Tensor:
        """Every slot of these pages, in order: [pages * page_size]."""
        pages = torch.as_tensor(page_table, device=self.device)
        return (pages.unsqueeze(-1) * self.page_size + self._page_offsets).flatten(-2)

    def _attention_batch(
        self,
        batch: ScheduledBatch,
        spans: list[tuple[Sequence, int, int]],
    ) -> AttentionBatch:
        size = self.page_size
        slot_parts: list[torch.Tensor] = []
        decode = self._decode_batch(batch.decodes) if batch.decodes else None
        if decode is None:
            self._decode_context.clear()
        else:
            slot_parts.append(decode.new_slots)
        shapes: dict[tuple[int, int], list[tuple[int, list[int]]]] = {}  # (length, context): chunks
        flat = len(batch.decodes)
        for seq, start, length in spans[len(batch.decodes) :]:
            context = start + length
            pages = seq.page_table[: -(-context // size)]
            slot_parts.append(self._slots(pages)[start:context])
            shapes.setdefault((length, context), []).append((flat, pages))
            flat += length
        prefills = [self._prefill_group(*shape, chunks) for shape, chunks in shapes.items()]
        slot_mapping = torch.cat(slot_parts) if len(slot_parts) > 1 else slot_parts[0]
        if decode is None:
            return AttentionBatch(slot_mapping, 0, None, None, prefills)
        return AttentionBatch(
            slot_mapping,
            len(batch.decodes),
            decode.pages,
            decode.bias,
            prefills,
            None if self._native_decode else self._decode_context,
            decode.positions,
            decode.lengths,
        )

    def _prefill_group(self, length: int, context: int, chunks: list[tuple[int, list[int]]]) -> PrefillGroup:
        """Chunks of one shape, as (flat offset, context pages) each, and their index tensors; the
        pages only where the chunks have earlier context to read back from the pool, or where the
        native kernel reads every context from the pool."""
        starts = [start for start, _ in chunks]
        pages = None
        if self._native_prefill or context > length:
            pages = torch.tensor([page for _, table in chunks for page in table], device=self.device)
        if self._native_prefill:
            offsets = torch.tensor(starts, device=self.device)
            return PrefillGroup(starts, length, context, None, pages, offsets)
        rows = None
        if len(chunks) > 1:
            rows = (torch.tensor(starts).unsqueeze(1) + torch.arange(length)).flatten().to(self.device)
        return PrefillGroup(starts, length, context, rows, pages)

    def _decode_batch(self, decodes: list[Sequence]) -> _DecodeBatch:
        """The decodes' page tables (padded to the longest) and slots; for the batched-matmul form
        also the mask and context positions, telling the decode context whether this step carries
        the last one's over."""
        size, cfg = self.page_size, self.model.config
        lengths = [seq.num_computed + 1 for seq in decodes]  # each context, this token included
        width = -(-max(lengths) // size)
        table = [(seq.page_table + [0] * width)[:width] for seq in decodes]
        new_slots = [
            seq.page_table[(n - 1) // size] * size + (n - 1) % size
            for seq, n in zip(decodes, lengths, strict=True)
        ]
        pages = torch.tensor(table, device=self.device)
        slots = torch.tensor(new_slots, device=self.device)
        lengths_t = torch.tensor(lengths, device=self.device)
        if self._native_decode:
            self._decode_context.clear()
            return _DecodeBatch(pages, slots, lengths=lengths_t)
        keys = width * size
        row_bytes = 2 * cfg.num_kv_heads * keys * cfg.head_dim * self.pool.kv.element_size()
        self._decode_context.begin(decodes, lengths, width, row_bytes * len(decodes))
        group = cfg.num_heads // cfg.num_kv_heads
        return _DecodeBatch(
            pages,
            slots,
            bias=decode_bias(lengths_t, keys, cfg.num_kv_heads, group, self.model.dtype),
            positions=torch.tensor([row * keys + n - 1 for row, n in enumerate(lengths)], device=self.device),
        )


@dataclass
class _DecodeBatch:
    pages: torch.Tensor  # [decodes, width]
    new_slots: torch.Tensor  # [decodes]: where each new token's K/V goes in the pool
    bias: torch.Tensor | None = None  # see decode_bias(); batched-matmul form only
    positions: torch.Tensor | None = None  # [decodes]: ... and in the decode context's rows; ditto
    lengths: torch.Tensor | None = None  # [decodes]: each context's keys; native kernel only
