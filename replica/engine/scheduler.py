"""Continuous batching with chunked prefill under a per-step token budget (a larger one while more
prompts wait for their first token than streams for their next: a burst).

Each step: every running decode gets its one token first (so a long prompt never stalls them),
then waiting sequences whose whole uncached tail fits in the rest of the budget less one page
(cache hits, short prompts: they would otherwise wait out every chunk of a long prefill; the page
keeps prefills under way moving), then partially prefilled sequences get chunks, then other
waiting sequences are admitted while there is budget, sequence slots and KV pages. In a step
where such short prefills finish, the chunks after them total no more than their tokens or a
quarter of the budget: the step, and so their time to first token, stays short. When a decode
cannot get a page, the youngest running sequence is preempted: its pages are released (full pages
stay in the prefix cache) and it is recomputed later, usually hitting that cache. A waiting
sequence whose next uncached page a prefill under way is computing (the same tokens up to there)
waits until that page is in the cache: a prefix new to the cache is computed once, and the
choices of an n > 1 request share their prompt's pages. A chunk that would leave a prompt no
more than a sixteenth of the step budget takes that tail too: the step grows by a few per cent,
where the tail would cost the request a whole further step before its first token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from replica.engine.sequence import Sequence, SequenceStatus
from replica.kvcache.manager import KVManager


@dataclass
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk tokens)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)

    def spans(self) -> list[tuple[Sequence, int, int]]:
        """``(sequence, first position, tokens)`` computed this step: the decodes, then the chunks."""
        spans = [(seq, seq.num_computed, 1) for seq in self.decodes]
        return spans + [(seq, seq.num_computed, chunk) for seq, chunk in self.prefills]


@dataclass
class SourceLoad:
    """What one request source (a gateway, named by its ``x-kvroute-gateway`` header) has here."""

    running: int = 0
    waiting: int = 0
    waiting_prefill_tokens: int = 0


def _waiting_prefill(seq: Sequence) -> int:
    """A waiting request whose prefix is cached counts only its uncached tail (as of when it was
    queued), so a replica busy with cache hits does not look as loaded as one with cold prompts."""
    return max(1, seq.num_uncomputed - seq.expected_cached_tokens)


def _running_prefill(seq: Sequence) -> int:
    """What is left of a running sequence's prefill (a decoding one has none)."""
    return seq.num_uncomputed if seq.num_uncomputed > 1 else 0


