"""deploy/ for docker-compose, checked as files: the compose file, the env file, the Dockerfiles,
the Prometheus scrape config and the Grafana provisioning. No Docker engine is needed: service
commands are run through ``/bin/sh`` against a stand-in ``kvroute`` and parsed by the real CLI
parser; ``docker compose config`` runs where a compose implementation is installed."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
from argparse import Namespace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from tests.helpers.cli_parsing import strict_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
ENV_EXAMPLE = DEPLOY / ".env.example"
REPLICA_SERVICES = ("replica-gpu", "replica-cpu")
KVROUTE_SERVICES = ("gateway", *REPLICA_SERVICES)
REDIS_DEFAULT_PORT = 6379


# -- compose-style variable interpolation -------------------------------------------------------

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*)|(?P<invalid>))"
)
_BRACED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|-|:\?|\?)(?P<arg>.*))?", re.S)


class MissingVariable(KeyError):
    pass


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``,
    ``${VAR:?error}``, ``${VAR?error}``; any other ``$`` is an error, as in compose."""

    def replace(match: re.Match[str]) -> str:
        assert match.group("invalid") is None, f"invalid interpolation in {text!r}: write $$ for a $"
        if match.group("escaped"):
            return "$"
        if match.group("named"):
            return env.get(match.group("named"), "")
        braced = _BRACED.fullmatch(match.group("braced"))
        assert braced is not None, f"bad interpolation {match.group(0)!r}"
        name, op, arg = braced.group("name", "op", "arg")
        value = env.get(name)
        if op is None:
            return value or ""
        if op == ":-":
            return value if value else interpolate(arg, env)
        if op == "-":
            return value if value is not None else interpolate(arg, env)
        if (op == ":?" and not value) or (op == "?" and value is None):
            raise MissingVariable(f"{name}: {arg}")
        return value or ""

    return _VARIABLE.sub(replace, text)


def interpolate_tree(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_tree(item, env) for item in node]
    if isinstance(node, dict):
        return {key: interpolate_tree(value, env) for key, value in node.items()}
    return node


def variables_in(node: Any) -> set[str]:
    """Names of the variables a compose tree interpolates (``$$`` escapes excluded)."""
    if isinstance(node, str):
        names = set()
        for match in _VARIABLE.finditer(node):
            if match.group("named"):
                names.add(match.group("named"))
            elif match.group("braced"):
                braced = _BRACED.fullmatch(match.group("braced"))
                assert braced is not None
                names.add(braced.group("name"))
        return names
    if isinstance(node, list):
        return set().union(*(variables_in(item) for item in node)) if node else set()
    if isinstance(node, dict):
        return set().union(*(variables_in(value) for value in node.values())) if node else set()
    return set()


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"not KEY=VALUE in {path.name}: {line!r}"
            env[key.strip()] = value.strip()
    return env


# -- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def raw_compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(data, dict) and isinstance(data.get("services"), dict)
    return data


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def services(raw_compose: dict[str, Any], env_example: dict[str, str]) -> dict[str, dict[str, Any]]:
    """The services as compose sees them with the example env file."""
    return interpolate_tree(raw_compose, env_example)["services"]


