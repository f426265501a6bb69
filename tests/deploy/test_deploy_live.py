"""deploy/ against a running stack (redis-server, one replica on the tiny model, the gateway, all
real processes on loopback): every series the Grafana dashboard queries is one the code exports,
and the replicas' preStop drain script drains through the gateway admin API and waits for the
requests in flight."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from gateway.metrics import GatewayMetrics
from tests.helpers.metrics import engine_requests, families, scrape
from tests.helpers.processes import StackProcesses, running_stack

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kvroute.json"
DRAIN_SCRIPT = ROOT / "deploy" / "docker" / "kvroute-drain.py"
ADMIN_KEY = "deploy-test-admin-key"
# Labels Prometheus attaches to every scraped series.
TARGET_LABELS = {"instance", "job"}
# Counters that only get a series once the event happens (a retry, an ejection, a tokenizer
# mismatch): a healthy test stack exports their families without samples.
EVENT_ONLY = {
    "kvroute_gateway_retries_total",
    "kvroute_gateway_ejections_total",
    "kvroute_gateway_fingerprint_mismatches_total",
}
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}


# -- PromQL: which series and labels an expression uses ------------------------------------------

_NAME = r"[A-Za-z_:][A-Za-z0-9_:]*"
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless"}
_KEYWORDS |= {"offset", "inf", "nan", "atan2"}
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")


def _without_strings(expr: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)


def promql_series(expr: str) -> set[str]:
    """Every metric name a PromQL expression selects: label matchers, ranges, grouping clauses,
    strings and numbers removed; a name followed by ``(`` is a function or an aggregation."""
    text = _without_strings(expr)
    named = {m.group(1) for m in re.finditer(r'\{[^}]*__name__\s*=\s*"([^"]*)"', expr)}
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\boffset\s+-?\w+", " ", text)
    names = set(named)
    for match in re.finditer(_NAME, text):
        before = text[match.start() - 1] if match.start() else " "
        if before.isdigit() or before == ".":  # the exponent of 1e3, or the tail of a number
            continue
        token = match.group(0)
        if text[match.end() :].lstrip().startswith("(") or token.lower() in _KEYWORDS:
            continue
        names.add(token)
    return names


def promql_labels(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """Labels in matchers, per metric name, and labels in grouping clauses."""
    text = _without_strings(expr)
    matched: dict[str, set[str]] = {}
    for match in re.finditer(rf"({_NAME})\s*\{{([^}}]*)\}}", expr):
        labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", match.group(2)))
        matched.setdefault(match.group(1), set()).update(labels)
    grouped = {
        label.strip()
        for clause in _GROUPING.finditer(text)
        for label in clause.group(2).split(",")
        if label.strip()
    }
    return matched, grouped


def test_promql_parsing() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, model) (rate(a_seconds_bucket{model="x", status!~"5.."}[5m])))'
        " / on(model) group_left sum without (instance) (vllm:b_total offset 1h) * 1e3 + c"
        ' or vector(0) > bool 2 unless count({__name__="d_total"})'
    )
    assert promql_series(expr) == {"a_seconds_bucket", "vllm:b_total", "c", "d_total"}
    matched, grouped = promql_labels(expr)
    assert matched == {"a_seconds_bucket": {"model", "status"}}
    assert grouped == {"le", "model", "instance"}
    assert promql_series("sum(rate(x_total[$__rate_interval])) by (replica)") == {"x_total"}


def dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    panels = list(dashboard["panels"])
    for row in dashboard["panels"]:
        panels.extend(row.get("panels", []))  # collapsed rows keep their panels inside
    return [(panel["title"], target["expr"]) for panel in panels for target in panel.get("targets", [])]


# -- the live stack -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackProcesses]:
    workdir = tmp_path_factory.mktemp("deploy-stack")
    with running_stack(llama_dir, workdir, 1, gateway_args=("--admin-key", ADMIN_KEY)) as processes:
        yield processes


class Scrape:
    def __init__(self, *texts: str) -> None:
        self.exported: set[str] = set()  # every series name the families may have
        self.sampled: set[str] = set()  # the series names with at least one sample now
        self.labels: dict[str, set[str]] = {}
        for text in texts:
            for family in families(text):
                suffixes = _SUFFIXES.get(family.type, ("",))
                self.exported.update(family.name + suffix for suffix in suffixes)
                for sample in family.samples:
                    self.exported.add(sample.name)
                    self.sampled.add(sample.name)
                    self.labels.setdefault(sample.name, set()).update(sample.labels)


def scrape_stack(stack: StackProcesses) -> Scrape:
    scraped = Scrape(*(scrape(url) for url in (stack.gateway.url, *(r.url for r in stack.replicas))))
    # A family without samples shows no label names; take those from the gateway's definitions.
    definitions = vars(GatewayMetrics(CollectorRegistry())).values()
    for metric in (m for m in definitions if isinstance(m, MetricWrapperBase)):
        for suffix in _SUFFIXES[metric._type]:
            if metric._name + suffix in scraped.exported - scraped.sampled:
                scraped.labels[metric._name + suffix] = set(metric._labelnames)
    return scraped


def test_every_dashboard_query_uses_exported_metrics(stack: StackProcesses) -> None:
    client = httpx.Client(base_url=f"{stack.gateway.url}/v1", timeout=30)
    body = {"model": stack.model, "max_tokens": 4, "temperature": 0}
    messages = [{"role": "user", "content": "Tell me about caching. " * 4}]
    with client.stream(
        "POST", "/chat/completions", json={**body, "messages": messages, "stream": True}
    ) as reply:
        assert reply.status_code == 200 and "[DONE]" in reply.read().decode()
    assert client.post("/completions", json={**body, "prompt": "Once upon a time"}).status_code == 200
    metrics = scrape_stack(stack)

    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    queried = set()
    for title, expr in exprs:
        series = promql_series(expr)
        assert series, f"{title}: no metric in {expr!r}"
        missing = series - metrics.exported
        assert not missing, f"{title}: {sorted(missing)} not exported by the gateway or the replica"
        matched, grouped = promql_labels(expr)
        for name, labels in matched.items():
            assert labels <= metrics.labels.get(name, set()), f"{title}: {name} has no label {labels}"
        known = set().union(*(metrics.labels.get(name, set()) for name in series)) | TARGET_LABELS
        assert grouped <= known, (
            f"{title}: grouping by {sorted(grouped - known)}, unknown to {sorted(series)}"
        )
        queried |= series
    # After a streamed and a plain request every queried series has samples, apart from the
    # counters of events a healthy stack never has.
    assert queried - metrics.sampled <= EVENT_ONLY
    for required in (
        "kvroute_gateway_time_to_first_token_seconds_bucket",
        "kvroute_gateway_cached_tokens_total",
        "kvroute_gateway_predicted_cached_tokens_total",
        "kvroute_gateway_prompt_tokens_total",
        "kvroute_gateway_requests_total",
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ):
        assert required in queried, f"the dashboard lacks {required}"


def test_the_scrape_check_catches_a_wrong_name(stack: StackProcesses) -> None:
    metrics = scrape_stack(stack)
    assert "kvroute_gateway_time_to_first_token_seconds_bucket" in metrics.exported
    for wrong in (
        "kvroute_gateway_time_to_first_token_seconds",  # a histogram has no bare series
        "kvroute_gateway_requests",  # a counter's series ends in _total
        "vllm_num_requests_waiting",
        "vllm:kv_cache_usage_perc_total",
    ):
        assert wrong not in metrics.exported


# -- the preStop drain --------------------------------------------------------------------------


def run_drain(stack: StackProcesses, admin_key: str, *extra: str) -> subprocess.CompletedProcess[str]:
    replica = stack.replicas[0]
    return subprocess.run(
        [
            sys.executable, str(DRAIN_SCRIPT),
            "--gateway", f"127.0.0.1:{stack.gateway.port}",
            "--replica-id", f"127.0.0.1:{replica.port}",
            "--metrics-url", f"{replica.url}/metrics",
            "--settle", "0.2", "--poll", "0.05", *extra,
        ],
        env={"KVROUTE_ADMIN_KEY": admin_key, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip


def drained(stack: StackProcesses) -> bool:
    response = httpx.get(
        f"{stack.gateway.url}/admin/replicas", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=5
    )
    (row,) = response.json()["replicas"]
    return bool(row["drained"])


def test_drain_with_a_wrong_key_fails_and_drains_nothing(stack: StackProcesses) -> None:
    result = run_drain(stack, "not-the-admin-key", "--timeout", "5")
    assert result.returncode == 1, result.stderr
    assert "401" in result.stderr and not drained(stack)


def test_drain_takes_the_replica_out_and_waits_for_requests_in_flight(stack: StackProcesses) -> None:
    started, finished = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def long_request() -> None:
        body = {
            "model": stack.model,
            "prompt": "Count slowly:",
            "max_tokens": 3500,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        with httpx.stream("POST", f"{stack.gateway.url}/v1/completions", json=body, timeout=60) as reply:
            outcome["status"] = reply.status_code
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                if line == "data: [DONE]":
                    outcome["done"] = True
        finished.set()
        started.set()

    thread = threading.Thread(target=long_request, daemon=True)
    thread.start()
    try:
        assert started.wait(30) and not finished.is_set(), "the request must still run when the drain starts"
        assert engine_requests(stack.replicas[0].url) == 1
        result = run_drain(stack, ADMIN_KEY, "--timeout", "30")
        # Read independently of the script, right after it returned: had it not waited, most of
        # the 3,500 tokens (over a second of decoding) would still be running.
        assert engine_requests(stack.replicas[0].url) == 0, result.stderr
        assert result.returncode == 0, result.stderr
        assert "drained" in result.stderr and drained(stack)
        assert finished.wait(30) and outcome == {"status": 200, "done": True}
        # Drained: the gateway sends nothing new to its only replica.
        refused = httpx.post(
            f"{stack.gateway.url}/v1/completions", json={"model": stack.model, "prompt": "hi"}, timeout=10
        )
        assert refused.status_code == 503 and "drained" in refused.json()["error"]["message"]
    finally:
        thread.join(60)
        httpx.delete(
            f"{stack.gateway.url}/admin/replicas/127.0.0.1:{stack.replicas[0].port}/drain",
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            timeout=5,
        )
    assert not drained(stack)
