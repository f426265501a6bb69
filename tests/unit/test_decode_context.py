"""Decode K/V carried from step to step (``replica/model/decode_context.py``) computes exactly what
gathering every step computes, while the decoding set holds, changes, pauses, crosses page
boundaries and shares steps with prefill chunks; and it is really carried, not always gathered.

That is the batched-matmul form of decode attention, which runs where the fused native kernel
does not (CUDA, fp16, no C++ compiler): these tests switch the kernels off."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from replica.engine.llm_engine import LLMEngine
from replica.engine.scheduler import ScheduledBatch
from replica.engine.sequence import Sequence
from replica.model import native
from replica.model.decode_context import DecodeContext
from tests.conftest import EngineFactory
from tests.unit.test_engine_logits import assert_close, random_prompt, reference_logits, run_chunk, start

# Which of the sequences (by their prompt's index) decode at each step; "+4" prefills prompt 4's
# first 20 tokens in the same step, "+4!" the rest of it.
SCHEDULE = [[0, 1, 2]] * 9 + [[0, 2]] * 3 + [[0, 1, 2]] * 2 + [[0, 1, 2, 3]] * 4 + [[1, 3]] * 2
MIXED = {5: (4, 20), 13: (4, None)}  # step -> (prompt, chunk end; None: the whole prompt)
PROMPT_LENGTHS = (40, 63, 17, 5, 50)


@pytest.fixture(autouse=True)
def batched_matmul_decode(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    native.kernels.cache_clear()
    yield
    native.kernels.cache_clear()


def decode(engine: LLMEngine, steps: int) -> tuple[list[Sequence], list[torch.Tensor]]:
    """Runs SCHEDULE with random next tokens; returns the sequences and every step's logits."""
    seqs = [start(engine, random_prompt(n, seed=n)) for n in PROMPT_LENGTHS]
    for seq in seqs[:4]:
        run_chunk(engine, seq, len(seq.token_ids))
    generator = torch.Generator().manual_seed(3)
    every_step = []
    for step, rows in enumerate(SCHEDULE[:steps]):
        decodes = [seqs[i] for i in rows]
        for seq in decodes:
            seq.token_ids.append(int(torch.randint(0, 450, (1,), generator=generator)))
            assert engine.kv.reserve(seq, len(seq.token_ids))
        prefills = []
        if step in MIXED:
            index, end = MIXED[step]
            seq = seqs[index]
            end = end or len(seq.token_ids)
            assert engine.kv.reserve(seq, end)
            prefills.append((seq, end - seq.num_computed))
        _, logits = engine.runner.run(ScheduledBatch(decodes=decodes, prefills=prefills))
        every_step.append(logits[: len(decodes)])
        for seq in decodes + [p[0] for p in prefills]:
            engine.kv.commit(seq)
    return seqs, every_step


def test_carried_context_equals_gathered_every_step(llama_dir: Path, make_engine: EngineFactory) -> None:
    carried = make_engine(llama_dir)
    gathered = make_engine(llama_dir, decode_context_mb=0)
    seqs, carried_logits = decode(carried, len(SCHEDULE))
    _, gathered_logits = decode(gathered, len(SCHEDULE))
    for step, (a, b) in enumerate(zip(carried_logits, gathered_logits, strict=True)):
        assert torch.equal(a, b), f"step {step} differs"
    context = carried.runner._decode_context
    assert context.carried_steps >= 10, "most steps of an unchanged decoding set carry over"
    assert gathered.runner._decode_context.carried_steps == 0
    for row, seq in enumerate(seqs[i] for i in SCHEDULE[-1]):
        assert_close(carried_logits[-1][row], reference_logits(llama_dir, seq.token_ids)[-1])
    carried.check_integrity()


def test_a_budget_too_small_gathers_every_step(llama_dir: Path, make_engine: EngineFactory) -> None:
    engine = make_engine(llama_dir, decode_context_mb=0.001)  # 1 kB: less than one layer's rows
    _, logits = decode(engine, 9)
    assert engine.runner._decode_context.carried_steps == 0
    assert all(torch.isfinite(step).all() for step in logits)


def test_carry_only_when_every_row_advanced_one_token() -> None:
    """The rules on their own: same rows in the same order, each one token on, same width, the
    last step complete and kept."""
    a, b = object(), object()
    context = DecodeContext(num_layers=2, budget_bytes=1000)

    def step(rows: list[object], lengths: list[int], width: int = 2, layer_bytes: int = 100) -> bool:
        context.begin(rows, lengths, width, layer_bytes)
        carry = context.carry
        context.end()
        return carry

    assert not step([a, b], [10, 20])  # nothing yet
    assert step([a, b], [11, 21])
    assert not step([a, b], [12, 23]), "b skipped a token"
    assert not step([b, a], [24, 13]), "another order"
    assert not step([b, a], [25, 14], width=3), "another width"
    assert step([b, a], [26, 15], width=3)
    context.begin([b, a], [27, 16], 3, 100)  # a step that failed before end()
    assert not step([b, a], [28, 17], width=3)
    assert not step([b, a], [29, 18], width=4, layer_bytes=600), "another width, over budget..."
    assert not step([b, a], [30, 19], width=4, layer_bytes=600), "...so it was not kept"
    assert not step([b, a], [31, 20], width=5)
    assert step([b, a], [32, 21], width=5)
    context.clear()
    assert not step([b, a], [33, 22], width=5)