def run_command(service: dict[str, Any], tmp_path: Path, env: dict[str, str] | None = None) -> list[str]:
    """Runs a service's entrypoint + command through the real /bin/sh with a stand-in ``kvroute``
    that records its argv; returns the argv ``kvroute`` received."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir(exist_ok=True)
    fake = fake_bin / "kvroute"
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "json.dump(sys.argv[1:], open(os.environ['ARGV_OUT'], 'w'))\n",
        encoding="utf-8",
    )
    fake.chmod(0o755)
    argv_out = tmp_path / "argv.json"
    argv = [*service.get("entrypoint", []), *service["command"]]
    assert argv[:2] == ["/bin/sh", "-c"] and len(argv) == 3, argv
    hostname_dir = Path(shutil.which("hostname") or "/bin/hostname").parent
    result = subprocess.run(
        argv,
        env={"PATH": f"{fake_bin}:{hostname_dir}:/usr/bin:/bin", "ARGV_OUT": str(argv_out), **(env or {})},
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(argv_out.read_text(encoding="utf-8"))


def parse_kvroute(argv: list[str]) -> Namespace:
    return strict_parser().parse_args(argv)


def healthcheck_url(service: dict[str, Any]) -> str:
    test = " ".join(service["healthcheck"]["test"])
    match = re.search(r"http://[^'\" ]+", test)
    assert match, test
    return match.group(0)


def container_port_of(name: str, services: dict[str, dict[str, Any]], tmp_path: Path) -> int:
    """The port a compose service listens on inside the network."""
    if name == "redis":
        command = services["redis"].get("command", [])
        return int(command[command.index("--port") + 1]) if "--port" in command else REDIS_DEFAULT_PORT
    if name in KVROUTE_SERVICES:
        return parse_kvroute(run_command(services[name], tmp_path)).port
    ports = [urlsplit(healthcheck_url(services[name])).port]
    assert ports[0] is not None
    return ports[0]


# -- the compose file ---------------------------------------------------------------------------


def test_every_service_has_a_healthcheck_and_a_restart_policy(services: dict[str, dict[str, Any]]) -> None:
    assert {"redis", "gateway", *REPLICA_SERVICES, "prometheus", "grafana"} <= set(services)
    for name, service in services.items():
        check = service.get("healthcheck")
        assert check and check.get("test") and not check.get("disable"), f"{name} has no healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
        assert service.get("restart") in ("unless-stopped", "always", "on-failure"), name


def test_depends_on_waits_for_healthy_services_that_exist(services: dict[str, dict[str, Any]]) -> None:
    seen = 0
    for name, service in services.items():
        depends_on = service.get("depends_on", {})
        assert isinstance(depends_on, dict), f"{name}: depends_on must be the long form with a condition"
        for dependency, spec in depends_on.items():
            assert dependency in services, f"{name} depends on unknown service {dependency}"
            assert spec == {"condition": "service_healthy"}, f"{name} -> {dependency}: {spec}"
            # A dependency must be active whenever the dependent is: no profile, or the same ones.
            assert set(services[dependency].get("profiles", [])) <= set(service.get("profiles", [])), name
            seen += 1
    assert services["gateway"]["depends_on"].keys() == {"redis"}
    assert all(services[name]["depends_on"].keys() == {"redis"} for name in REPLICA_SERVICES)
    assert seen >= 5


def test_profiles_gpu_by_default_cpu_variant_and_monitoring(
    services: dict[str, dict[str, Any]], env_example: dict[str, str]
) -> None:
    assert "profiles" not in services["redis"] and "profiles" not in services["gateway"]
    assert services["replica-gpu"]["profiles"] == ["gpu"]
    assert services["replica-cpu"]["profiles"] == ["cpu"]
    assert services["prometheus"]["profiles"] == ["monitoring"]
    assert services["grafana"]["profiles"] == ["monitoring"]
    assert env_example["COMPOSE_PROFILES"].split(",")[0] == "gpu"
    reservation = services["replica-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert reservation == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "resources" not in services["replica-cpu"].get("deploy", {}), "the CPU variant must not need a GPU"
    assert services["replica-gpu"]["image"].startswith("kvroute-cuda")
    assert services["replica-cpu"]["image"].startswith("kvroute-cpu")
    assert services["gateway"]["image"].startswith("kvroute-gateway"), "the torch-free gateway image"


def test_scaling_is_one_number(services: dict[str, dict[str, Any]], raw_compose: dict[str, Any]) -> None:
    for name in REPLICA_SERVICES:
        assert raw_compose["services"][name]["deploy"]["replicas"] == "${KVROUTE_REPLICAS:-2}"
        assert int(services[name]["deploy"]["replicas"]) == 2
        scaled = interpolate_tree(raw_compose, {"KVROUTE_REPLICAS": "5", **_keys()})["services"][name]
        assert scaled["deploy"]["replicas"] == "5"
        # Nothing that two containers of one service could collide on.
        assert "ports" not in services[name] and "container_name" not in services[name]
        assert "hostname" not in services[name], "scaled containers need their own hostnames"
        assert services[name]["networks"]["default"]["aliases"] == ["replicas"]


def _keys() -> dict[str, str]:
    return {
        name: "k"
        for name in ("KVROUTE_API_KEYS", "KVROUTE_ADMIN_KEY", "KVROUTE_REPLICA_KEY", "GRAFANA_ADMIN_PASSWORD")
    }


def test_every_variable_comes_from_the_env_file(
    raw_compose: dict[str, Any], env_example: dict[str, str]
) -> None:
    used = variables_in(raw_compose)
    documented = set(env_example) | set(
        re.findall(r"^#\s*([A-Z][A-Z0-9_]*)=", ENV_EXAMPLE.read_text(encoding="utf-8"), re.M)
    )
    assert used <= documented, f"not in .env.example: {sorted(used - documented)}"
    unused = {name for name in documented - used if not name.startswith("COMPOSE_")}
    assert not unused, f".env.example documents unused variables: {sorted(unused)}"
    with pytest.raises(MissingVariable, match="KVROUTE_ADMIN_KEY"):  # keys are required, never empty-by-typo
        interpolate_tree(raw_compose, {k: v for k, v in env_example.items() if k != "KVROUTE_ADMIN_KEY"})


def test_each_container_gets_only_its_keys(services: dict[str, dict[str, Any]]) -> None:
    keys = {"KVROUTE_API_KEYS", "KVROUTE_ADMIN_KEY", "KVROUTE_REPLICA_KEY"}
    assert set(services["gateway"]["environment"]) == keys
    for name in REPLICA_SERVICES:
        assert set(services[name]["environment"]) == {"KVROUTE_REPLICA_KEY"}
    assert all(value.startswith("replace-me") for value in services["gateway"]["environment"].values())
    assert "env_file" not in services["redis"] and not set(services["redis"].get("environment", {})) & keys


def test_gateway_command_parses_and_points_at_existing_services(
    services: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    args = parse_kvroute(run_command(services["gateway"], tmp_path))
    assert args.command == "gateway" and args.host == "0.0.0.0"
    assert [port.split(":")[-1] for port in services["gateway"]["ports"]] == [str(args.port)]
    assert urlsplit(healthcheck_url(services["gateway"])).port == args.port
    for url in [args.redis, *args.replica]:
        parts = urlsplit(url)
        assert parts.hostname in services, f"{url}: no such service"
        assert parts.port == container_port_of(parts.hostname, services, tmp_path), url
    assert urlsplit(args.redis).hostname == "redis"


@pytest.mark.parametrize("name", REPLICA_SERVICES)
def test_replica_command_advertises_its_own_container(
    name: str, services: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """``http://$(hostname):8001``: each scaled container registers its own hostname (its short id,
    which Docker's DNS resolves on the compose network), expanded by the container's shell."""
    argv = run_command(services[name], tmp_path)
    args = parse_kvroute(argv)
    assert args.command == "replica" and args.host == "0.0.0.0"
    advertised = urlsplit(args.advertise_url)
    assert advertised.hostname == socket.gethostname() and advertised.port == args.port
    assert args.replica_id is None, "the default id (advertised host:port) differs per container"
    assert urlsplit(healthcheck_url(services[name])).port == args.port
    redis = urlsplit(args.redis)
    assert redis.hostname == "redis" and redis.port == container_port_of("redis", services, tmp_path)
    assert args.device == ("cuda" if name == "replica-gpu" else "cpu")
    assert str(args.model) == baked_model_path()
    assert any(volume.endswith(":/models:ro") for volume in services[name]["volumes"])


def test_replica_settings_from_the_env_file_reach_the_command(
    raw_compose: dict[str, Any], env_example: dict[str, str], tmp_path: Path
) -> None:
    env = {
        **env_example,
        "KVROUTE_MODEL": "/models/My Model",
        "KVROUTE_REPLICA_ARGS": "--dtype bfloat16 --max-num-seqs 7",
        "KVROUTE_KV_CACHE_GB": "12.5",
    }
    service = interpolate_tree(raw_compose, env)["services"]["replica-gpu"]
    args = parse_kvroute(run_command(service, tmp_path))
    assert str(args.model) == "/models/My Model"  # quoted: a path with a space stays one argument
    assert (args.dtype, args.max_num_seqs, args.kv_cache_memory_gb) == ("bfloat16", 7, 12.5)


def test_compose_config_passes_where_compose_is_installed() -> None:
    commands = available_compose_commands()
    if not commands:
        pytest.skip("neither `docker compose` nor `docker-compose` works here")
    for command in commands:
        for profile in ("gpu", "cpu", "monitoring"):
            options = ["--env-file", ".env.example", "--profile", profile, "-f", "docker-compose.yml"]
            result = subprocess.run(
                [*command, *options, "config", "-q"],
                cwd=DEPLOY,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert result.returncode == 0, f"{shlex.join(command)} config ({profile}): {result.stderr}"


def available_compose_commands() -> list[list[str]]:
    found = []
    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        try:
            probe = subprocess.run([*command, "version"], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            found.append(command)
    return found


# -- images -------------------------------------------------------------------------------------


def dockerfile_lines(path: Path) -> list[str]:
    """Instructions with continuation lines joined and comments dropped."""
    lines, current = [], ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        current += " " + stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            lines.append(current.strip())
            current = ""
    return lines


def baked_model_path() -> str:
    paths = set()
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = " ".join(dockerfile_lines(DEPLOY / "docker" / name))
        match = re.search(r"kvroute prepare-model --out (\S+)", text)
        assert match, f"{name} does not bake the default model"
        paths.add(match.group(1))
    assert len(paths) == 1
    return paths.pop()


def _ignore_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def included_in_context(path: str, ignore_file: Path) -> bool:
    """Docker's .dockerignore rule: the last pattern matching the path or one of its parents wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    included = True
    for line in ignore_file.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        regex = _ignore_regex(line.removeprefix("!").strip("/"))
        if any(regex.fullmatch(candidate) for candidate in candidates):
            included = negated
    return included


