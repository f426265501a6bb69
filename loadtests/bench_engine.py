"""Our replica engine against transformers ``generate`` on the same model, dtype and cores.

Measures, per dtype: aggregate decode tok/s at several concurrency levels, time to first token
for a long prompt cold and with its prefix cached, batch-1 ms/step against the memory-bandwidth
floor, and memory (peak RSS, and RSS across many short requests, to catch leaks).

Each (engine, dtype) group runs in its own subprocess (this module with the hidden ``--worker``
flag), one at a time: the groups never compete for the cores, and each peak RSS belongs to one
engine only. The parent only measures memory bandwidth, then collects, checks and prints.

Full run (minutes; run it on a quiet machine)::

    python -m loadtests.bench_engine

``--quick`` shrinks every size for a smoke run (the test uses it on a tiny model).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import random
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtests.report import cpu_model, package_version, publish, warn_if_busy
from loadtests.report import progress as log_progress

if TYPE_CHECKING:
    from replica.engine.llm_engine import LLMEngine

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
ENGINES = ("ours", "transformers")

# Sizes of a full run and of a --quick smoke run; explicit options override either.
FULL = {
    "concurrency": "1,8,16",
    "new_tokens": 64,
    "prompt_tokens": 128,
    "ttft_prompt_tokens": 2000,
    "rss_requests": 1000,
    "repeats": 3,
    "bandwidth_mib": 1024,
}
QUICK = {
    "concurrency": "1,4",
    "new_tokens": 8,
    "prompt_tokens": 32,
    "ttft_prompt_tokens": 128,
    "rss_requests": 40,
    "repeats": 1,
    "bandwidth_mib": 64,
}

# The memory soak: many short requests in waves; RSS after the first tenth is the baseline.
RSS_PROMPT_TOKENS = 32
RSS_NEW_TOKENS = 4
RSS_WAVE = 32
RSS_BASELINE_FRACTION = 0.1
RSS_NOISE_MB = 10.0  # growth allowed: this, or RSS_NOISE_FRACTION of the baseline if larger
RSS_NOISE_FRACTION = 0.02

# Targets (ratios).
DECODE_SPEEDUP_TARGET = 2.0  # ours / transformers tok/s at the highest concurrency
TTFT_CACHE_SPEEDUP_TARGET = 20.0  # cold / cached-prefix TTFT
FLOOR_RATIO_TARGET = 2.0  # batch-1 ms/step / bandwidth floor

WARMUP_NEW_TOKENS = 2
BANDWIDTH_TRIES = 5
MB = 1e6


@dataclass
class Settings:
    """Resolved options; travels to each worker as JSON."""

    model: str
    dtypes: list[str]
    concurrency: list[int]
    new_tokens: int
    prompt_tokens: int
    ttft_prompt_tokens: int
    rss_requests: int
    repeats: int
    bandwidth_mib: int
    threads: int
    skip_transformers: bool
    out: str


# -- helpers shared by both sides ----------------------------------------------------------------


def progress(message: str) -> None:
    log_progress("bench_engine", message)


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


# -- transformers (worker side) ------------------------------------------------------------------


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


def worker(task: dict[str, Any]) -> None:
    """Subprocess side: one group, results to a file (stdout may carry library chatter)."""
    settings = Settings(**task["settings"])
    result = GROUPS[task["engine"]](settings, task["dtype"])
    Path(task["result_path"]).write_text(json.dumps(result))


# -- parent: orchestration -----------------------------------------------------------------------


def run_group(s: Settings, engine: str, dtype: str, workdir: Path) -> dict[str, Any]:
    """Runs one (engine, dtype) group in a fresh interpreter and returns its measurements."""
    progress(f"{engine} {dtype}: starting worker")
    result_path = workdir / f"{engine}-{dtype}.json"
    task = {"settings": asdict(s), "engine": engine, "dtype": dtype, "result_path": str(result_path)}
    env = os.environ | {
        "OMP_NUM_THREADS": str(s.threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    command = [sys.executable, "-m", "loadtests.bench_engine", "--worker", json.dumps(task)]
    subprocess.run(command, env=env, stdout=2, check=True)  # worker chatter stays off our stdout
    return json.loads(result_path.read_text())


def measure_read_bandwidth(mib: int, threads: int) -> float:
    """Bytes/s that ``threads`` torch threads read from a float32 tensor far larger than the caches.

    Batch-1 decode must stream every weight once per step with those same threads, so weights /
    this is its floor (a single-threaded numpy sum reads about half as fast here).
    """
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(BANDWIDTH_TRIES):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * data.element_size() / best


def machine_info(threads: int) -> dict[str, Any]:
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": package_version("torch"),
        "transformers": package_version("transformers"),
        "python": platform.python_version(),
    }


# -- parent: checks and table ---------------------------------------------------------------------


def rss_allowance_mb(baseline_mb: float) -> float:
    return max(RSS_NOISE_MB, RSS_NOISE_FRACTION * baseline_mb)


def derive(ours: dict[str, Any], theirs: dict[str, Any] | None, bandwidth: float) -> dict[str, Any]:
    """Ratios from one dtype's measurements; the comparisons are None when transformers was skipped."""
    floor_ms = 1000 * ours["weight_bytes"] / bandwidth
    derived: dict[str, Any] = {
        "decode_floor_ms": floor_ms,
        "decode_floor_ratio": ours["decode_ms_per_step"] / floor_ms,
        "ttft_cache_speedup": ours["ttft_cold_s"] / ours["ttft_cached_s"],
        "rss_growth_mb": ours["rss_after_all_mb"] - ours["rss_after_first_mb"],
        "decode_speedup": None,
        "ttft_cold_speedup": None,
        "decode_step_speedup": None,
        "peak_rss_ratio": None,
    }
    if theirs:
        derived |= {
            "decode_speedup": {
                n: tok_s / theirs["decode_tok_s"][n] for n, tok_s in ours["decode_tok_s"].items()
            },
            "ttft_cold_speedup": theirs["ttft_cold_s"] / ours["ttft_cold_s"],
            "decode_step_speedup": theirs["decode_ms_per_step"] / ours["decode_ms_per_step"],
            "peak_rss_ratio": ours["peak_rss_mb"] / theirs["peak_rss_mb"],
        }
    return derived


