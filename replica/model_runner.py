"""Turns a scheduled batch into tensors, runs the model, and returns the logits to sample from."""

from __future__ import annotations

import torch

from replica.attention import AttentionBatch, PrefillSpan, bottom_right_causal_mask
from replica.kv_pool import KVPool
from replica.model import DecoderLM
from replica.scheduler import ScheduledBatch
from replica.sequence import Sequence


class ModelRunner:
    def __init__(self, model: DecoderLM, pool: KVPool, device: str) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.page_size = pool.page_size
        self._page_offsets = torch.arange(pool.page_size, device=device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[list[Sequence], torch.Tensor]:
        """Computes this step's tokens; returns the sequences that sample and their logits [S, vocab]."""
        spans = [(seq, seq.num_computed, 1) for seq in batch.decodes]
        spans += [(seq, seq.num_computed, chunk) for seq, chunk in batch.prefills]
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

    def _slots(self, page_table: list[int] | torch.Tensor) -> torch.Tensor:
        """Every slot of these pages, in order: [pages * page_size] (or batched: [..., slots])."""
        pages = torch.as_tensor(page_table, device=self.device)
        return (pages.unsqueeze(-1) * self.page_size + self._page_offsets).flatten(-2)

    def _attention_batch(
        self,
        batch: ScheduledBatch,
        spans: list[tuple[Sequence, int, int]],
    ) -> AttentionBatch:
        size = self.page_size
        decode_slots = decode_mask = None
        slot_parts: list[torch.Tensor] = []
        if batch.decodes:
            lengths = torch.tensor([seq.num_computed + 1 for seq in batch.decodes], device=self.device)
            longest = int(lengths.max())
            width = -(-longest // size)
            table = [(seq.page_table + [0] * width)[:width] for seq in batch.decodes]
            decode_slots = self._slots(table)[:, :longest]
            slot_parts.append(decode_slots.gather(1, (lengths - 1).unsqueeze(1)).squeeze(1))
            if int(lengths.min()) != longest:
                valid = torch.arange(longest, device=self.device).unsqueeze(0) < lengths.unsqueeze(1)
                decode_mask = valid[:, None, None, :]
        prefills: list[PrefillSpan] = []
        flat = len(batch.decodes)
        for seq, start, length in spans[len(batch.decodes) :]:
            context = start + length
            slots = self._slots(seq.page_table[: -(-context // size)])[:context]
            slot_parts.append(slots[start:])
            if start == 0:
                prefills.append(PrefillSpan(flat, length, None, None))
            else:
                mask = bottom_right_causal_mask(length, context, self.device)
                prefills.append(PrefillSpan(flat, length, slots, mask))
            flat += length
        slot_mapping = torch.cat(slot_parts) if len(slot_parts) > 1 else slot_parts[0]
        return AttentionBatch(slot_mapping, len(batch.decodes), decode_slots, decode_mask, prefills)