IMAGE_SOURCES = {
    "Dockerfile.cpu": {"pyproject.toml", "kvroute", "replica", "gateway", "launcher", "loadtests"},
    "Dockerfile.cuda": {"pyproject.toml", "kvroute", "replica", "gateway", "launcher", "loadtests"},
    "Dockerfile.gateway": {"pyproject.toml", "kvroute", "gateway", "launcher", "replica", "bridge"},
}


@pytest.mark.parametrize("name", sorted(IMAGE_SOURCES))
def test_dockerfile_sources_exist_and_reach_the_build(name: str, services: dict[str, dict[str, Any]]) -> None:
    dockerfile = DEPLOY / "docker" / name
    ignore_file = dockerfile.with_name(name + ".dockerignore")
    builds = [s["build"] for s in services.values() if "build" in s]
    assert {"context": "..", "dockerfile": f"deploy/docker/{name}"} in builds
    copies = [line.split()[1:-1] for line in dockerfile_lines(dockerfile) if line.startswith("COPY ")]
    sources = [src for args in copies if not args[0].startswith("--from") for src in args]
    assert IMAGE_SOURCES[name] <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), f"{name}: COPY {source}: missing"
        path = ROOT / source
        files = [path] if path.is_file() else [p for p in path.rglob("*.py") if "__pycache__" not in p.parts]
        for file in files:
            relative = str(file.relative_to(ROOT))
            assert included_in_context(relative, ignore_file), f"{name}: build context lacks {relative}"
    for excluded in (".venv/bin/python", "tests/conftest.py", ".git/HEAD", "kvroute/__pycache__/cli.pyc"):
        assert not included_in_context(excluded, ignore_file), excluded
    assert dockerfile_lines(dockerfile)[-2:] == ['ENTRYPOINT ["kvroute"]', 'CMD ["--help"]']


