"""``kvroute up`` end to end on the tiny model: healthy, serves, stops every child, refuses busy ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from kvroute.local_redis import free_port


def children_of(pid: int) -> set[int]:
    """PIDs whose parent is ``pid`` (from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


KEY = "stack-key"  # keys reach every child through the environment


def up(llama_dir: Path, port: int, *extra: str) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "kvroute.cli", "up", "--model", str(llama_dir), "--port", str(port),
        "--replicas", "2", "--dtype", "float32", "--kv-cache-memory-gb", "0.02", *extra,
    ]  # fmt: skip
    env = {**os.environ, "KVROUTE_API_KEYS": KEY, "KVROUTE_REPLICA_KEY": "replica-key"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_until_up(stack: subprocess.Popen[str]) -> str:
    """Reads the stack's output until it says it is up; returns the printed base URL."""
    assert stack.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 180
    while not any("kvroute is up" in line for line in lines):
        assert time.monotonic() < deadline and stack.poll() is None, "".join(lines)
        lines.append(stack.stdout.readline())
    return re.search(r"OpenAI base URL (\S+)", "".join(lines)).group(1)  # type: ignore[union-attr]


def test_up_serves_and_stops_cleanly(llama_dir: Path) -> None:
    port = free_port()
    stack = up(llama_dir, port)
    try:
        base_url = wait_until_up(stack)
        messages = [{"role": "user", "content": "Hello!"}]
        reply = OpenAI(base_url=base_url, api_key=KEY, max_retries=0).chat.completions.create(
            model=llama_dir.name, messages=messages, max_tokens=4
        )
        assert reply.choices[0].message.content is not None
        with pytest.raises(openai.AuthenticationError):
            OpenAI(base_url=base_url, api_key="wrong", max_retries=0).chat.completions.create(
                model=llama_dir.name, messages=messages, max_tokens=4
            )
        children = children_of(stack.pid)
        assert len(children) >= 4, "redis-server, two replicas and the gateway"

        busy = up(llama_dir, port)
        output, _ = busy.communicate(timeout=120)
        assert busy.returncode != 0 and f"port {port}" in output and "busy" in output

        stack.send_signal(signal.SIGTERM)
        stack.wait(timeout=90)
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if alive(pid)], "children outlived the stack"
    finally:
        if stack.poll() is None:
            stack.kill()
            pytest.fail("kvroute up did not stop on SIGTERM")


def test_up_with_simulated_replicas(llama_dir: Path) -> None:
    stack = up(llama_dir, free_port(), "--engine", "sim", "--profile", "instant")
    try:
        base_url = wait_until_up(stack)
        reply = OpenAI(base_url=base_url, api_key=KEY, max_retries=0).chat.completions.create(
            model=llama_dir.name, messages=[{"role": "user", "content": "Hello!"}], max_tokens=5
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 5  # sim: exactly max_tokens
        stack.send_signal(signal.SIGTERM)
        assert stack.wait(timeout=90) == 0
    finally:
        if stack.poll() is None:
            stack.kill()
