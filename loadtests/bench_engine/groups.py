"""The engine benchmark's measurements, one group per (engine, dtype), run in a worker process
(:mod:`loadtests.bench_engine.worker`): our engine's and transformers ``generate``'s."""

from __future__ import annotations

import gc
import itertools
import random
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtests.bench_engine.settings import (
    DTYPES,
    RSS_BASELINE_FRACTION,
    RSS_NEW_TOKENS,
    RSS_PROMPT_TOKENS,
    RSS_WAVE,
    WARMUP_NEW_TOKENS,
    Settings,
    progress,
)

if TYPE_CHECKING:
    from replica.engine.llm_engine import LLMEngine

MB = 1e6


def random_prompts(rng: random.Random, count: int, length: int, vocab_size: int) -> list[list[int]]:
    """Random token ids: no two prompts share a cache block, so no run gets free prefill."""
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(count)]


def current_rss_mb() -> float:
    """Resident memory now (VmRSS), unlike ru_maxrss, so growth between two moments shows."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / MB
    raise RuntimeError("no VmRSS in /proc/self/status")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / MB  # ru_maxrss is KiB on Linux


def median_time(run: Callable[[], float], repeats: int) -> float:
    return statistics.median(run() for _ in range(repeats))


# -- our engine (worker side) --------------------------------------------------------------------

_request_ids = itertools.count()


def run_ours(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float]]:
    """Submits all prompts at once and steps until done.

    Returns the wall time and the duration of each step after the first token appeared (with
    one prompt, those are the pure decode steps).
    """
    from replica.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(f"r{next(_request_ids)}", prompt, params)
    decode_steps: list[float] = []
    generated = 0
    while engine.has_unfinished():
        step_start = time.perf_counter()
        outputs = engine.step()
        if generated:
            decode_steps.append(time.perf_counter() - step_start)
        generated += sum(len(d.token_ids) for out in outputs for d in out.deltas)
        if any(out.cached_tokens for out in outputs):
            raise RuntimeError("a random prompt hit the prefix cache; the timing would be flattered")
    if generated != len(prompts) * new_tokens:
        raise RuntimeError(f"generated {generated} tokens, expected {len(prompts) * new_tokens}")
    return time.perf_counter() - start, decode_steps


def ours_first_token(engine: LLMEngine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submission to the first generated token, and the prompt tokens served from cache."""
    from replica.engine.sampling_params import SamplingParams

    request_id = f"t{next(_request_ids)}"
    start = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                return time.perf_counter() - start, out.cached_tokens
    raise RuntimeError(f"request {request_id} ended without an output")


def ours_decode(engine: LLMEngine, s: Settings, rng: random.Random, vocab: int) -> dict[str, Any]:
    """Aggregate tok/s per concurrency level; the batch-1 runs also give the per-step decode time."""
    tok_s: dict[str, float] = {}
    batch1_steps: list[float] = []
    for n in s.concurrency:
        progress(f"  decode, {n} concurrent")
        walls = []
        for _ in range(s.repeats):
            wall, steps = run_ours(engine, random_prompts(rng, n, s.prompt_tokens, vocab), s.new_tokens)
            walls.append(wall)
            batch1_steps += steps if n == 1 else []
        tok_s[str(n)] = n * s.new_tokens / statistics.median(walls)
    if not batch1_steps:  # batch 1 was not among the concurrency levels
        batch1_steps = run_ours(engine, random_prompts(rng, 1, s.prompt_tokens, vocab), s.new_tokens)[1]
    return {"decode_tok_s": tok_s, "decode_ms_per_step": 1000 * statistics.median(batch1_steps)}


def ours_ttft(engine: LLMEngine, s: Settings, rng: random.Random, vocab: int) -> dict[str, Any]:
    """Cold TTFT is a request sharing nothing with the cache; it doubles as the primer that puts
    its prefix in the cache, then a request with the same prefix and another tail is timed."""
    progress(f"  TTFT, {s.ttft_prompt_tokens}-token prompt, cold and prefix-cached")
    block = engine.pool.page_size
    prefix_len = (s.ttft_prompt_tokens - 1) // block * block
    cold, cached = [], []
    for _ in range(s.repeats):
        prompt = random_prompts(rng, 1, s.ttft_prompt_tokens, vocab)[0]
        prefix, tail = prompt[:prefix_len], prompt[prefix_len:]
        seconds, hit = ours_first_token(engine, prefix + tail)
        if hit:
            raise RuntimeError(f"the cold request found {hit} tokens cached")
        cold.append(seconds)
        seconds, hit = ours_first_token(engine, prefix + [(t + 1) % vocab for t in tail])
        if hit != prefix_len:
            raise RuntimeError(f"expected {prefix_len} cached tokens, the engine served {hit}")
        cached.append(seconds)
    return {
        "ttft_cold_s": statistics.median(cold),
        "ttft_cached_s": statistics.median(cached),
        "ttft_cached_tokens": prefix_len,
    }