TARGET_TEXT = {
    "decode_speedup_at_top_concurrency": f"ratio ≥ {DECODE_SPEEDUP_TARGET:g}×",
    "ttft_cache_speedup": f"ratio ≥ {TTFT_CACHE_SPEEDUP_TARGET:g}×",
    "decode_floor_ratio": f"ratio ≤ {FLOOR_RATIO_TARGET:g}×",
    "rss_growth_mb": f"growth ≤ max({RSS_NOISE_MB:g} MB, {RSS_NOISE_FRACTION:.0%})",
}


def check(dtype: str, name: str, value: float | None, at_least: bool, limit: float) -> dict[str, Any]:
    """One target; passed is None when the value could not be measured (transformers skipped)."""
    passed = None if value is None else (value >= limit if at_least else value <= limit)
    return {
        "dtype": dtype,
        "check": name,
        "value": value,
        "target": f"{'>=' if at_least else '<='} {limit:g}",
        "passed": passed,
    }


def checks(s: Settings, dtype: str, ours: dict[str, Any], derived: dict[str, Any]) -> list[dict[str, Any]]:
    speedups = derived["decode_speedup"]
    top = speedups[str(max(s.concurrency))] if speedups else None
    return [
        check(dtype, "decode_speedup_at_top_concurrency", top, True, DECODE_SPEEDUP_TARGET),
        check(dtype, "ttft_cache_speedup", derived["ttft_cache_speedup"], True, TTFT_CACHE_SPEEDUP_TARGET),
        check(dtype, "decode_floor_ratio", derived["decode_floor_ratio"], False, FLOOR_RATIO_TARGET),
        check(
            dtype,
            "rss_growth_mb",
            derived["rss_growth_mb"],
            False,
            rss_allowance_mb(ours["rss_after_first_mb"]),
        ),
    ]


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


