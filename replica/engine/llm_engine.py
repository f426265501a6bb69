"""The synchronous engine: requests in, one batched step at a time, outputs out.

It owns the runner (the model, or the simulation's cost model, with the KV pool), the radix
cache and the scheduler, and is driven by a single thread (``AsyncEngine`` runs it beside the
HTTP event loop). torch is imported only by the torch runner, so a simulated replica never
loads it.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvroute.protocol import model_seed
from kvroute.text.tokenizer import TextTokenizer
from replica.engine.config import EngineConfig
from replica.engine.outputs import ChoiceDelta, RequestOutput, TokenLogprob
from replica.engine.sampling_params import SamplingParams
from replica.engine.scheduler import ScheduledBatch, Scheduler, SourceLoad
from replica.engine.sequence import Sequence, SequenceStatus
from replica.engine.stop_text import StopTextTracker
from replica.kvcache.events import KVEventOutbox
from replica.kvcache.manager import KVManager
from replica.kvcache.pool import PagePool
from replica.kvcache.radix_cache import RadixCache
from replica.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvroute.replica")

_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    waiting_prefill_tokens: int
    kv_total_pages: int
    kv_used_pages: int  # pages not free: held by requests or cached
    kv_cache_usage: float  # pages held by requests / total, as vLLM's kv_cache_usage_perc
    cached_pages: int
    evictable_pages: int
    block_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    by_source: dict[str, SourceLoad] = field(default_factory=dict)  # running/waiting per gateway


@dataclass
class _Request:
    request_id: str
    seqs: list[Sequence]
    prompt_tokens: int


class StepModel(Protocol):
    """What a runner computes with: the network (``DecoderLM``) or the simulation's cost model."""

    def weight_bytes(self) -> int: ...


class Runner(Protocol):
    """The engine's one backend-specific part: ``model_runner.ModelRunner`` runs the torch model,
    ``sim.SimRunner`` sleeps for a cost model's step time instead."""

    @property
    def model(self) -> StepModel: ...

    @property
    def pool(self) -> PagePool: ...

    @property
    def description(self) -> str:
        """For the startup log: dtype, device and weights, or that this is a simulation."""
        ...

    def generator(self, seed: int) -> torch.Generator | None:
        """The random stream of one sampling (not greedy) sequence."""
        ...

    def execute(self, batch: ScheduledBatch) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """Computes the batch (advancing ``num_computed``) and picks the next token of every
        sequence whose tokens are now all computed."""
        ...


def read_generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


