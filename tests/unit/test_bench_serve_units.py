"""The serving benchmark's arithmetic and workloads, on hand-made records and the tiny tokenizer."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from kvroute.text.tokenizer import TextTokenizer
from loadtests.bench_cli import build_bench_parser
from loadtests.options import workload_options
from loadtests.serving import serve
from loadtests.serving.client import RequestRecord
from loadtests.serving.metrics import compute_metrics, peak_concurrency
from loadtests.serving.oracle import OracleRequest, oracle_cached_tokens, token_stream
from loadtests.serving.runner import arrival_times
from loadtests.serving.serve import concurrency_cap_warning
from loadtests.serving.vllm_report import format_report
from loadtests.serving.workloads import (
    TextSource,
    build_workload,
    jsonl_workload,
    multi_turn_workload,
    shared_prefix_workload,
)


def _record(start: float, chunks: list[float], end: float, tokens: int, **usage: int) -> RequestRecord:
    record = RequestRecord(0, 0, start, end=end, first_token=chunks[0], chunk_times=chunks)
    record.completion_tokens = tokens
    record.prompt_tokens = usage.get("prompt", 100)
    record.cached_tokens = usage.get("cached", 0)
    return record


def test_latency_definitions_match_vllm() -> None:
    # Request A: sent at 0, chunks at 0.1, 0.15, 0.25 (3 tokens), done at 0.3.
    # Request B: sent at 1.0, chunks at 1.4 and 1.6 (one chunk carrying 3 of its 4 tokens), done 1.6.
    a = _record(0.0, [0.1, 0.15, 0.25], 0.3, 3, prompt=100, cached=64)
    b = _record(1.0, [1.4, 1.6], 1.6, 4, prompt=50, cached=0)
    failed = RequestRecord(0, 1, 0.5, end=0.6, error="HTTP 503")
    metrics = compute_metrics([a, b, failed], duration_s=2.0, percentiles=[50, 99])
    assert (metrics.completed, metrics.failed) == (2, 1)
    ttft = metrics.latencies["ttft"]
    assert ttft.mean == pytest.approx((100 + 400) / 2)
    assert ttft.percentiles[50] == pytest.approx(250)
    # TPOT = (E2EL - TTFT) / (tokens - 1): A (300-100)/2 = 100 ms, B (600-400)/3 = 66.7 ms
    assert metrics.latencies["tpot"].percentiles[50] == pytest.approx((100 + 200 / 3) / 2)
    assert metrics.latencies["tpot"].mean == pytest.approx((100 + 200 / 3) / 2)
    # ITL: gaps between text chunks, pooled: 50, 100 (A) and 200 (B)
    assert metrics.latencies["itl"].mean == pytest.approx((50 + 100 + 200) / 3)
    assert metrics.latencies["e2el"].median == pytest.approx((300 + 600) / 2)
    assert metrics.total_input == 150 and metrics.total_output == 7
    assert metrics.cached_ratio == pytest.approx(64 / 150)
    assert metrics.request_throughput == pytest.approx(1.0)
    assert metrics.output_throughput == pytest.approx(3.5)
    assert metrics.total_token_throughput == pytest.approx(78.5)
    # A's 3 tokens fall in second 0, B's 4 in second 1
    assert metrics.peak_output_throughput == pytest.approx(4)
    assert metrics.errors == ["HTTP 503"]


def test_peak_concurrency_sweeps_overlaps() -> None:
    spans = [(0, 1), (0.5, 2), (0.7, 0.8), (1.5, 3), (2.5, 4)]
    records = [RequestRecord(0, 0, start, end=end) for start, end in spans]
    assert peak_concurrency(records) == 3


def test_output_tokens_fall_back_to_chunks_without_usage() -> None:
    record = _record(0.0, [0.1, 0.2, 0.3], 0.3, 0)
    record.completion_tokens = None
    assert compute_metrics([record], 1.0, [99]).total_output == 3


def test_oracle_on_a_hand_made_case() -> None:
    block = 4
    doc = list(range(100, 112))  # 3 blocks
    first = OracleRequest([*doc, 1, 2], [*doc, 1, 2, 7, 7, 7, 7, 7, 7])
    # The second turn resends the first prompt and its answer, then asks more (23 tokens): it may
    # reuse at most (23 - 1) // 4 = 5 blocks, and all 5 are in the first stream: doc's 3 blocks,
    # [1, 2, 7, 7] and [7, 7, 7, 7] (the answer's tokens count: engines cache them).
    second_prompt = [*doc, 1, 2, 7, 7, 7, 7, 7, 7, 9, 9, 9]
    second = OracleRequest(second_prompt, second_prompt)
    # An unrelated prompt shares nothing; one sharing only 3 tokens shares no whole block.
    third = OracleRequest([5] * 8, [5] * 8)
    fourth = OracleRequest([100, 101, 102, 0, 0], [100, 101, 102, 0, 0])
    result = oracle_cached_tokens([first, second, third, fourth], block)
    assert result.cached_tokens == 20
    assert result.prompt_tokens == 14 + 23 + 8 + 5
    assert result.ratio == pytest.approx(20 / 50)


def test_oracle_always_leaves_one_token_to_compute() -> None:
    prompt = list(range(8))
    result = oracle_cached_tokens([OracleRequest(prompt, prompt), OracleRequest(prompt, prompt)], 4)
    assert result.cached_tokens == 4  # not 8: the last token must be computed


def test_token_stream_uses_the_chat_template(llama_dir: Path) -> None:
    tokenizer = TextTokenizer.from_dir(llama_dir)
    messages = [{"role": "user", "content": "hello there"}]
    stream = token_stream(tokenizer, messages, "hi", chat=True)
    assert list(stream.prompt_ids) == tokenizer.encode_chat(messages)
    assert list(stream.stream_ids[: len(stream.prompt_ids)]) == list(stream.prompt_ids)
    assert len(stream.stream_ids) > len(stream.prompt_ids)


def test_text_source_hits_token_lengths(llama_dir: Path) -> None:
    tokenizer = TextTokenizer.from_dir(llama_dir)
    source = TextSource(tokenizer, random.Random(3))
    for length in (1, 17, 200, 1000):
        measured = len(tokenizer.encode(source.text(length), add_special_tokens=False))
        assert abs(measured - length) <= max(2, length // 50), (length, measured)


def _options(**overrides: object) -> dict[str, object]:
    options = {
        "num_prompts": 24,
        "input_len": 20,
        "output_len": 8,
        "range_ratio": 0.0,
        "num_prefixes": 3,
        "prefix_len": 64,
        "turns": 4,
        "num_documents": None,
        "document_len": (50, 80),
        "think_time": 0.0,
        "dataset_path": None,
    }
    options.update(overrides)
    return options


@pytest.mark.parametrize("dataset", ["random", "shared-prefix", "multi-turn"])
def test_workloads_are_reproducible(llama_dir: Path, dataset: str) -> None:
    tokenizer = TextTokenizer.from_dir(llama_dir)
    first = build_workload(dataset, tokenizer, 7, _options())
    again = build_workload(dataset, tokenizer, 7, _options())
    other = build_workload(dataset, tokenizer, 8, _options())
    assert first.conversations == again.conversations
    assert first.conversations != other.conversations
    assert first.num_requests == 24


def test_multi_turn_shape(llama_dir: Path) -> None:
    source = TextSource(TextTokenizer.from_dir(llama_dir), random.Random(0))
    workload = multi_turn_workload(source, 6, 3, 2, (40, 60), 10, 5, 0.5)
    assert len(workload.conversations) == 6 and workload.num_requests == 18
    documents = {c.opening[0]["content"] for c in workload.conversations}
    assert len(documents) == 2  # several conversations share each document
    assert {c.group for c in workload.conversations} == {0, 1}
    assert all(len(c.user_turns) == 3 and c.think_time_s == 0.5 for c in workload.conversations)


def test_shared_prefix_groups(llama_dir: Path) -> None:
    source = TextSource(TextTokenizer.from_dir(llama_dir), random.Random(0))
    workload = shared_prefix_workload(source, 30, 3, 40, 10, 5)
    by_group: dict[int, set[str]] = {}
    for conversation in workload.conversations:
        by_group.setdefault(conversation.group, set()).add(conversation.opening[0]["content"])
    assert all(len(prefixes) == 1 for prefixes in by_group.values())
    assert len({next(iter(p)) for p in by_group.values()}) == len(by_group)


def test_jsonl_formats_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    rows = [
        {"prompt": "plain", "max_tokens": 3},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]},
        {"system": "doc", "turns": ["a", "b"]},
    ]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    workload = jsonl_workload(path, output_len=9, limit=None)
    assert [c.user_turns for c in workload.conversations] == [["plain"], ["q"], ["a", "b"]]
    assert [c.max_tokens for c in workload.conversations] == [3, 9, 9]
    assert workload.conversations[1].opening == [{"role": "system", "content": "s"}]
    assert workload.num_requests == 4
    assert len(jsonl_workload(path, 9, limit=2).conversations) == 2
    path.write_text('{"prompt": "ok"}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match=r"w.jsonl:2: expected"):
        jsonl_workload(path, 9, None)


def test_document_len_is_validated() -> None:
    class Args:
        document_len = "300:100"
        dataset = "multi-turn"
        dataset_path = None
        num_prompts = output_len = turns = 1

    with pytest.raises(ValueError, match="MIN:MAX"):
        workload_options(Args())  # type: ignore[arg-type]


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate() -> None:
    times = arrival_times(20_000, 50.0, random.Random(1))
    assert times == arrival_times(20_000, 50.0, random.Random(1))
    assert times[-1] / len(times) == pytest.approx(1 / 50, rel=0.05)
    assert arrival_times(3, math.inf, random.Random(1)) == [0.0, 0.0, 0.0]


def test_report_has_vllm_layout() -> None:
    a = _record(0.0, [0.1, 0.2], 0.2, 2, prompt=64, cached=32)
    metrics = compute_metrics([a], 1.0, [90, 99])
    oracle = oracle_cached_tokens([OracleRequest([1] * 64, [1] * 64)] * 2, 16)
    text = format_report(metrics, oracle, 4, math.inf, ("ttft", "tpot", "itl", "e2el"))
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    for label in (
        "Successful requests:",
        "Maximum request concurrency:",
        "Benchmark duration (s):",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Mean TTFT (ms):",
        "P90 TTFT (ms):",
        "P99 E2EL (ms):",
        "Cached-token ratio (%):",
        "Oracle cached-token ratio (%):",
    ):
        assert any(line.startswith(label) for line in lines), label
    assert "---------------Time to First Token----------------" in lines
    ratio = next(line for line in lines if line.startswith("Cached-token ratio"))
    assert ratio.split()[-1] == "50.00"


def test_a_request_without_text_succeeds_without_a_ttft() -> None:
    empty = RequestRecord(0, 0, 0.0, end=0.05)
    empty.completion_tokens, empty.prompt_tokens = 0, 10
    metrics = compute_metrics([empty, _record(0.0, [0.2], 0.2, 1)], 1.0, [50])
    assert metrics.completed == 2 and metrics.failed == 0
    assert metrics.latencies["ttft"].mean == pytest.approx(200)  # only the request with text
    assert metrics.latencies["e2el"].mean == pytest.approx(125)


def test_concurrency_cap_warning_names_the_limit_and_why(llama_dir: Path) -> None:
    tokenizer = TextTokenizer.from_dir(llama_dir)
    multi_turn = build_workload("multi-turn", tokenizer, 0, _options(num_prompts=24, turns=4))
    assert len(multi_turn.conversations) == 6
    assert concurrency_cap_warning(multi_turn, [1, 6, None]) is None  # None: unlimited
    warning = concurrency_cap_warning(multi_turn, [4, 16, 8, 16])
    assert warning is not None
    assert "--max-concurrency 8 16 " in warning and "capped at 6" in warning
    assert "6 conversations" in warning and "--turns 4" in warning
    single = build_workload("random", tokenizer, 0, _options(num_prompts=5))
    warning = concurrency_cap_warning(single, [8])
    assert warning is not None and "5 requests (--num-prompts)" in warning and "capped at 5" in warning


def test_bench_serve_warns_once_per_sweep(
    llama_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sweep whose points all exceed the workload's 2 conversations: one warning, not one per point."""
    runs: list[serve.ServeSettings] = []
    monkeypatch.setattr(serve, "run_serve", lambda settings: runs.append(settings) or [])
    monkeypatch.setattr(serve, "write_results", lambda *args: None)
    argv = ["serve", "--model", "tiny", "--tokenizer", str(llama_dir), "--disable-tqdm"]
    argv += ["--num-prompts", "8", "--turns", "4", "--document-len", "20:30", "--input-len", "8"]
    args = build_bench_parser().parse_args([*argv, "--max-concurrency", "1", "4", "8"])
    args.bench_handler(args)
    assert len(runs) == 1 and len(runs[0].workloads) == 3
    err = capsys.readouterr().err
    assert err.count("warning:") == 1, err
    assert "--max-concurrency 4 8 " in err and "capped at 2" in err
    args = build_bench_parser().parse_args([*argv, "--max-concurrency", "1", "2"])
    args.bench_handler(args)
    assert "warning:" not in capsys.readouterr().err
