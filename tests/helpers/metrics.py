"""Prometheus metrics as the tests read them: one scrape, one way to pick samples.

A ``source`` is the exposition text of a scrape, or an in-process ``CollectorRegistry`` (the
mirror's): both give the same metric families, so one selection rule serves both.
"""

from __future__ import annotations

import httpx
from prometheus_client import CollectorRegistry, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

Source = str | CollectorRegistry


def scrape(target: str | httpx.Client, *, timeout: float = 10) -> str:
    """The text of /metrics at ``target``: a base URL, or a client with its ``base_url`` set."""
    if isinstance(target, httpx.Client):
        response = target.get("/metrics", timeout=timeout)
    else:
        response = httpx.get(f"{target.rstrip('/')}/metrics", timeout=timeout)
    assert response.status_code == 200, f"/metrics answered {response.status_code}: {response.text[:500]}"
    return response.text


def families(source: Source) -> list[Metric]:
    if isinstance(source, CollectorRegistry):
        return list(source.collect())
    return list(text_string_to_metric_families(source))


def samples(source: Source, name: str, **labels: str) -> list[Sample]:
    """The samples named ``name`` whose labels include ``labels``."""
    return [
        sample
        for family in families(source)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    ]


def sample_value(source: Source, name: str, *, default: float | None = None, **labels: str) -> float:
    """The sum of ``samples(source, name, **labels)``; with none, ``default``, or an AssertionError
    when there is no default."""
    found = samples(source, name, **labels)
    if not found:
        assert default is not None, f"{name} {labels} not in the metrics"
        return default
    return sum(sample.value for sample in found)


def engine_requests(target: str | httpx.Client) -> float:
    """The requests a replica's engine holds now, running plus waiting (its vLLM gauges)."""
    text = scrape(target)
    return sample_value(text, "vllm:num_requests_running") + sample_value(text, "vllm:num_requests_waiting")
