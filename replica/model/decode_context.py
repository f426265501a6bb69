"""The decodes' K/V as the last step gathered them, carried into the next step.

Decode attention reads each sequence's context as one padded row of a contiguous tensor, gathered
from the pool's pages. While the same sequences decode, in the same order, each one token further
over the same number of pages, that tensor differs from the last step's by one token a row: the
step writes those in place of gathering every page again. At batch 16 on a 2-core host the gather
moved, per step, about half as many bytes as the weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DecodeContext:
    """Per layer, the last decode step's gathered K/V [2, kv_heads, decodes * keys, dim], kept
    while all layers' together stay within ``budget_bytes`` (0: never kept, always gathered)."""

    def __init__(self, num_layers: int, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.layers: list[torch.Tensor | None] = [None] * num_layers
        self.carry = False  # this step appends to ``layers`` instead of gathering
        self.keep = False  # this step's gathers are kept for the next
        self.carried_steps = 0  # steps that appended instead of gathering
        self._rows: list[object] = []
        self._lengths: list[int] = []
        self._width = 0
        self._complete = False  # the last step ran through every layer

    def begin(self, rows: Sequence[object], lengths: list[int], width: int, layer_bytes: int) -> None:
        """A step of ``rows`` (the decoding sequences, in order) whose contexts are ``lengths``
        tokens, this one included, over ``width`` pages each."""
        self.carry = (
            self._complete
            and width == self._width
            and len(rows) == len(self._rows)
            and all(a is b for a, b in zip(rows, self._rows, strict=True))
            and all(n == m + 1 for n, m in zip(lengths, self._lengths, strict=True))
        )
        self.carried_steps += self.carry
        self.keep = self.carry or layer_bytes * len(self.layers) <= self.budget_bytes
        if not self.carry:
            self.layers = [None] * len(self.layers)  # the old tensors go before new ones come
        self._rows, self._lengths, self._width = list(rows), lengths, width
        self._complete = False

    def end(self) -> None:
        """The step's forward pass is done: the kept tensors hold its tokens in every layer."""
        self._complete = self.keep

    def clear(self) -> None:
        """No decodes this step: nothing to keep."""
        self.layers = [None] * len(self.layers)
        self._rows, self._lengths, self._complete = [], [], False
