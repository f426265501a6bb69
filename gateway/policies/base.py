"""The routing-policy interface: what a policy sees of each replica, and what it answers.

Pure and I/O-free: the gateway builds one :class:`Candidate` per healthy replica of the requested
model (cache match from its index, load from the replica's last heartbeat corrected for the
gateway's own requests since) and asks a :class:`Policy` to :meth:`~Policy.choose`. Every
:class:`Decision` carries a :class:`Score` per candidate so the admin ``/route`` endpoint can
explain it.

Shared by every policy:

* ``load(r) = waiting_prefill_tokens + inflight_prefill_tokens
  + decode_weight · (running + waiting + inflight + returning)``, in prefill-token units
  (see :data:`DEFAULT_DECODE_WEIGHT`; ``returning``: conversations it answered moments ago, whose
  next turns are likely on their way, other than the request's own);
* a hard queue cap ``max_queue`` on ``waiting + inflight``: a candidate at or above it is never
  chosen (its score has ``capped=True`` and ``cost=inf``); when every candidate is capped the
  decision's ``replica_id`` is ``None`` and the gateway answers 429/503;
* ties are broken by the policy's own further keys, then at random (an injectable
  ``random.Random``), never by list position.

Only stdlib here: the gateway must never import torch.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

DEFAULT_LAM = 1.0
"""Weight of load against uncached prefill tokens in the ``kv`` cost (both in token units)."""

DEFAULT_DECODE_WEIGHT = 64.0
"""Prefill tokens one sequence in a replica's batch (running, waiting or in flight) is worth.

A newcomer's time to first token grows with the prefill work queued ahead of it (counted exactly,
in tokens) and with the decodes sharing each engine step: with chunked prefill every running
sequence takes a slot of each step's token budget and adds its attention over its context, for
every step the newcomer's prefill spans and for the many steps it keeps decoding afterwards. An
order-of-magnitude estimate puts one co-running sequence at a few dozen prefill tokens; 64 (four
16-token blocks) is chosen because

* without a per-sequence term a replica with 60 decodes running and nothing waiting looks idle;
* it stays small against the prefixes worth keeping (1–4k-token system prompts and chat
  histories are worth 16–64 extra sequences of queue before recomputing them elsewhere wins), so
  multi-turn affinity holds, yet a hot prefix spreads once its holder's queue is deep enough.

It is a setting: the policy-comparison benchmark is the place to tune it per hardware profile.
"""

DEFAULT_MAX_QUEUE: int | None = None
"""No cap by default (the gateway passes its ``--max-queue`` setting)."""

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Candidate:
    """One healthy replica of the requested model, as the gateway sees it now."""

    replica_id: str
    cached_blocks: int  # leading prompt blocks the index says it holds (confirmed by its events)
    # leading blocks counting the gateway's own predictions (>= cached_blocks): prompts it routed
    # there, and the answer there to the conversation this request continues
    predicted_blocks: int
    # From its last heartbeat, less this gateway's requests that finished since (gateway.routing):
    waiting_prefill_tokens: int
    running: int  # sequences running
    waiting: int  # sequences waiting
    inflight: int  # requests this gateway sent it since that heartbeat and not finished
    inflight_prefill_tokens: int  # their uncached prompt tokens
    cache_comparable: bool = True  # False: its tokenizer fingerprint differs, cache counts mean nothing
    returning: int = 0  # requests it answered moments ago, whose next turns may come (not this one's)
    continues: bool = False  # this request continues one it answered moments ago (a chat's next turn)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    model: str
    prompt_tokens: int
    block_size: int
    session_id: str | None = None  # from the x-session-id header


@dataclass(frozen=True, slots=True)
class Score:
    """One candidate's numbers behind a decision (printed by the admin ``/route`` endpoint).

    ``cost`` is ``inf`` for a candidate excluded by the queue cap (``capped``); policies other than
    ``kv``/``session`` report ``cost == load``.
    """

    replica_id: str
    matched_tokens: int
    load: float
    cost: float
    capped: bool = False
    continues: bool = False  # a chat's next turn, here where its last turn was answered: wins ties


@dataclass(frozen=True, slots=True)
class Decision:
    replica_id: str | None  # None: every candidate is over its queue cap (the gateway answers 429/503)
    scores: list[Score]
    policy: str


# -- shared arithmetic ------------------------------------------------------------------------------


def matched_tokens(request: RouteRequest, candidate: Candidate) -> int:
    """Prompt tokens the candidate is expected to serve from cache (predictions included)."""
    if not candidate.cache_comparable:
        return 0
    blocks = max(candidate.predicted_blocks, candidate.cached_blocks)
    return max(0, min(blocks * request.block_size, request.prompt_tokens))


def candidate_load(candidate: Candidate, decode_weight: float) -> float:
    """Queued prefill tokens plus ``decode_weight`` per sequence (and per conversation whose next
    turn is expected), in prefill-token units."""
    sequences = candidate.running + candidate.waiting + candidate.inflight + candidate.returning
    return candidate.waiting_prefill_tokens + candidate.inflight_prefill_tokens + decode_weight * sequences


def is_capped(candidate: Candidate, max_queue: int | None) -> bool:
    return max_queue is not None and candidate.waiting + candidate.inflight >= max_queue


def pick_lowest(rng: random.Random, items: Sequence[tuple[tuple[float, ...], str]]) -> str:
    """The id of the item with the lowest keys (``(keys, id)``: the first key, among equals the
    next, and so on), then uniformly at random."""
    tied = list(items)
    for index in range(len(tied[0][0])):
        best = min(keys[index] for keys, _ in tied)
        tied = [item for item in tied if item[0][index] <= best + _EPS * max(1.0, abs(best))]
    return tied[0][1] if len(tied) == 1 else rng.choice(tied)[1]


class Policy(ABC):
    """Chooses one replica for a request; stateless except where rotation or randomness needs it.

    Every policy takes the same settings, so the gateway can pass one settings dict whichever
    policy it runs (``lam`` only matters to ``kv`` and ``session``'s fallback).
    """

    name: ClassVar[str]
    needs_index: ClassVar[bool] = True  # False: it ignores the cache, and routes as configured without Redis

    def __init__(
        self,
        *,
        lam: float = DEFAULT_LAM,
        decode_weight: float = DEFAULT_DECODE_WEIGHT,
        max_queue: int | None = DEFAULT_MAX_QUEUE,
        rng: random.Random | None = None,
    ) -> None:
        if lam < 0 or decode_weight < 0:
            raise ValueError("lam and decode_weight must be >= 0")
        if max_queue is not None and max_queue < 1:
            raise ValueError("max_queue must be >= 1 (or None for no cap)")
        self.lam = float(lam)
        self.decode_weight = float(decode_weight)
        self.max_queue = max_queue
        self.rng = rng if rng is not None else random.Random()

    @abstractmethod
    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision: ...

    def load_scores(self, request: RouteRequest, candidates: Sequence[Candidate]) -> list[Score]:
        """Scores with ``cost == load`` (``inf`` when capped), for the policies that ignore the cache."""
        scores = []
        for c in candidates:
            load = candidate_load(c, self.decode_weight)
            capped = is_capped(c, self.max_queue)
            scores.append(
                Score(c.replica_id, matched_tokens(request, c), load, math.inf if capped else load, capped)
            )
        return scores
