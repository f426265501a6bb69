"""The engine benchmark's ratios, checks against its targets, and its table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtests.bench_engine.settings import (
    BANDWIDTH_TRIES,
    DECODE_SPEEDUP_TARGET,
    FLOOR_RATIO_TARGET,
    RSS_NOISE_FRACTION,
    RSS_NOISE_MB,
    TTFT_CACHE_SPEEDUP_TARGET,
    Settings,
)
from loadtests.harness import check, markdown_table, verdict

TARGET_TEXT = {
    "decode_speedup_at_top_concurrency": f"ratio ≥ {DECODE_SPEEDUP_TARGET:g}×",
    "ttft_cache_speedup": f"ratio ≥ {TTFT_CACHE_SPEEDUP_TARGET:g}×",
    "decode_floor_ratio": f"ratio ≤ {FLOOR_RATIO_TARGET:g}×",
    "rss_growth_mb": f"growth ≤ max({RSS_NOISE_MB:g} MB, {RSS_NOISE_FRACTION:.0%})",
}


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


def checks(s: Settings, dtype: str, ours: dict[str, Any], derived: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target of one dtype; passed is None when transformers, which it compares with, was skipped."""
    speedups = derived["decode_speedup"]
    top = speedups[str(max(s.concurrency))] if speedups else None
    targets = [
        ("decode_speedup_at_top_concurrency", top, True, DECODE_SPEEDUP_TARGET),
        ("ttft_cache_speedup", derived["ttft_cache_speedup"], True, TTFT_CACHE_SPEEDUP_TARGET),
        ("decode_floor_ratio", derived["decode_floor_ratio"], False, FLOOR_RATIO_TARGET),
        ("rss_growth_mb", derived["rss_growth_mb"], False, rss_allowance_mb(ours["rss_after_first_mb"])),
    ]
    return [
        {"dtype": dtype, **check(name, value, limit, at_least)} for name, value, at_least, limit in targets
    ]


def fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


Row = tuple[str, str | None, str, str, str]  # label, check name, ours, transformers, ratio


def decode_rows(s: Settings, ours: dict[str, Any], tf: dict[str, Any], d: dict[str, Any]) -> list[Row]:
    top = max(s.concurrency)
    return [
        (
            f"decode tok/s, {n} concurrent (ratio ours/transformers)",
            "decode_speedup_at_top_concurrency" if n == top else None,
            fmt(ours["decode_tok_s"][str(n)], ".1f"),
            fmt(tf.get("decode_tok_s", {}).get(str(n)), ".1f"),
            fmt(d["decode_speedup"] and d["decode_speedup"][str(n)], ".2f", "×"),
        )
        for n in s.concurrency
    ]


def latency_rows(s: Settings, ours: dict[str, Any], tf: dict[str, Any], d: dict[str, Any]) -> list[Row]:
    return [
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
    ]


def memory_rows(ours: dict[str, Any], tf: dict[str, Any], d: dict[str, Any]) -> list[Row]:
    return [
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


def dtype_rows(s: Settings, result: dict[str, Any]) -> list[Row]:
    """One dtype's cells, row by row; labels depend only on the settings, so dtypes line up."""
    ours, tf, d = result["ours"], result.get("transformers") or {}, result["derived"]
    return [*decode_rows(s, ours, tf, d), *latency_rows(s, ours, tf, d), *memory_rows(ours, tf, d)]


def tables(report: dict[str, Any]) -> list[str]:
    """One row per metric, three columns per dtype (ours, transformers, ratio), then target and pass."""
    s = Settings(**report["settings"])
    per_dtype = {dtype: dtype_rows(s, result) for dtype, result in report["results"].items()}
    outcome = {(c["dtype"], c["check"]): c["passed"] for c in report["checks"]}
    header = ["metric"]
    for dtype in s.dtypes:
        header += [f"{dtype} ours", f"{dtype} transformers", f"{dtype} ratio"]
    rows = []
    for i, (label, name, *_) in enumerate(per_dtype[s.dtypes[0]]):
        cells = [label]
        for dtype in s.dtypes:
            cells += per_dtype[dtype][i][2:]
        target = TARGET_TEXT[name] if name else ""
        passed = ", ".join(f"{dtype} {verdict(outcome[dtype, name])}" for dtype in s.dtypes) if name else ""
        rows.append([*cells, target, passed])
    return [markdown_table([*header, "target", "pass"], rows)]


def preamble(report: dict[str, Any]) -> list[str]:
    s = Settings(**report["settings"])
    m = report["machine"]
    ours = report["results"][s.dtypes[0]]["ours"]
    return [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} threads; torch {m['torch']}, "
        f"transformers {m['transformers']}, Python {m['python']}; memory read bandwidth "
        f"{report['read_bandwidth_gb_s']:.1f} GB/s (torch sum on {s.threads} threads over "
        f"{s.bandwidth_mib} MiB, best of {BANDWIDTH_TRIES}).",
        f"Model: {Path(s.model).name}; {s.prompt_tokens}-token random prompts, {s.new_tokens} "
        f"new tokens, greedy, EOS ignored; tok/s = N × {s.new_tokens} / wall time including "
        f"prefill; medians of {s.repeats} run(s). Ours: KV pool {ours['kv_cache_tokens']} tokens, "
        f"max_num_batched_tokens {ours['max_num_batched_tokens']}.",
    ]