class LLMEngine:
    def __init__(self, config: EngineConfig, outbox: KVEventOutbox | None = None) -> None:
        model_dir = Path(config.model)
        self.config = config
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = TextTokenizer.from_dir(model_dir)
        self.served_model_name = config.resolved_model_name()
        generation = read_generation_config(model_dir)
        self.generation_defaults = {
            k: generation[k] for k in ("temperature", "top_p", "top_k") if k in generation
        }
        self.eos_token_ids = _eos_ids(generation, self.tokenizer)
        self.runner = self._load_runner()
        self.model = self.runner.model
        self.pool = self.runner.pool
        self.block_seed = model_seed(self.served_model_name, self.tokenizer.fingerprint)
        self.cache = RadixCache(self.pool, self.block_seed, outbox)
        self.kv = KVManager(self.pool, self.cache)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, config.max_prefill_step_tokens
        )
        self.max_model_len = min(
            config.max_model_len or self.model_config.max_position_embeddings,
            self.model_config.max_position_embeddings,
            self.pool.capacity_tokens,
        )
        self._requests: dict[str, _Request] = {}
        self._rng = random.Random(config.seed)
        log.info(
            "model %s (%s, %s); KV pool %d pages x %d tokens = %d tokens; context window %d",
            self.served_model_name,
            self.model_config.architecture,
            self.runner.description,
            self.pool.num_pages,
            self.pool.page_size,
            self.pool.capacity_tokens,
            self.max_model_len,
        )

    def _load_runner(self) -> Runner:
        """The torch model, or with ``engine="sim"`` the cost-model simulation (which loads no
        weights and never imports torch)."""
        if self.config.engine == "sim":
            from replica.sim.runner import SimRunner

            return SimRunner.load(self.config, self.model_config, self.tokenizer, self.eos_token_ids)
        from replica.model.runner import ModelRunner

        return ModelRunner.load(self.config, self.model_config)

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        source: str | None = None,
    ) -> None:
        if request_id in self._requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)}) + max_tokens ({params.max_tokens}) exceeds the "
                f"context window of {self.max_model_len} tokens"
            )
        if max(prompt_token_ids) >= self.model_config.vocab_size or min(prompt_token_ids) < 0:
            raise ValueError(f"token ids must be in [0, {self.model_config.vocab_size})")
        seqs = [self._new_sequence(request_id, i, prompt_token_ids, params, source) for i in range(params.n)]
        for seq in seqs:
            self.scheduler.add(seq)
        self._requests[request_id] = _Request(request_id, seqs, len(prompt_token_ids))

    def _new_sequence(
        self,
        request_id: str,
        index: int,
        prompt: list[int],
        params: SamplingParams,
        source: str | None = None,
    ) -> Sequence:
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            generator = self.runner.generator((seed + index * _SEED_MIX) % 2**63)
        stream = self.tokenizer.decode_stream(skip_special_tokens=params.skip_special_tokens)
        text = StopTextTracker(stream, params.stop)
        return Sequence(request_id, index, prompt, params, generator, text, self.cache.root, source)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request and frees its pages; returns its final output if it was still live."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self._finish(seq, "abort")
        return self._output(request)

    def reset_prefix_cache(self) -> int:
        """Evicts every cached page no running request uses (vLLM's /reset_prefix_cache)."""
        return self.cache.evict(self.cache.evictable_pages)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    # -- stepping -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        sampled = self.runner.execute(batch)
        for seq in self.scheduler.running:
            self.kv.commit(seq)
        touched: dict[str, _Request] = {}
        for seq, token, logprob in sampled:
            self._append_token(seq, token, logprob)
            touched[seq.request_id] = self._requests[seq.request_id]
        outputs = [self._output(request) for request in touched.values()]
        for out in outputs:
            if out.finished:
                del self._requests[out.request_id]
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprob: Any) -> None:
        seq.token_ids.append(token)
        seq.pending_token_ids.append(token)
        if logprob is not None:
            seq.pending_logprobs.append(logprob)
        params = seq.params
        stop_ids = (
            params.stop_token_ids if params.ignore_eos else [*self.eos_token_ids, *params.stop_token_ids]
        )
        if token in stop_ids or seq.text.add_token(token):
            self._finish(seq, "stop")
        elif seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _output(self, request: _Request) -> RequestOutput:
        deltas = []
        for seq in request.seqs:
            if not seq.pending_token_ids and (seq.finish_reason is None or seq.finish_reported):
                continue
            deltas.append(
                ChoiceDelta(
                    index=seq.index,
                    text=seq.text.take_delta(final=seq.is_finished),
                    token_ids=seq.pending_token_ids,
                    logprobs=seq.pending_logprobs if seq.params.logprobs is not None else None,
                    finish_reason=seq.finish_reason,
                )
            )
            seq.pending_token_ids, seq.pending_logprobs = [], []
            seq.finish_reported = seq.is_finished
        return RequestOutput(
            request_id=request.request_id,
            prompt_tokens=request.prompt_tokens,
            cached_tokens=request.seqs[0].num_cached_tokens or 0,
            completion_tokens=sum(seq.num_output_tokens for seq in request.seqs),
            deltas=deltas,
            finished=all(seq.is_finished for seq in request.seqs),
        )

    # -- inspection -----------------------------------------------------------------------------

    def live_sequences(self) -> list[Sequence]:
        return [seq for request in self._requests.values() for seq in request.seqs if not seq.is_finished]

    def check_integrity(self) -> None:
        """free + cached + held by running == total, and the tree's counters agree (tests call it)."""
        self.kv.check_integrity(self.scheduler.running)

    def stats(self) -> EngineStats:
        sched, pool, cache = self.scheduler, self.pool, self.cache
        held = pool.num_pages - pool.num_free - cache.num_cached_pages
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            waiting_prefill_tokens=sched.waiting_prefill_tokens,
            kv_total_pages=pool.num_pages,
            kv_used_pages=pool.num_pages - pool.num_free,
            kv_cache_usage=(held + cache.protected_pages) / pool.num_pages,
            cached_pages=cache.num_cached_pages,
            evictable_pages=cache.evictable_pages,
            block_size=pool.page_size,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=sched.num_preemptions,
            by_source=sched.load_by_source(),
        )


def _eos_ids(generation: dict[str, Any], tokenizer: TextTokenizer) -> list[int]:
    eos = generation.get("eos_token_id")
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [int(eos)]
