"""``kvroute up`` end to end: healthy, serves, says what runs, stops every child (on a signal, a
closed terminal, or when it is killed outright), refuses busy ports, keeps a chat on its replica."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from launcher.local_redis import free_port
from tests.helpers.chat_turns import converse, lost_turns
from tests.helpers.waiting import wait_until


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


def up(model_dir: Path, port: int, *extra: str, env_keys: bool = True) -> subprocess.Popen[str]:
    command = [
        sys.executable, "-m", "launcher.cli", "up", "--model", str(model_dir), "--port", str(port),
        "--replicas", "2", "--dtype", "float32", "--kv-cache-memory-gb", "0.02", *extra,
    ]  # fmt: skip
    env = {**os.environ, "KVROUTE_REPLICA_KEY": "replica-key"}
    if env_keys:
        env["KVROUTE_API_KEYS"] = KEY
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_until_up(stack: subprocess.Popen[str]) -> tuple[str, str]:
    """Reads the stack's output until its banner is complete; returns the base URL and the output."""
    assert stack.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 180
    while not any("Ctrl-C stops everything" in line for line in lines):
        assert time.monotonic() < deadline and stack.poll() is None, "".join(lines)
        lines.append(stack.stdout.readline())
    output = "".join(lines)
    return re.search(r"OpenAI base URL (\S+)", output).group(1), output  # type: ignore[union-attr]


def stop_and_check_children(stack: subprocess.Popen[str], children: set[int], how: signal.Signals) -> None:
    """Sends ``how`` to the supervisor; every child must be gone within 5 s of it exiting."""
    stack.send_signal(how)
    stack.wait(timeout=90)
    wait_until(
        lambda: not [pid for pid in children if alive(pid)],
        f"every child to exit after {how.name} (none may outlive the stack)",
        timeout=5,
    )


def test_up_serves_and_stops_cleanly(llama_dir: Path) -> None:
    port = free_port()
    stack = up(llama_dir, port)
    try:
        base_url, output = wait_until_up(stack)
        replica_urls = re.findall(r"^    (http://127\.0\.0\.1:\d+)$", output, re.MULTILINE)
        assert len(replica_urls) == 2 and "policy kv" in output, output
        assert "API keys: required" in output and "admin API: off (turn it on with" in output
        assert '"temperature": 0' in output and "temperature=0" in output  # at 1 a 135M model rambles
        assert output.count("ready at http://127.0.0.1:") == 2, "progress while the replicas load"
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

        stop_and_check_children(stack, children, signal.SIGTERM)
    finally:
        if stack.poll() is None:
            stack.kill()
            pytest.fail("kvroute up did not stop on SIGTERM")


def test_up_with_simulated_replicas(llama_dir: Path) -> None:
    stack = up(llama_dir, free_port(), "--engine", "sim", "--profile", "instant")
    try:
        base_url, _ = wait_until_up(stack)
        reply = OpenAI(base_url=base_url, api_key=KEY, max_retries=0).chat.completions.create(
            model=llama_dir.name, messages=[{"role": "user", "content": "Hello!"}], max_tokens=5
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 5  # sim: exactly max_tokens
        stack.send_signal(signal.SIGTERM)
        assert stack.wait(timeout=90) == 0
    finally:
        if stack.poll() is None:
            stack.kill()


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGHUP], ids=["killed", "terminal-closed"])
def test_children_never_outlive_the_supervisor(llama_dir: Path, how: signal.Signals) -> None:
    """Killed outright, the supervisor cannot stop anything: its children must notice by themselves.
    A closed terminal (SIGHUP) stops the stack like Ctrl-C. Keys and admin come from the flags."""
    stack = up(llama_dir, free_port(), "--api-key", KEY, "--admin-key", "admin-key", env_keys=False)
    try:
        base_url, output = wait_until_up(stack)
        assert "admin API: on" in output, output
        admin = httpx.get(
            f"{base_url.removesuffix('/v1')}/admin/replicas", headers={"authorization": "Bearer admin-key"}
        )
        assert admin.status_code == 200 and len(admin.json()["replicas"]) == 2
        children = children_of(stack.pid)
        assert len(children) >= 4, "redis-server, two replicas and the gateway"
        stop_and_check_children(stack, children, how)
    finally:
        if stack.poll() is None:
            stack.kill()


@pytest.mark.smollm
def test_a_chat_keeps_its_replica_through_up(smollm2_dir: Path) -> None:
    """The default stack on the default model: a five-turn chat sent without pauses stays put."""
    stack = up(smollm2_dir, free_port(), "--dtype", "auto", "--kv-cache-memory-gb", "0.1")
    try:
        base_url, _ = wait_until_up(stack)
        client = OpenAI(base_url=base_url, api_key=KEY, max_retries=0)
        for question, stream in (("What is the capital of France?", False), ("Why is the sky blue?", True)):
            record = converse(client, smollm2_dir.name, question, stream=stream)
            assert not lost_turns(record), record
        stack.send_signal(signal.SIGINT)
        assert stack.wait(timeout=90) == 0
    finally:
        if stack.poll() is None:
            stack.kill()
