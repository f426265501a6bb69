"""The ``kvroute`` command line: subcommands run, and bad settings fail with a clear message."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.priority import DEFAULT_NICE
from gateway.settings import GatewaySettings
from kvroute.http_server import ServerLimits
from kvroute.protocol import default_advertise_url, replica_id_for
from kvroute.settings import HelpFormatter, format_default, from_args, shows_default
from launcher.cli import build_parser, main
from launcher.stack import StackSettings
from replica.engine.config import EngineConfig
from replica.publisher import PublisherConfig


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


def test_the_serving_cli_does_not_load_the_load_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """DESIGN: nothing the product runs imports loadtests/; `kvroute bench` runs them as a program."""
    code = "import sys, launcher.cli; launcher.cli.build_parser()\n"
    code += "sys.exit(any(m.startswith('loadtests') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
    execs: list[tuple[str, list[str]]] = []
    monkeypatch.setattr("os.execv", lambda path, argv: execs.append((path, argv)))
    main(["bench", "--help"])
    main(["bench", "serve", "--num-prompts", "4"])
    assert execs == [
        (sys.executable, [sys.executable, "-m", "loadtests", "--help"]),
        (sys.executable, [sys.executable, "-m", "loadtests", "serve", "--num-prompts", "4"]),
    ]
    if importlib.util.find_spec("loadtests.__main__") is not None:  # the load tests' own program
        bench_help = kvroute("bench", "--help")
        assert bench_help.returncode == 0 and "{serve,compare}" in bench_help.stdout


def _loads_torch(code: str) -> bool:
    check = f"{code}\nimport sys; sys.exit(3 if 'torch' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert result.returncode in (0, 3), result.stderr
    return result.returncode == 3


def test_the_gateway_side_never_loads_torch() -> None:
    assert not _loads_torch("import gateway.cli")
    assert not _loads_torch("import replica.cli, replica.tools.cli")  # their parsers are in every --help
    help_only = "import contextlib\nfrom launcher.cli import main\nwith contextlib.suppress(SystemExit):\n"
    assert not _loads_torch(help_only + "  main(['gateway', '--help'])")


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.fixture
def no_key_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("KVROUTE_API_KEYS", "KVROUTE_ADMIN_KEY", "KVROUTE_REPLICA_KEY"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_settings_defaults_are_the_flags_defaults(no_key_env: pytest.MonkeyPatch) -> None:
    """One source: a command line that sets nothing builds the dataclasses' own defaults."""
    assert from_args(GatewaySettings, _parse("gateway", "--redis", "redis://r")) == GatewaySettings(
        "redis://r"
    )
    model = Path("m")
    assert from_args(EngineConfig, _parse("replica"), model=model) == EngineConfig(model)
    urls = {"advertise_url": "http://a:1", "replica_id": "a:1"}
    published = from_args(PublisherConfig, _parse("replica", "--redis", "redis://r"), **urls)
    assert published == PublisherConfig("redis://r", **urls)
    assert from_args(StackSettings, _parse("up")) == StackSettings()