Row = tuple[str, str | None, str, str, str]  # label, check name, ours, transformers, ratio


def dtype_rows(
    s: Settings, ours: dict[str, Any], theirs: dict[str, Any] | None, d: dict[str, Any]
) -> list[Row]:
    """One dtype's cells, row by row; labels depend only on the settings, so dtypes line up."""
    tf = theirs or {}
    top = max(s.concurrency)
    rows: list[Row] = [
        (
            f"decode tok/s, {n} concurrent (ratio ours/transformers)",
            "decode_speedup_at_top_concurrency" if n == top else None,
            fmt(ours["decode_tok_s"][str(n)], ".1f"),
            fmt(tf.get("decode_tok_s", {}).get(str(n)), ".1f"),
            fmt(d["decode_speedup"] and d["decode_speedup"][str(n)], ".2f", "×"),
        )
        for n in s.concurrency
    ]
    return [
        *rows,
        (
            f"TTFT cold, {s.ttft_prompt_tokens}-token prompt, s (ratio transformers/ours)",
            None,
            fmt(ours["ttft_cold_s"], ".3f"),
            fmt(tf.get("ttft_cold_s"), ".3f"),
            fmt(d["ttft_cold_speedup"], ".2f", "×"),
        ),
        (
            f"TTFT, first {ours['ttft_cached_tokens']} tokens cached, s (ratio ours cold/cached)",
            "ttft_cache_speedup",
            fmt(ours["ttft_cached_s"], ".3f"),
            "—",
            fmt(d["ttft_cache_speedup"], ".1f", "×"),
        ),
        (
            "batch-1 decode, ms/step (ratio transformers/ours)",
            None,
            fmt(ours["decode_ms_per_step"], ".1f"),
            fmt(tf.get("decode_ms_per_step"), ".1f"),
            fmt(d["decode_step_speedup"], ".2f", "×"),
        ),
        (
            "batch-1 floor = weight bytes / read bandwidth, ms (ratio ours ms/step / floor)",
            "decode_floor_ratio",
            fmt(d["decode_floor_ms"], ".2f"),
            "—",
            fmt(d["decode_floor_ratio"], ".2f", "×"),
        ),
        (
            "peak RSS, MB (ratio ours/transformers)",
            None,
            fmt(ours["peak_rss_mb"], ".0f"),
            fmt(tf.get("peak_rss_mb"), ".0f"),
            fmt(d["peak_rss_ratio"], ".2f", "×"),
        ),
        (
            f"RSS after {ours['rss_first_requests']} / {ours['rss_total_requests']} short requests, MB "
            "(ratio column: growth)",
            "rss_growth_mb",
            f"{ours['rss_after_first_mb']:.0f} / {ours['rss_after_all_mb']:.0f}",
            "—",
            fmt(d["rss_growth_mb"], "+.1f", " MB"),
        ),
    ]


def verdict(passed: bool | None) -> str:
    return {True: "pass", False: "FAIL", None: "n/a"}[passed]


def markdown_table(s: Settings, report: dict[str, Any]) -> str:
    per_dtype = {
        dtype: dtype_rows(s, r["ours"], r.get("transformers"), r["derived"])
        for dtype, r in report["results"].items()
    }
    outcome = {(c["dtype"], c["check"]): c["passed"] for c in report["checks"]}
    header = ["metric"]
    for dtype in s.dtypes:
        header += [f"{dtype} ours", f"{dtype} transformers", f"{dtype} ratio"]
    lines = ["| " + " | ".join([*header, "target", "pass"]) + " |", "|" + "---|" * (len(header) + 2)]
    for i, (label, name, *_) in enumerate(per_dtype[s.dtypes[0]]):
        cells = [label]
        for dtype in s.dtypes:
            cells += per_dtype[dtype][i][2:]
        target = TARGET_TEXT[name] if name else ""
        passed = ", ".join(f"{dtype} {verdict(outcome[dtype, name])}" for dtype in s.dtypes) if name else ""
        lines.append("| " + " | ".join([*cells, target, passed]) + " |")
    return "\n".join(lines)