def ours_soak(engine: LLMEngine, s: Settings, rng: random.Random, vocab: int) -> dict[str, Any]:
    """RSS after the first tenth of many short requests and after all of them: growth is a leak."""
    total = s.rss_requests
    baseline_at = max(1, round(total * RSS_BASELINE_FRACTION))
    progress(f"  memory soak, {total} requests in waves of {RSS_WAVE}")
    done, rss_first = 0, 0.0
    while done < total:
        wave = min(RSS_WAVE, (baseline_at if done < baseline_at else total) - done)
        run_ours(engine, random_prompts(rng, wave, RSS_PROMPT_TOKENS, vocab), RSS_NEW_TOKENS)
        done += wave
        if done == baseline_at:
            gc.collect()
            rss_first = current_rss_mb()
    gc.collect()
    return {
        "rss_first_requests": baseline_at,
        "rss_after_first_mb": rss_first,
        "rss_total_requests": total,
        "rss_after_all_mb": current_rss_mb(),
    }


def kv_cache_tokens(s: Settings, block: int) -> int:
    """A pool that holds the largest batch, two long prompts (primer + cached one), or a soak wave."""
    need = max(
        max(s.concurrency) * (s.prompt_tokens + s.new_tokens + block),
        2 * (s.ttft_prompt_tokens + block),
        RSS_WAVE * (RSS_PROMPT_TOKENS + RSS_NEW_TOKENS + block),
    )
    return -(-need // 1024) * 1024


def ours_group(s: Settings, dtype: str) -> dict[str, Any]:
    """Every measurement of our engine, on one engine instance (random prompts keep runs independent)."""
    import torch

    from kvroute.protocol import DEFAULT_BLOCK_SIZE
    from replica.engine.config import EngineConfig
    from replica.engine.llm_engine import LLMEngine

    config = EngineConfig(
        model=Path(s.model),
        dtype=DTYPES[dtype],
        threads=s.threads,
        kv_cache_tokens=kv_cache_tokens(s, DEFAULT_BLOCK_SIZE),
        max_num_seqs=max(EngineConfig.max_num_seqs, *s.concurrency, RSS_WAVE),
    )
    engine = LLMEngine(config)
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    with torch.inference_mode():
        run_ours(engine, random_prompts(rng, max(s.concurrency), s.prompt_tokens, vocab), WARMUP_NEW_TOKENS)
        result = ours_decode(engine, s, rng, vocab)
        result |= ours_ttft(engine, s, rng, vocab)
        result |= ours_soak(engine, s, rng, vocab)
    return result | {
        "weight_bytes": engine.model.weight_bytes(),
        "kv_cache_tokens": engine.pool.capacity_tokens,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "peak_rss_mb": peak_rss_mb(),
    }


# -- transformers ------------------------------------------------------------------------------


def transformers_group(s: Settings, dtype: str) -> dict[str, Any]:
    """The same measurements with ``generate``. It has no per-step hook, so batch-1 ms/step is
    (N-token generate − 1-token generate) / (N − 1), and TTFT is a 1-token generate."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(s.threads)
    hf_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(
        s.model, dtype=getattr(torch, DTYPES[dtype]), attn_implementation="sdpa"
    ).eval()
    vocab = model.config.vocab_size
    pad = model.generation_config.pad_token_id
    pad = model.generation_config.eos_token_id if pad is None else pad
    rng = random.Random(0)

    def generate(count: int, length: int, new_tokens: int) -> float:
        """One greedy ``generate`` over a batch; prompts have equal lengths, so nothing is padded."""
        ids = torch.tensor(random_prompts(rng, count, length, vocab))
        start = time.perf_counter()
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        return time.perf_counter() - start

    with torch.inference_mode():
        generate(max(s.concurrency), s.prompt_tokens, WARMUP_NEW_TOKENS)
        tok_s: dict[str, float] = {}
        for n in s.concurrency:
            progress(f"  decode, {n} concurrent")
            wall = median_time(lambda n=n: generate(n, s.prompt_tokens, s.new_tokens), s.repeats)
            tok_s[str(n)] = n * s.new_tokens / wall
        progress("  batch-1 decode ms/step and TTFT")
        total = median_time(lambda: generate(1, s.prompt_tokens, s.new_tokens), s.repeats)
        prefill = median_time(lambda: generate(1, s.prompt_tokens, 1), s.repeats)
        ttft = median_time(lambda: generate(1, s.ttft_prompt_tokens, 1), s.repeats)
    return {
        "decode_tok_s": tok_s,
        "decode_ms_per_step": 1000 * (total - prefill) / (s.new_tokens - 1),
        "prefill_s": prefill,
        "ttft_cold_s": ttft,
        "peak_rss_mb": peak_rss_mb(),
    }


GROUPS = {"ours": ours_group, "transformers": transformers_group}