def test_gateway_keys_come_from_flags_else_the_environment(
    no_key_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import gateway.app

    runs: list[tuple[GatewaySettings, str, int, str, ServerLimits, int]] = []
    no_key_env.setattr(gateway.app, "run_gateway", lambda *args: runs.append(args))
    no_key_env.setenv("KVROUTE_API_KEYS", " k1, k2,,k1")
    no_key_env.setenv("KVROUTE_ADMIN_KEY", "admin")
    no_key_env.setenv("KVROUTE_REPLICA_KEY", "rk")
    main(["gateway", "--replica", "http://r:1", "--port", "9000", "--log-level", "debug"])
    main(
        [
            "gateway",
            "--redis",
            "redis://r",
            "--api-key",
            "mine",
            "--admin-key",
            "a2",
            "--metrics-key-required",
            "--nice",
            "0",
        ]
    )
    (first, host, port, level, limits, nice), (second, *_, second_nice) = runs
    assert limits == ServerLimits()
    assert (nice, second_nice) == (DEFAULT_NICE, 0)
    assert (first.api_keys, first.admin_key, first.replica_key) == (("k1", "k2"), "admin", "rk")
    assert (first.replicas, first.redis_url, host, port, level) == (
        ("http://r:1",),
        None,
        "127.0.0.1",
        9000,
        "debug",
    )
    assert (second.api_keys, second.admin_key, second.metrics_key_required) == (("mine",), "a2", True)
    with pytest.raises(SystemExit, match="give --redis URL"):
        main(["gateway"])


def test_replica_settings_from_its_flags(
    no_key_env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import replica.server.app

    runs: list[tuple[tuple[object, ...], dict[str, object]]] = []
    no_key_env.setattr(replica.server.app, "run_server", lambda *args, **kwargs: runs.append((args, kwargs)))
    no_key_env.setenv("KVROUTE_REPLICA_KEY", "rk")
    base = ["replica", "--model", str(tmp_path)]
    main([*base, "--engine", "sim", "--profile", "instant", "--max-num-seqs", "8", "--max-body-bytes", "100"])
    main([*base, "--host", "0.0.0.0", "--port", "9001", "--redis", "redis://r", "--heartbeat-ttl", "3"])
    main([*base, "--redis", "redis://r", "--advertise-url", "http://pod:80", "--api-key", "mine"])
    (config, host, port), options = runs[0]
    assert config == EngineConfig(tmp_path, engine="sim", sim_profile="instant", max_num_seqs=8)
    assert (host, port, options["request_limits"].max_body_bytes, options["api_key"]) == (
        "127.0.0.1",
        8001,
        100,
        "rk",
    )
    assert options["request_limits"].body_timeout_s == 30.0 and options["limits"] == ServerLimits()
    assert options["publisher_config"] is None
    url = default_advertise_url("0.0.0.0", 9001)
    assert runs[1][1]["publisher_config"] == PublisherConfig(
        "redis://r", replica_id_for(url), url, heartbeat_ttl=3.0
    )
    published = runs[2][1]["publisher_config"]
    assert isinstance(published, PublisherConfig) and runs[2][1]["api_key"] == "mine"
    assert (published.advertise_url, published.replica_id) == ("http://pod:80", "pod:80")
    with pytest.raises(SystemExit, match="--profile needs --engine sim"):
        main([*base, "--profile", "instant"])


def test_up_hands_the_replica_options_on(no_key_env: pytest.MonkeyPatch) -> None:
    import launcher.stack

    runs: list[StackSettings] = []
    no_key_env.setattr(launcher.stack, "run_stack", runs.append)
    main(["up"])
    stack = ["--replicas", "3", "--policy", "session", "--redis", "redis://r", "--api-key", "k"]
    sim = ["--engine", "sim", "--profile", "instant"]
    main(["up", *stack, *sim, "--replica-arg=--seed=1", "--gateway-arg=--lam=2"])
    default, custom = runs
    engine = ["--dtype", "auto", "--kv-cache-memory-gb", "1.0", "--engine"]
    assert default == StackSettings(replica_args=[*engine, "torch"])
    assert custom == StackSettings(
        replicas=3,
        redis_url="redis://r",
        policy="session",
        api_keys=("k",),
        replica_args=[*engine, "sim", "--profile", "instant", "--seed=1"],
        gateway_args=["--lam=2"],
    )
    with pytest.raises(SystemExit, match="--replicas must be at least 1"):
        main(["up", "--replicas", "0"])


def test_every_environment_fallback_is_named_in_its_help() -> None:
    from kvroute.settings import options

    for cls in (GatewaySettings, EngineConfig, PublisherConfig, StackSettings):
        for opt in options(cls):
            assert opt.env is None or opt.env in opt.help, f"{cls.__name__}.{opt.field.name}"


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
    """The rule of kvroute.settings.HelpFormatter: a value default is shown; flags, repeatable and
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
