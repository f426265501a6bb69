"""Per-request generation settings, already validated by the HTTP layer."""

from __future__ import annotations

from dataclasses import dataclass, field

GREEDY_BELOW = 1e-5
"""Temperatures this small sample the argmax anyway, and dividing logits by them overflows to inf
(NaN probabilities would fail the whole batch): they are greedy, as in vLLM."""


@dataclass
class SamplingParams:
    """What one request asks of the sampler. A temperature under ``GREEDY_BELOW`` means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None  # None: no logprobs; k >= 0: chosen token plus k alternatives
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
