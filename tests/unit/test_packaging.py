"""What each install brings: the gateway alone (``kvroute[gateway]``, its container image) needs
neither torch nor aiohttp, and runs with both missing."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "aiohttp", "safetensors", "transformers"}


def requirement_names(extra: str) -> set[str]:
    """The project's own requirements with ``extra``, its nested ``kvroute[...]`` extras expanded."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    names: set[str] = set()
    pending, seen = [*project["dependencies"], *project["optional-dependencies"][extra]], {extra}
    while pending:
        requirement = Requirement(pending.pop())
        if requirement.name != "kvroute":
            names.add(requirement.name.lower())
            continue
        for nested in requirement.extras - seen:
            seen.add(nested)
            pending += project["optional-dependencies"][nested]
    return names


def test_the_gateway_extra_brings_no_torch_and_no_aiohttp() -> None:
    gateway = requirement_names("gateway")
    assert not gateway & HEAVY, gateway & HEAVY
    assert {"uvloop", "httptools", "starlette", "uvicorn", "redis", "tokenizers"} <= gateway
    assert {"torch", "safetensors"} <= requirement_names("replica")
    assert requirement_names("all") >= HEAVY  # what scripts/run.sh installs


def test_the_gateway_image_installs_the_gateway_and_bridge_extras_only() -> None:
    """No torch: the replica's sources come along only because ``kvroute`` (launcher.cli) and the
    bridge's publisher import them, which needs no torch (the next test)."""
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile.gateway").read_text(encoding="utf-8")
    installs = [line for line in dockerfile.splitlines() if line.startswith("RUN pip install")]
    assert installs == ['RUN pip install ".[gateway,bridge]" && rm -rf /opt/kvroute/src \\']
    copied = {line.split()[1] for line in dockerfile.splitlines() if line.startswith("COPY ")}
    assert copied == {"pyproject.toml", "kvroute", "gateway", "launcher", "replica", "bridge"}


def test_the_gateway_runs_without_torch_or_aiohttp() -> None:
    """Imported with both made unimportable: the app, its CLI, the whole request path, the bridge."""
    code = (
        "import sys; sys.modules['torch'] = sys.modules['aiohttp'] = None\n"
        "import gateway.app, gateway.settings, launcher.cli, bridge.server, bridge.service\n"
        "settings = gateway.settings.GatewaySettings(redis_url=None, replicas=('http://127.0.0.1:1',))\n"
        "gateway.app.build_app(settings)\n"
        "assert launcher.cli.main is not None"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
