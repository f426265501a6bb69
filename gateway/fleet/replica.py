"""One replica as this gateway knows it: the record every question about a replica is answered from.

Where it came from (its heartbeat while Redis lists it, else what its ``--replica URL`` answered),
whether it may be routed to (ejected after failures, drained), how loaded it is from this
gateway's side (its requests in flight here), and what the requests sent to it showed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway.index.snapshots import ReplicaHeartbeat
from kvroute.text.prompt_ids import PromptIds


@dataclass(frozen=True, slots=True)
class StaticReplica:
    """What a ``--replica URL`` answered at its last discovery (``gateway.health``)."""

    url: str
    model: str
    fingerprint: str
    block_size: int


@dataclass
class ReplicaStats:
    """What the gateway learned from the requests it sent one replica (``GET /admin/replicas``).

    The usage figures cover the answers whose usage came back (``usage_reports`` of ``requests``),
    so predicted and real cached tokens compare like for like.
    """

    requests: int = 0
    usage_reports: int = 0
    prompt_tokens: int = 0
    predicted_cached_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, what the replica really reused


class Watched(Protocol):
    """An answer under way from a replica (``gateway.proxy.connection.UpstreamResponse``)."""

    def abandon(self, why: str) -> None:
        """Gives it up: ``why`` is the failure its reader sees."""

    def flowing(self, within_s: float) -> bool:
        """Whether its body bytes came within the last ``within_s`` seconds, and more may come."""


@dataclass
class InFlight:
    sent_at: float  # unix time, comparable with heartbeat ``ts``
    uncached_tokens: int  # prefill still to do, as far as this gateway knows (0 once it is seen done)
    sequences: int  # engine sequences it makes: prompts x n
    last_block: int | None = None  # its prompt's last full block hash (None: shorter than a block)
    prompt_key: tuple[int, int] | None = None  # its prompt's length and digest (PromptIds.digest)


class Flights:
    """One replica's requests in flight from this gateway, with running totals (kept as requests
    come and go, so routing reads them in O(1)): all of them, and those sent after ``since``, the
    time of the heartbeat last asked about. Also the requests it answered lately (``answered``),
    whose conversations' next turns may be on their way."""

    __slots__ = (
        "answered",
        "flights",
        "pending",
        "pending_tokens",
        "prefilling",
        "sequences",
        "since",
        "tokens",
    )

    def __init__(self) -> None:
        self.flights: dict[int, InFlight] = {}  # by ticket
        self.prefilling: set[int] = set()  # tickets whose prefill is not yet seen over
        # the prompt (length, digest) of each request answered lately -> when (monotonic), and how
        # many leading tokens of its conversation the replica holds now (prompt and answer)
        self.answered: dict[tuple[int, int], tuple[float, int]] = {}
        self.sequences = 0
        self.tokens = 0
        self.since = 0.0
        self.pending = 0
        self.pending_tokens = 0

    def add(self, ticket: int, flight: InFlight) -> None:
        self.flights[ticket] = flight
        if flight.last_block is not None and flight.uncached_tokens:
            self.prefilling.add(ticket)
        self.count(flight, 1)

    def remove(self, ticket: int, completion_tokens: int = 0) -> None:
        """The request is over; ``completion_tokens``: what its answer generated (its usage), all of
        which but the last token the replica has cached after the prompt."""
        self.prefilling.discard(ticket)
        flight = self.flights.pop(ticket)
        self.count(flight, -1)
        if flight.prompt_key is not None:
            length = flight.prompt_key[0]
            answer = completion_tokens // max(1, flight.sequences)
            self.answered[flight.prompt_key] = (time.monotonic(), length + max(0, answer - 1))

    def settle_prefills(self, holds: Callable[[int], bool]) -> None:
        """Stops counting the prefill of every request whose last full prompt block the replica's
        events have stored (``holds``): its prefill is over, though the heartbeat that says so may
        be a second away. Without this, a whole (unstreamed) request sent just before a chat's next
        turn weighed its full prompt on its replica until it ended, and the next turn could leave."""
        if not self.prefilling:  # the usual case on the routing path: nothing to look up
            return
        for ticket in list(self.prefilling):
            flight = self.flights[ticket]
            if flight.last_block is not None and holds(flight.last_block):
                self.prefilling.discard(ticket)
                self.count(flight, -1)
                flight.uncached_tokens = 0
                self.count(flight, 1)

    def awaited(self, prompt: PromptIds, within_s: float) -> tuple[int, int]:
        """Requests answered here in the last ``within_s`` seconds whose conversations may send
        their next turn here, other than those ``prompt`` continues (it starts with their whole
        prompt); and, where it continues one, how many of its leading tokens the replica holds from
        that answer (else 0). Without the first, a replica that has just answered a chat looks
        idle, and another chat's first turn can take the place the next turn needs. The second is
        the cache the next turn finds here before the replica's events of the answer reach this
        gateway: counting only the last prompt's blocks, a short history matches little more here
        than its template opening does elsewhere, and a co-running request on this replica sends
        the next turn away."""
        if not self.answered:
            return 0, 0
        horizon = time.monotonic() - within_s
        for key in [key for key, (at, _) in self.answered.items() if at < horizon]:
            del self.answered[key]
        held = [tokens for key, (_, tokens) in self.answered.items() if _continues(prompt, key)]
        return len(self.answered) - len(held), min(max(held, default=0), len(prompt))

    def returned(self, prompt: PromptIds) -> None:
        """Forgets the answered requests ``prompt`` continues: their next turn has come."""
        for key in [key for key in self.answered if _continues(prompt, key)]:
            del self.answered[key]

    def count(self, flight: InFlight, sign: int) -> None:
        """Adds (sign 1) or takes away (-1) one flight in the totals."""
        self.sequences += sign * flight.sequences
        self.tokens += sign * flight.uncached_tokens
        if flight.sent_at > self.since:
            self.pending += sign * flight.sequences
            self.pending_tokens += sign * flight.uncached_tokens

    def since_heartbeat(self, ts: float) -> tuple[int, int]:
        """Sequences sent after the heartbeat stamped ``ts``, and their uncached tokens."""
        if ts != self.since:
            self.since = ts
            later = [flight for flight in self.flights.values() if flight.sent_at > ts]
            self.pending = sum(flight.sequences for flight in later)
            self.pending_tokens = sum(flight.uncached_tokens for flight in later)
        return self.pending, self.pending_tokens