def preamble(s: Settings, report: dict[str, Any]) -> str:
    m = report["machine"]
    ours = report["results"][s.dtypes[0]]["ours"]
    return "\n".join(
        [
            f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads; torch {m['torch']}, "
            f"transformers {m['transformers']}, Python {m['python']}; memory read bandwidth "
            f"{report['read_bandwidth_gb_s']:.1f} GB/s (torch sum on {s.threads} threads over "
            f"{s.bandwidth_mib} MiB, best of {BANDWIDTH_TRIES}).",
            f"Model: {Path(s.model).name}; {s.prompt_tokens}-token random prompts, {s.new_tokens} "
            f"new tokens, greedy, EOS ignored; tok/s = N × {s.new_tokens} / wall time including "
            f"prefill; medians of {s.repeats} run(s). Ours: KV pool {ours['kv_cache_tokens']} tokens, "
            f"max_num_batched_tokens {ours['max_num_batched_tokens']}.",
            f"Command: `{report['command']}`",
        ]
    )


# -- parent: entry point --------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench_engine",
        description="Benchmark the replica engine against transformers generate (CPU).",
    )
    parser.add_argument("--model", help="model directory (default: the prepared SmolLM2-135M-Instruct)")
    parser.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, from: fp32, bf16")
    for name, default in FULL.items():
        kind = str if name == "concurrency" else int
        parser.add_argument(
            f"--{name.replace('_', '-')}", type=kind, help=f"default {default} (--quick: {QUICK[name]})"
        )
    parser.add_argument("--threads", type=int, default=2, help="torch threads per worker (default 2)")
    parser.add_argument("--skip-transformers", action="store_true", help="measure our engine only")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke run")
    parser.add_argument("--out", default="results/bench_engine.json", help="JSON report path")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def resolve_settings(args: argparse.Namespace) -> Settings:
    """Sizes come from the options, else from QUICK or FULL; the default model is prepared if needed."""
    sizes = {
        k: v if (v := getattr(args, k)) is not None else (QUICK if args.quick else FULL)[k] for k in FULL
    }
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if unknown := set(dtypes) - set(DTYPES):
        raise SystemExit(f"unknown dtype(s) {sorted(unknown)}; choose from {', '.join(DTYPES)}")
    if sizes["new_tokens"] < 2:
        raise SystemExit("--new-tokens must be at least 2 (ms/step needs decode steps)")
    model = args.model
    if model is None:
        from replica.tools.prepare_model import prepare_default_model

        model = prepare_default_model(progress=progress)
    return Settings(
        model=str(Path(model).resolve()),
        dtypes=dtypes,
        concurrency=[int(n) for n in str(sizes.pop("concurrency")).split(",")],
        threads=args.threads,
        skip_transformers=args.skip_transformers,
        out=args.out,
        **sizes,
    )


def collect(s: Settings, bandwidth: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Runs every group, one subprocess at a time; returns per-dtype results and the checks."""
    engines = ENGINES[:1] if s.skip_transformers else ENGINES
    results: dict[str, Any] = {}
    all_checks: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_engine.") as workdir:
        for dtype in s.dtypes:
            measured = {engine: run_group(s, engine, dtype, Path(workdir)) for engine in engines}
            derived = derive(measured["ours"], measured.get("transformers"), bandwidth)
            results[dtype] = measured | {"derived": derived}
            all_checks += checks(s, dtype, measured["ours"], derived)
    return results, all_checks


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    s = resolve_settings(args)
    load = warn_if_busy("bench_engine")
    progress(f"measuring memory read bandwidth over {s.bandwidth_mib} MiB")
    bandwidth = measure_read_bandwidth(s.bandwidth_mib, s.threads)
    results, all_checks = collect(s, bandwidth)
    report: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "loadtests.bench_engine", *argv]),
        "machine": machine_info(s.threads) | {"load_average_at_start": load},
        "settings": asdict(s),
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "results": results,
        "checks": all_checks,
    }
    report["table"] = preamble(s, report) + "\n\n" + markdown_table(s, report)
    publish("bench_engine", report, s.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
