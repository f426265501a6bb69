"""The gateway benchmark's checks against its targets, its three tables, and its preamble."""

from __future__ import annotations

from typing import Any

from loadtests.bench_gateway.settings import (
    ADDED_P50_MS_TARGET,
    CHAT_CHARS,
    CONCURRENCY,
    CPU_US_TARGET,
    MODES,
    REPLICA_ENGINES,
    REQ_S_TARGET,
    SIDES,
)
from loadtests.harness import markdown_table, passes, verdict


def checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for mode in MODES:
        r = results[mode]
        for name, value, limit, at_least in (
            ("added_p50_ms", r["added_ms"]["gateway"]["p50"], ADDED_P50_MS_TARGET, False),
            ("cpu_us_per_request", r["cpu_us_per_request"]["gateway"]["concurrent"], CPU_US_TARGET, False),
            ("req_s", r["req_s"]["gateway"], REQ_S_TARGET, True),
        ):
            passed = passes(value, limit, at_least)
            out.append({"check": f"{mode}.{name}", "value": value, "limit": limit, "passed": passed})
    return out


# A row of the main table, per mode: its label, where each side's value sits in that mode's results
# (key, side, then the rest of the path), whether the direct column is empty (a proxy-only metric),
# the value's format, and the target with its check.
RowSpec = tuple[str, tuple[str, ...], bool, str, str, str]


def row_specs() -> list[RowSpec]:
    specs: list[RowSpec] = [
        (f"latency {q}, concurrency 1 (ms)", ("latency_ms", q), False, ".3f", "", "") for q in ("p50", "p99")
    ]
    specs += [
        ("added latency p50 vs direct (ms)", ("added_ms", "p50"), True, ".3f",
         f"≤ {ADDED_P50_MS_TARGET} ms", "added_p50_ms"),
        ("added latency p99 vs direct (ms)", ("added_ms", "p99"), True, ".3f", "", ""),
        (f"proxy CPU per request, concurrency {CONCURRENCY} (µs)", ("cpu_us_per_request", "concurrent"),
         True, ".0f", f"≤ {CPU_US_TARGET:.0f} µs", "cpu_us_per_request"),
        ("proxy CPU per request, concurrency 1 (µs)", ("cpu_us_per_request", "sequential"), True, ".0f", "",
         ""),
        (f"requests/s, concurrency {CONCURRENCY}, one process", ("req_s",), False, ",.0f",
         f"≥ {REQ_S_TARGET:,.0f}", "req_s"),
        ("proxy CPU-bound ceiling, 1e6 / CPU µs (req/s)", ("cpu_bound_req_s",), True, ",.0f", "", ""),
    ]  # fmt: skip
    specs += [
        (f"{who} CPU share during the concurrency-{CONCURRENCY} phase (% of one core)",
         ("cpu_share_pct", who), False, ".0f", "", "")
        for who in ("proxy", "replica", "client")
    ]  # fmt: skip
    return specs


def side_cell(r: dict[str, Any], path: tuple[str, ...], side: str, spec: str, router: bool) -> str:
    if side == "sglang_router" and not router:
        return "not installed"
    key, *rest = path
    value = r[key][side]
    for step in rest:
        value = value[step]
    return format(value, spec)


def markdown_main(results: dict[str, Any], outcome: dict[str, bool], router: bool) -> str:
    """Per mode, one row per metric with a column per side (sglang-router: "not installed" unless it is)."""
    rows = []
    for mode in MODES:
        for label, path, proxies_only, spec, target, check in row_specs():
            cells = [
                ""
                if proxies_only and side == "direct"
                else side_cell(results[mode], path, side, spec, router)
                for side in SIDES
            ]
            passed = verdict(outcome[f"{mode}.{check}"]) if check else ""
            rows.append([label, mode.replace("_", "-"), *cells, target, passed])
    header = ["metric", "mode", "direct", "gateway", "sglang-router", "target", "pass"]
    return markdown_table(header, rows)


def tokenization_table(t: dict[str, Any]) -> str:
    header = [
        f"tokenizing turn {t['turns']} of a {t['turns']}-turn chat, {t['prompt_tokens']:,} tokens",
        "µs per request",
    ]
    rows = [
        ["from scratch (render + encode, no cache)", f"{t['from_scratch_us']:,.0f}"],
        [
            f"gateway, turn {t['turns'] - 1} cached (only the new turn encoded)",
            f"{t['previous_turn_cached_us']:,.0f}",
        ],
        ["gateway, verbatim repeat", f"{t['verbatim_repeat_us']:,.0f}"],
    ]
    return markdown_table(header, rows)


def clients_table(clients: dict[str, dict[str, float]]) -> str:
    cases = [(mode, c) for mode in MODES for c in (1, CONCURRENCY)]
    header = ["upstream client, CPU µs per request"]
    header += [f"{mode.replace('_', '-')}, concurrency {c}" for mode, c in cases]
    rows = [[kind, *(f"{row[f'{mode}.c{c}']:,.0f}" for mode, c in cases)] for kind, row in clients.items()]
    return markdown_table(header, rows)


def tables(report: dict[str, Any]) -> list[str]:
    outcome = {c["check"]: c["passed"] for c in report["checks"]}
    return [
        markdown_main(report["results"], outcome, report["sglang_router"]),
        tokenization_table(report["tokenization"]),
        clients_table(report["upstream_clients"]),
    ]


def preamble(report: dict[str, Any]) -> list[str]:
    m, s = report["machine"], report["settings"]
    return [
        f"Machine: {m['cpu']}, {m['cores']} cores, shared by the load generator, the gateway, the "
        f"replica and redis-server; Python {m['python']}, httpx {m['httpx']}, uvicorn {m['uvicorn']} "
        f"(uvloop {m['uvloop']}, httptools {m['httptools']}); "
        f"sglang-router {m['sglang_router']}.",
        f"Replica: {REPLICA_ENGINES[s['replica_engine']]}, `max_tokens=1`. "
        f"Request: the same {CHAT_CHARS:,}-character chat (system + user) every "
        "time on every side, so after the warm-up its prefix is cached for direct and gateway "
        "requests alike.",
        f"Concurrency 1: {s['sequential']} requests per proxy, alternated request by request with "
        f"as many direct ones (each proxy paired with direct only) after {s['warmup']} warm-up "
        f"pairs. Concurrency {CONCURRENCY}: "
        f"{s['rounds']} round(s) of {s['concurrent']} requests per side, sides alternated; the "
        "load generator is the gateway's own upstream client (concurrency 1 too). "
        "Streaming is timed to the last byte. "
        "CPU from /proc/PID/stat utime+stime. A replica or client CPU share near 100% means "
        "they, not the gateway, capped requests/s; the CPU-bound ceiling is what one proxy "
        "process could carry.",
    ]
