"""The ``kvroute`` command line: subcommands run, and bad settings fail with a clear message."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.cli import HelpFormatter, build_parser, format_default, main, shows_default


def kvroute(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_replica_with_a_missing_model_fails_cleanly(tmp_path: Path) -> None:
    result = kvroute("replica", "--model", str(tmp_path / "nowhere"))
    assert result.returncode != 0
    assert "no config.json" in result.stderr and "Traceback" not in result.stderr


def test_replica_with_an_unsupported_architecture_names_it(tmp_path: Path, llama_dir: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    config = json.loads((llama_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model / "config.json").write_text(json.dumps(config))
    result = kvroute("replica", "--model", str(model))
    assert result.returncode != 0
    assert "GPT2LMHeadModel" in result.stderr and "Traceback" not in result.stderr


def test_replica_rejects_a_token_budget_below_the_sequence_cap(llama_dir: Path) -> None:
    result = kvroute("replica", "--model", str(llama_dir), "--max-num-batched-tokens", "8")
    assert result.returncode != 0 and "max_num_batched_tokens" in result.stderr


def test_make_test_model_and_memory_planner(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    made = kvroute("make-test-model", "--arch", "qwen3", "--out", str(out), "--shards", "2")
    assert made.returncode == 0, made.stderr
    assert (out / "model.safetensors.index.json").is_file()
    plan = kvroute("memory", str(out), "--context", "4096", "--gpu-memory", "1")
    assert plan.returncode == 0, plan.stderr
    assert "KV" in plan.stdout


def test_the_serving_cli_does_not_load_the_load_tests() -> None:
    """DESIGN: nothing imports loadtests/; `kvroute bench` imports it only when it runs."""
    code = "import sys, launcher.cli; sys.exit(any(m.startswith('loadtests') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
    bench_help = kvroute("bench", "--help")
    assert bench_help.returncode == 0 and "{serve,compare}" in bench_help.stdout


def _all_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every parser a user reaches with --help, by command line: kvroute, its commands, and
    ``kvroute bench`` with its own (the kvroute-side ``bench`` stub only forwards its arguments)."""
    from loadtests.bench_cli import build_bench_parser

    found: dict[str, argparse.ArgumentParser] = {}

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        found[name] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for command, subparser in action.choices.items():
                    walk(f"{name} {command}", subparser)

    walk("kvroute", build_parser())
    walk("kvroute bench", build_bench_parser())
    return found


def _commands() -> dict[str, argparse.ArgumentParser]:
    groups = ("kvroute", "kvroute bench")
    return {name: parser for name, parser in _all_parsers().items() if name not in groups}


def test_every_command_is_walked() -> None:
    names = set(_all_parsers())
    expected = {"up", "replica", "gateway", "calibrate", "prepare-model", "make-test-model", "memory"}
    assert {f"kvroute {name}" for name in expected} <= names
    assert {"kvroute bench serve", "kvroute bench compare"} <= names


def test_every_option_says_its_default() -> None:
    """The rule of launcher.cli.HelpFormatter: a value default is shown; flags, repeatable and
    required options need none; every other option says its default in words."""
    for name, parser in _all_parsers().items():
        assert parser.formatter_class is HelpFormatter, name
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            where = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help and action.help.strip(), f"{where}: no help"
            text = formatter._expand_help(action)
            if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) or action.required:
                continue
            if isinstance(action, argparse._AppendAction):
                assert "repeatable" in text, f"{where}: {text!r}"
                continue
            assert "default" in text, f"{where} does not say its default: {text!r}"
            if shows_default(action):
                assert text.endswith(f"(default: {format_default(action.default)})"), where
        help_text = parser.format_help()
        for useless in ("(default: None)", "(default: False)", "(default: [])", "==SUPPRESS=="):
            assert useless not in help_text, f"{name}: {useless}"


def _option_help(command: str, option: str) -> str:
    parser = _all_parsers()[command]
    action = next(a for a in parser._actions if option in a.option_strings)
    return parser._get_formatter()._expand_help(action)


def test_value_defaults_are_printed_as_typed() -> None:
    policies = _option_help("kvroute bench compare", "--policies")
    assert policies.endswith("(default: kv round-robin least-loaded random session)")
    assert _option_help("kvroute bench serve", "--out").endswith("(default: results/bench_serve.json)")
    assert _option_help("kvroute bench serve", "--document-len").endswith("(default: 1024:4096)")
    assert _option_help("kvroute replica", "--seed").endswith("(default: 0)")  # 0 is a value, not "none"
    # an environment default stays a name: --help never prints a secret
    assert _option_help("kvroute bench serve", "--api-key").endswith("(default: env OPENAI_API_KEY)")


def test_every_command_ends_with_examples() -> None:
    for name, parser in _commands().items():
        epilog = parser.epilog or ""
        assert epilog.startswith("examples:\n"), name
        assert f"\n  {name} " in epilog or f"\n  {name}\n" in epilog + "\n", f"{name}: no example of itself"
        assert parser.format_help().rstrip().endswith(epilog.rstrip().splitlines()[-1].rstrip()), name
        assert parser.description, f"{name}: no description"
    assert "examples:" in (_all_parsers()["kvroute bench"].epilog or "")


def test_top_level_help_is_plain_and_lists_the_usual_commands() -> None:
    result = kvroute("--help")
    assert result.returncode == 0, result.stderr
    assert "``" not in result.stdout
    assert "lazily" not in result.stdout and "import" not in result.stdout
    description = build_parser().description or ""
    assert "\n\n" not in description.strip()  # one paragraph
    assert "kvroute up" in result.stdout and "kvroute bench serve" in result.stdout
    for name, parser in _all_parsers().items():
        assert "``" not in parser.format_help(), name


def test_memory_context_defaults_to_the_model_window(
    tmp_path: Path, llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    window = json.loads((llama_dir / "config.json").read_text())["max_position_embeddings"]
    main(["memory", str(llama_dir)])
    assert f"at {window:,} tokens" in capsys.readouterr().out
    config = json.loads((llama_dir / "config.json").read_text())
    config["max_position_embeddings"] = 32768
    (tmp_path / "config.json").write_text(json.dumps(config))
    main(["memory", str(tmp_path / "config.json"), "--gpu-memory", "1"])
    out = capsys.readouterr().out
    assert "at 32,768 tokens" in out and "the 32,768-token context" in out and "131,072" not in out
    main(["memory", str(tmp_path), "--context", "100"])
    assert "at 100 tokens" in capsys.readouterr().out
    del config["max_position_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit, match="--context"):
        main(["memory", str(tmp_path)])
