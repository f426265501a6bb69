"""A vLLM server's load, read from its Prometheus ``/metrics``, in the shape the publisher sends.

vLLM reports ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (0..1) and ``vllm:cache_config_info`` (its KV pool size in the
``num_gpu_blocks`` label, also on CPU builds), one series per engine; they are summed. It does not
report the prompt tokens its queue still has to prefill, so ``waiting_prefill_tokens`` is 0 and
gateways count load from requests (their own since the heartbeat included). It reports no
per-gateway shares either: ``by_source`` is None, so the heartbeat has no ``gateways`` field.
``process_start_time_seconds`` changes when the server restarts, which tells the bridge to start
a new epoch even if the restarted server has published nothing yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class EngineLoad:
    """What the publisher's heartbeat needs (``replica.publisher.PublishedLoad``)."""

    num_running: int
    num_waiting: int
    kv_total_pages: int  # in kvroute blocks
    kv_used_pages: int
    started_at: float | None  # the server process's start time; None if it does not say
    waiting_prefill_tokens: int = 0
    by_source: None = None


def parse_metrics(text: str, block_size: int) -> EngineLoad:
    """``text``: a /metrics body; ``block_size``: kvroute's, to count the pool in kvroute blocks."""
    sums: dict[str, float] = {}
    usages: list[float] = []  # one fraction per engine: averaged, not summed
    total_blocks = 0
    started_at: float | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                blocks = int(sample.labels.get("num_gpu_blocks") or 0)
                vllm_block = int(sample.labels.get("block_size") or block_size)
                total_blocks += blocks * max(1, vllm_block // block_size)
            elif sample.name == "process_start_time_seconds":
                started_at = sample.value
            elif sample.name == "vllm:kv_cache_usage_perc":
                usages.append(sample.value)
            else:
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    usage = sum(usages) / len(usages) if usages else 0.0
    return EngineLoad(
        num_running=round(sums.get("vllm:num_requests_running", 0.0)),
        num_waiting=round(sums.get("vllm:num_requests_waiting", 0.0)),
        kv_total_pages=total_blocks,
        kv_used_pages=round(total_blocks * min(1.0, max(0.0, usage))),
        started_at=started_at,
    )