class Scheduler:
    def __init__(
        self, kv: KVManager, max_num_seqs: int, max_num_batched_tokens: int, max_prefill_step_tokens: int = 0
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.prefill_step_budget = max(max_num_batched_tokens, max_prefill_step_tokens)
        self.tail_slack = max_num_batched_tokens // 16  # a prompt's tail this short goes in its chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is the first to preempt
        self.num_preemptions = 0

    @property
    def waiting_prefill_tokens(self) -> int:
        """Prefill work queued here, in tokens: what gateways weigh against a cache hit."""
        waiting = sum(_waiting_prefill(seq) for seq in self.waiting)
        return waiting + sum(_running_prefill(seq) for seq in self.running)

    def load_by_source(self) -> dict[str, SourceLoad]:
        """The running and waiting sequences (and their prefill tokens) of each named source, so a
        gateway can take its own finished requests out of a heartbeat taken before they finished."""
        loads: dict[str, SourceLoad] = {}
        for seq in self.running:
            if seq.source is not None:
                load = loads.setdefault(seq.source, SourceLoad())
                load.running += 1
                load.waiting_prefill_tokens += _running_prefill(seq)
        for seq in self.waiting:
            if seq.source is not None:
                load = loads.setdefault(seq.source, SourceLoad())
                load.waiting += 1
                load.waiting_prefill_tokens += _waiting_prefill(seq)
        return loads

    def add(self, seq: Sequence) -> None:
        self._queue(seq, self.waiting.append)

    def _queue(self, seq: Sequence, put: Callable[[Sequence], None]) -> None:
        seq.expected_cached_tokens = self.kv.cache.cached_prefix_tokens(seq.token_ids)
        put(seq)

    def remove(self, seq: Sequence) -> None:
        """Takes a finished or aborted sequence out and frees its pages."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv.commit(seq)
            self.kv.release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> ScheduledBatch:
        while True:
            batch = ScheduledBatch()
            budget = self._schedule_decodes(batch, self.token_budget)
            if self._burst(len(batch.decodes)):
                budget += self.prefill_step_budget - self.token_budget
            # Requests whose whole uncached tail fits in this step (cache hits, short prompts) go
            # before the next chunk of a long prefill: a hit would otherwise wait out the long one.
            # One page of the step stays for prefills under way, so a stream of hits cannot
            # starve them: each advances at least a page per step.
            reserve = min(budget, self.kv.page_size) if self._prefill_under_way() else 0
            left = self._admit_waiting(batch, budget - reserve, fitting_only=True) + reserve
            # A step that gives those their first token stays short: the other prefills get at
            # most as many tokens as they take, or a quarter of the budget (so a stream of hits
            # slows a long prompt by a bounded share), and a hit that lands while a long prompt
            # prefills waits out a short step, not a whole chunk of the long one.
            finishing = budget - left
            if finishing:
                left = min(left, max(reserve, finishing, self.token_budget // 4))
            budget = self._schedule_prefill_chunks(batch, left)
            self._admit_waiting(batch, budget)
            if batch or len(self.running) < 2:
                return batch
            # Every running sequence is mid-prefill and none can get a page: preempt the youngest
            # so the others can move (one sequence alone always fits: the context window is capped
            # by the pool).
            self._preempt(self.running[-1])

    def _burst(self, decodes: int) -> bool:
        """More prompts wait for their first token than streams for their next, two at least:
        such a step takes the larger budget, so a burst goes in fewer, larger steps (each reads
        the weights once) while few streams wait on it. A prompt alone keeps the short step,
        which is all that a request arriving meanwhile (a chat's next turn) then waits out."""
        prefilling = len(self.waiting) + sum(seq.num_uncomputed > 1 for seq in self.running)
        return prefilling > max(1, decodes)

    def _prefill_under_way(self) -> bool:
        return any(seq.num_uncomputed > 1 for seq in self.running)

    def _schedule_decodes(self, batch: ScheduledBatch, budget: int) -> int:
        for seq in [s for s in self.running if s.num_uncomputed == 1]:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            while not self.kv.reserve(seq, seq.num_computed + 1):
                victim = self._youngest_unscheduled(batch)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.decodes.append(seq)
                budget -= 1
        return budget

    def _schedule_prefill_chunks(self, batch: ScheduledBatch, budget: int) -> int:
        admitted = {id(seq) for seq, _ in batch.prefills}  # this step's admissions have their chunk
        for seq in [s for s in self.running if s.num_uncomputed > 1 and id(s) not in admitted]:
            if budget == 0:
                break
            chunk = self._fit_chunk(seq, self._wanted_chunk(seq, budget))
            if chunk:
                batch.prefills.append((seq, chunk))
                budget = max(0, budget - chunk)
        return budget

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, fitting_only: bool = False) -> int:
        """Admits waiting sequences in arrival order while budget, slots and pages last; with
        ``fitting_only``, only those expected to finish their prefill within ``budget``. One whose
        next uncached page a prefill under way is computing waits for it to reach the cache."""
        prefilling = [seq for seq in self.running if seq.num_uncomputed > 1]
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if fitting_only and not self._finishes(seq.num_uncomputed - seq.expected_cached_tokens, budget):
                continue
            if prefilling and self._prefix_under_way(seq, prefilling):
                continue
            self.kv.admit(seq)
            chunk = self._fit_chunk(seq, self._wanted_chunk(seq, budget))
            if not chunk:
                self.kv.release(seq)
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.prefills.append((seq, chunk))
            prefilling.append(seq)  # its pages reach the cache after this step: not for others in it
            budget = max(0, budget - chunk)
        return budget

    def _prefix_under_way(self, seq: Sequence, prefilling: list[Sequence]) -> bool:
        """Whether one of ``prefilling`` has yet to compute the page that follows what the cache
        holds of ``seq``'s prompt, and shares every token up to that page's end: two requests with
        one new long prefix arriving together compute it once, the second taking it from the cache
        (admitted beside the first, it would compute the same pages again in the same steps)."""
        size = self.kv.page_size
        sharing = [other for other in prefilling if other.token_ids[:size] == seq.token_ids[:size]]
        if not sharing:  # the usual case, told without walking the cache
            return False
        end = self.kv.cache.cached_prefix_tokens(seq.token_ids) + size
        if end > len(seq.token_ids) - 1:
            return False  # that page would not be taken from the cache: admission leaves a token
        head = seq.token_ids[:end]
        return any(
            other.num_computed < end <= len(other.token_ids) and other.token_ids[:end] == head
            for other in sharing
        )

    def _finishes(self, left: int, budget: int) -> bool:
        """Whether a prompt with ``left`` tokens to compute takes them all in a step with ``budget``
        tokens to give: up to ``tail_slack`` over it. Eight 128-token prompts in a 1,024-token step
        beside one decode would otherwise leave the eighth a single token, and its first token a
        whole step later."""
        return left <= budget + self.tail_slack

    def _wanted_chunk(self, seq: Sequence, budget: int) -> int:
        """All that is left of the prompt where it finishes in this step, else ``budget`` tokens."""
        left = seq.num_uncomputed
        return left if self._finishes(left, budget) else budget

    def _fit_chunk(self, seq: Sequence, wanted: int) -> int:
        """The largest chunk up to ``wanted`` tokens whose pages can be had without preempting."""
        size = self.kv.page_size
        pages_held = len(seq.page_table)
        free_tokens = (pages_held + self.kv.available_pages()) * size - seq.num_computed
        chunk = min(wanted, free_tokens)
        if chunk <= 0 or not self.kv.reserve(seq, seq.num_computed + chunk):
            return 0
        return chunk

    def _youngest_unscheduled(self, batch: ScheduledBatch) -> Sequence:
        scheduled = {id(s) for s in batch.decodes}
        return next(s for s in reversed(self.running) if id(s) not in scheduled)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.commit(seq)
        self.kv.release(seq)
        seq.status = SequenceStatus.WAITING
        self._queue(seq, self.waiting.appendleft)
        self.num_preemptions += 1
