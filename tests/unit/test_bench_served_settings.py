"""The served benchmark's replica options: the served replica and the in-process engine take the
same step budgets, and settings a replica would refuse stop the run before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.bench_served.bench import BENCHMARK
from loadtests.bench_served.servers import replica_command
from loadtests.bench_served.settings import Settings
from replica.engine.config import EngineConfig


def settings(llama_dir: Path, *options: str) -> Settings:
    args = BENCHMARK.parser().parse_args(["--quick", "--vllm", "none", "--model", str(llama_dir), *options])
    return BENCHMARK.settings(args, BENCHMARK.sizes.chosen(args))


def test_step_budgets_reach_the_replica_and_the_in_process_engine(llama_dir: Path) -> None:
    s = settings(llama_dir, "--max-num-batched-tokens", "256", "--max-prefill-step-tokens", "2048")
    command = replica_command(s, 8000, "m")
    assert command[command.index("--max-num-batched-tokens") + 1] == "256"
    assert command[command.index("--max-prefill-step-tokens") + 1] == "2048"
    config = s.engine_config()
    assert (config.max_num_batched_tokens, config.max_prefill_step_tokens) == (256, 2048)
    assert (config.dtype, config.threads) == (s.dtype, s.threads)


def test_defaults_are_the_replicas(llama_dir: Path) -> None:
    config, replica = settings(llama_dir).engine_config(), EngineConfig(model=llama_dir)
    assert config.max_num_batched_tokens == replica.max_num_batched_tokens
    assert config.max_prefill_step_tokens == replica.max_prefill_step_tokens


def test_a_budget_the_replica_would_refuse_stops_the_run(llama_dir: Path) -> None:
    with pytest.raises(SystemExit, match="max_num_seqs"):
        settings(llama_dir, "--max-num-batched-tokens", "8")