class Replica:
    """One replica id's record (:class:`gateway.fleet.fleet.Fleet` keeps one per id it has heard of).

    ``url``, ``model``, ``fingerprint`` and ``block_size`` are its heartbeat's while Redis lists it
    (``heartbeat``), else those its ``--replica URL`` answered (``static``).
    """

    __slots__ = (
        "block_size",
        "drained",
        "ejected_url",
        "failures",
        "fingerprint",
        "flights",
        "heartbeat",
        "model",
        "replica_id",
        "static",
        "stats",
        "url",
        "watched",
    )

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.url = ""
        self.model = ""
        self.fingerprint = ""
        self.block_size = 0
        self.heartbeat: ReplicaHeartbeat | None = None  # its last one, while Redis lists it
        self.static: StaticReplica | None = None  # what its --replica URL answered, while it answers
        self.failures = 0  # in a row
        self.ejected_url: str | None = None  # where to probe it while it is ejected
        self.drained = False  # through any gateway (shared in Redis), or through this one
        self.flights = Flights()
        self.stats = ReplicaStats()
        self.watched: set[Watched] = set()  # answers waiting on or streaming from it (``Fleet.watch``)

    @property
    def source(self) -> str:
        """``redis`` while Redis lists it, else ``static`` (a ``--replica URL``)."""
        return "static" if self.heartbeat is None else "redis"

    @property
    def tokenizer_url(self) -> str:
        """Where its ``GET /kvroute/tokenizer`` is: a vLLM server's bridge names itself."""
        heartbeat = self.heartbeat
        if heartbeat is None or heartbeat.tokenizer_url is None:
            return self.url
        return heartbeat.tokenizer_url

    @property
    def takes_prompt_ids(self) -> bool:
        """Whether it serves a request's ``kvroute_prompt_ids`` (kvroute.protocol.PROMPT_IDS_FIELD):
        a kvroute replica does; a vLLM server, whose bridge names the tokenizer's URL apart from
        the server's, would ignore them."""
        return self.tokenizer_url == self.url

    @property
    def ejected(self) -> bool:
        return self.ejected_url is not None

    @property
    def inflight(self) -> int:
        """This gateway's requests in flight there."""
        return len(self.flights.flights)

    def describe(self) -> None:
        """Takes url, model, fingerprint and block size from its heartbeat, else its discovery."""
        found = self.heartbeat or self.static
        if found is not None:
            self.url, self.model = found.url, found.model
            self.fingerprint, self.block_size = found.fingerprint, found.block_size


def _continues(prompt: PromptIds, answered: tuple[int, int]) -> bool:
    """Whether ``prompt`` starts with the answered prompt of this (length, digest)."""
    length, digest = answered
    return len(prompt) >= length and prompt.digest(length) == digest
