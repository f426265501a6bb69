#!/usr/bin/env python3
"""Drain this replica before it stops: the Kubernetes preStop hook of a kvroute replica.

1. Resolve every ``--gateway HOST:PORT`` to all its addresses (a headless Service name yields
   every gateway pod) and ``POST /admin/replicas/{id}/drain`` on each with the admin key: every
   gateway stops sending new requests here. Gateways share drains through Redis, so one would
   do; telling each pod also covers a gateway that cannot reach Redis at that moment (its reply
   then says ``"shared": false``).
2. Wait ``--settle`` seconds for requests routed just before the drain, then poll the replica's
   own ``/metrics`` until ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` are both
   0, or ``--timeout`` passes.

Then the kubelet sends SIGTERM: the replica finishes what is left (up to 30 s), removes itself
from Redis and exits. Exit status 0 when every gateway took the drain, 1 otherwise (the pod still
stops; the kubelet records a FailedPreStopHook event). Standard library only, so it runs in any
image with Python.

Settings come from flags or the environment: ``KVROUTE_DRAIN_GATEWAYS`` (comma-separated
HOST:PORT), ``KVROUTE_REPLICA_ID``, ``KVROUTE_ADMIN_KEY``.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

QUEUE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def log(message: str) -> None:
    print(f"[kvroute-drain] {message}", file=sys.stderr, flush=True)


def split_host_port(target: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"expected HOST:PORT, got {target!r}")
    return host.strip("[]"), int(port)


def resolve(target: str) -> list[str]:
    """Every base URL ``target`` resolves to (one per address), or [] when it does not resolve."""
    host, port = split_host_port(target)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        log(f"cannot resolve {host}: {error}")
        return []
    urls = []
    for family, *_rest, address in infos:
        ip = str(address[0])
        url = f"http://[{ip}]:{port}" if family == socket.AF_INET6 else f"http://{ip}:{port}"
        if url not in urls:
            urls.append(url)
    return urls


def drain(base_url: str, replica_id: str, admin_key: str, timeout: float) -> bool:
    path = f"/admin/replicas/{urllib.parse.quote(replica_id, safe=':')}/drain"
    request = urllib.request.Request(
        base_url + path, method="POST", headers={"Authorization": f"Bearer {admin_key}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            log(f"{base_url}: drained {replica_id} ({response.status})")
            return True
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")[:200]
        log(f"{base_url}: drain refused with {error.code}: {detail}")
    except OSError as error:
        log(f"{base_url}: unreachable: {error}")
    return False


def queue_length(metrics_url: str, timeout: float) -> float | None:
    """Running + waiting requests from the replica's /metrics, or None when it cannot be read."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout) as response:
            text = response.read().decode()
    except OSError as error:
        log(f"cannot read {metrics_url}: {error}")
        return None
    total, seen = 0.0, set()
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in QUEUE_METRICS:
            total += float(line.rsplit(" ", 1)[1])
            seen.add(name)
    return total if seen == set(QUEUE_METRICS) else None


def wait_idle(metrics_url: str, deadline: float, poll: float) -> bool:
    while True:
        queued = queue_length(metrics_url, timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        if queued == 0:
            return True
        if time.monotonic() + poll > deadline:
            log(f"still {queued} requests after the timeout; the replica's own shutdown finishes them")
            return False
        time.sleep(poll)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvroute-drain", description=__doc__.split("\n\n")[0])
    env_gateways = [g for g in os.environ.get("KVROUTE_DRAIN_GATEWAYS", "").split(",") if g.strip()]
    parser.add_argument(
        "--gateway",
        action="append",
        metavar="HOST:PORT",
        help="a gateway (every address it resolves to); repeatable (default: env KVROUTE_DRAIN_GATEWAYS)",
    )
    parser.add_argument("--replica-id", default=os.environ.get("KVROUTE_REPLICA_ID"))
    parser.add_argument("--metrics-url", default="http://127.0.0.1:8001/metrics")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds to wait before polling")
    parser.add_argument("--timeout", type=float, default=75.0, help="give up waiting after this many s")
    parser.add_argument("--poll", type=float, default=1.0, help="seconds between /metrics reads")
    args = parser.parse_args(argv)
    args.gateway = [g.strip() for g in args.gateway or env_gateways]
    if not args.gateway or not args.replica_id:
        parser.error("need --gateway (or KVROUTE_DRAIN_GATEWAYS) and --replica-id (or KVROUTE_REPLICA_ID)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deadline = time.monotonic() + args.timeout
    admin_key = os.environ.get("KVROUTE_ADMIN_KEY", "")
    if not admin_key:
        log("KVROUTE_ADMIN_KEY is not set: the gateways' admin API will refuse the drain")
    urls = [url for target in args.gateway for url in resolve(target)]
    drained = [drain(url, args.replica_id, admin_key, timeout=5.0) for url in urls]
    ok = bool(drained) and all(drained)
    if not urls:
        log("no gateway address found: waiting for in-flight requests only")
    time.sleep(max(0.0, min(args.settle, deadline - time.monotonic())))
    wait_idle(args.metrics_url, deadline, args.poll)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