def test_cpu_image_installs_the_pinned_cpu_torch_first() -> None:
    lines = dockerfile_lines(DEPLOY / "docker" / "Dockerfile.cpu")
    pinned = re.search(r"torch==([\d.]+)", (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8"))
    assert pinned and f"ARG TORCH_VERSION={pinned.group(1)}" in lines
    torch_at = next(i for i, line in enumerate(lines) if "torch==${TORCH_VERSION}" in line)
    assert "--index-url https://download.pytorch.org/whl/cpu" in lines[torch_at]
    project_at = next(i for i, line in enumerate(lines) if re.search(r'pip install "?\.', line))
    assert torch_at < project_at
    assert lines[0].startswith("ARG PYTHON_IMAGE=python:3.11-slim")


def test_cuda_image_builds_on_a_pytorch_cuda_runtime() -> None:
    lines = dockerfile_lines(DEPLOY / "docker" / "Dockerfile.cuda")
    base = next(line for line in lines if line.startswith("ARG CUDA_BASE_IMAGE="))
    assert re.fullmatch(r"ARG CUDA_BASE_IMAGE=pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-runtime", base)
    assert lines[1] == "FROM ${CUDA_BASE_IMAGE} AS base"
    assert not any("torch==" in line for line in lines), "the base image's CUDA torch must stay"


# -- monitoring: Prometheus and Grafana ---------------------------------------------------------


def test_prometheus_scrapes_the_gateway_and_every_replica(
    services: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    (volume,) = services["prometheus"]["volumes"]
    source, target, mode = volume.split(":")
    assert (target, mode) == ("/etc/prometheus/prometheus.yml", "ro")
    config = yaml.safe_load((DEPLOY / source).read_text(encoding="utf-8"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"kvroute-gateway", "kvroute-replica"}
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in jobs.values())
    targets = [t for group in jobs["kvroute-gateway"]["static_configs"] for t in group["targets"]]
    gateway_port = container_port_of("gateway", services, tmp_path)
    assert targets == [f"gateway:{gateway_port}"]
    (discovery,) = jobs["kvroute-replica"]["dns_sd_configs"]
    assert discovery["type"] == "A"
    for name in REPLICA_SERVICES:
        assert discovery["names"] == services[name]["networks"]["default"]["aliases"]
        assert discovery["port"] == container_port_of(name, services, tmp_path)


def test_grafana_provisioning_matches_compose_and_the_dashboard(services: dict[str, dict[str, Any]]) -> None:
    grafana = services["grafana"]
    assert all(v.endswith(":ro") for v in grafana["volumes"])
    mounts = {target: source for source, target, _mode in (v.split(":") for v in grafana["volumes"])}
    provisioning = DEPLOY / mounts["/etc/grafana/provisioning"]
    (datasource,) = yaml.safe_load(
        (provisioning / "datasources" / "prometheus.yml").read_text(encoding="utf-8")
    )["datasources"]
    url = urlsplit(datasource["url"])
    assert url.hostname == "prometheus" and datasource["type"] == "prometheus"
    assert url.port == urlsplit(healthcheck_url(services["prometheus"])).port
    assert any(port.endswith(f":{url.port}") for port in services["prometheus"]["ports"])
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "kvroute.yml").read_text(encoding="utf-8"))[
        "providers"
    ]
    dashboards_dir = DEPLOY / mounts[provider["options"]["path"]]
    home = Path(grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert (dashboards_dir / home.relative_to(provider["options"]["path"])).is_file()
    dashboard_files = sorted(dashboards_dir.glob("*.json"))
    assert dashboard_files
    for path in dashboard_files:
        dashboard = json.loads(path.read_text(encoding="utf-8"))
        panels = [p for p in dashboard["panels"] if p["type"] != "row"]
        assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
        for panel in panels:
            assert panel["datasource"]["uid"] == datasource["uid"], panel["title"]
            assert panel["gridPos"]["x"] >= 0 and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
            ref_ids = [t["refId"] for t in panel["targets"]]
            assert panel["targets"] and len(set(ref_ids)) == len(ref_ids), panel["title"]
            for target in panel["targets"]:
                assert target["expr"].strip() and target["datasource"]["uid"] == datasource["uid"]


def test_compose_mounts_exist(services: dict[str, dict[str, Any]]) -> None:
    sources = [v.split(":")[0] for s in services.values() for v in s.get("volumes", [])]
    assert "./models" in sources and len(sources) >= 5
    for source in sources:
        assert source.startswith("./") and (DEPLOY / source).exists(), f"{source} missing"


# -- the vllm profile: a vLLM server and its bridge --------------------------------------------


def _vllm_events(service: dict[str, Any]) -> dict[str, Any]:
    command = service["command"]
    return json.loads(command[command.index("--kv-events-config") + 1])


def test_the_vllm_profile_pairs_a_vllm_server_with_its_bridge(
    services: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    vllm, bridge = services["vllm"], services["vllm-bridge"]
    assert vllm["profiles"] == bridge["profiles"] == ["vllm"]
    assert bridge["image"].startswith("kvroute-gateway"), "the bridge runs from the torch-free image"
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(vllm["command"])
    assert vllm["environment"] == {"VLLM_API_KEY": "replace-me-replica-key"}  # gateways' replica key
    assert set(bridge["environment"]) == {"KVROUTE_REPLICA_KEY"}
    args = parse_kvroute(run_command(bridge, tmp_path))
    assert args.command == "bridge" and args.host == "0.0.0.0"
    engine = urlsplit(args.engine_url)
    assert engine.hostname == "vllm" and engine.port == container_port_of("vllm", services, tmp_path)
    events = _vllm_events(vllm)
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    for bridge_side, vllm_side in (
        (args.events, events["endpoint"]),
        (args.replay, events["replay_endpoint"]),
    ):
        assert urlsplit(vllm_side).hostname == "*", "vLLM binds, the bridge connects"
        assert (
            urlsplit(bridge_side).hostname == "vllm"
            and urlsplit(bridge_side).port == urlsplit(vllm_side).port
        )
    assert args.model == vllm["command"][0], "the bridge reads the tokenizer of the model vLLM serves"
    tokenizer = urlsplit(args.tokenizer_url)
    assert tokenizer.hostname == "vllm-bridge" and tokenizer.port == args.port
    assert urlsplit(healthcheck_url(bridge)).port == args.port
    assert urlsplit(args.redis).hostname == "redis"
