"""What the engine hands back to the server after each step, per request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprob:
    """Log-probability of one sampled token, with the top alternatives when asked for."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclass
class ChoiceDelta:
    """New output of one choice (one of the request's ``n`` sequences) since the last step."""

    index: int
    text: str  # new text, never containing (a prefix of) a stop string that may still match
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop", "length", "abort" or None while running


@dataclass
class RequestOutput:
    """One step's progress of a request; ``finished`` once every choice has finished."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the radix cache (first admission)
    completion_tokens: int  # across all choices, so far
    deltas: list[ChoiceDelta]
    finished: bool
