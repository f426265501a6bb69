"""``bench serve``'s printed report, in ``vllm bench serve``'s layout (its users should feel at home)
plus kvroute's lines, and the PNG plots of ``bench serve`` sweeps and ``bench compare``.

The cache section adds what vLLM's report lacks: the cached-token ratio the server reported, the
oracle's, and their quotient.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtests.serving.metrics import ServingMetrics, percentile_label
from loadtests.serving.oracle import OracleResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

WIDTH = 50
_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def _line(label: str, value: Any) -> str:
    text = f"{value:<10.2f}" if isinstance(value, float) else f"{value!s:<10}"
    return f"{label:<40} {text}".rstrip()


def _rule(title: str, fill: str) -> str:
    return f"{title:{fill}^{WIDTH}}"


def format_report(
    metrics: ServingMetrics,
    oracle: OracleResult | None,
    max_concurrency: int | None,
    request_rate: float,
    shown: tuple[str, ...],
) -> str:
    lines = [
        _rule(" Serving Benchmark Result ", "="),
        _line("Successful requests:", metrics.completed),
        _line("Failed requests:", metrics.failed),
    ]
    if metrics.skipped:
        lines.append(_line("Skipped turns (earlier turn failed):", metrics.skipped))
    if max_concurrency is not None:
        lines.append(_line("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_line("Request rate configured (RPS):", request_rate))
    lines += [
        _line("Benchmark duration (s):", metrics.duration_s),
        _line("Total input tokens:", metrics.total_input),
        _line("Total generated tokens:", metrics.total_output),
        _line("Request throughput (req/s):", metrics.request_throughput),
        _line("Output token throughput (tok/s):", metrics.output_throughput),
        _line("Peak output token throughput (tok/s):", metrics.peak_output_throughput),
        _line("Peak concurrent requests:", float(metrics.peak_concurrency)),
        _line("Total Token throughput (tok/s):", metrics.total_token_throughput),
        _rule("Prefix Cache", "-"),
        _line("Cached prompt tokens:", metrics.cached_tokens),
        _line("Cached-token ratio (%):", 100 * metrics.cached_ratio),
    ]
    if oracle is not None:
        lines.append(_line("Oracle cached-token ratio (%):", 100 * oracle.ratio))
        if oracle.ratio:
            lines.append(_line("Cached ratio / oracle (%):", 100 * metrics.cached_ratio / oracle.ratio))
    if metrics.predicted_cached_tokens is not None:
        lines.append(_line("Gateway-predicted cached tokens:", metrics.predicted_cached_tokens))
    if metrics.requests_per_replica:
        spread = " ".join(f"{n}" for _, n in sorted(metrics.requests_per_replica.items()))
        lines.append(_line("Requests per replica:", spread))
    for name in shown:
        title, short = _TITLES[name]
        distribution = metrics.latencies[name]
        lines.append(_rule(title, "-"))
        lines.append(_line(f"Mean {short} (ms):", distribution.mean))
        lines.append(_line(f"Median {short} (ms):", distribution.median))
        for percentile, value in distribution.percentiles.items():
            lines.append(_line(f"P{percentile_label(percentile)} {short} (ms):", value))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def plot_sweep(results: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """TTFT p50/p90 and output throughput against concurrency, one PNG; None for a single point."""
    points = [r for r in results if r.get("max_concurrency") is not None]
    if len(points) < 2:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrency = [r["max_concurrency"] for r in points]
    figure, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4))
    latency.plot(concurrency, [r["median_ttft_ms"] for r in points], "o-", label="TTFT p50")
    if all("p90_ttft_ms" in r for r in points):
        latency.plot(concurrency, [r["p90_ttft_ms"] for r in points], "s--", label="TTFT p90")
    latency.set(xlabel="max concurrency", ylabel="ms", title="Time to first token")
    latency.legend()
    throughput.plot(concurrency, [r["output_throughput"] for r in points], "o-", color="tab:green")
    throughput.set(xlabel="max concurrency", ylabel="output tok/s", title="Output throughput")
    for axes in (latency, throughput):
        axes.set_xscale("log", base=2)
        axes.grid(alpha=0.3)
    return save_figure(figure, path, title)


def save_figure(figure: Figure, path: Path, title: str) -> Path:
    """Titles, lays out and writes a matplotlib figure as a PNG, then frees it."""
    import matplotlib.pyplot as plt

    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
