"""The admin API under ``/admin`` (the admin key guards it: see :mod:`gateway.auth`).

* ``GET /admin/replicas``: every known replica (live heartbeat, or static) with its load, KV
  usage, indexed blocks, health (``healthy`` = neither drained nor ejected) and requests routed to
  it; per model, prompt tokens against predicted and real cached
  tokens (the gateway counts those per model, not per replica).
* ``POST /admin/route``: a chat or completions body (the JSON of ``/v1/...``) in, the routing
  decision out, nothing sent: per replica matched tokens, load and cost (``null`` with
  ``"capped": true`` for a replica over the queue cap), the winner, the policy, prompt tokens.
  Honours ``x-kvroute-policy`` like the request path does for admins.
* ``POST /admin/replicas/{id}/drain`` takes a replica out of rotation (new requests only; what it
  is serving finishes); ``DELETE`` on the same path puts it back.

Per-request policy override: a ``/v1`` request with ``x-kvroute-policy: <name>`` and the admin
key as its Bearer token is routed by that policy (:meth:`AdminAPI.policy_override`); the header is
ignored for any other caller, so clients that send it blindly are not broken by it.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.auth import ADMIN, AUTH_SCOPE_KEY
from gateway.policies import POLICIES, Policy, make_policy
from kvroute.errors import APIError
from kvroute.http import openai_errors, read_body
from kvroute.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_request

if TYPE_CHECKING:
    from gateway.app import _GatewayAPI

POLICY_HEADER = "x-kvroute-policy"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


class AdminAPI:
    def __init__(self, api: _GatewayAPI) -> None:
        self.api = api
        self._policies: dict[str, Policy] = {}  # override policies, built once (round-robin keeps state)

    def routes(self) -> list[Route]:
        endpoints = [
            ("/admin/replicas", self.replicas, ["GET"]),
            ("/admin/route", self.route, ["POST"]),
            ("/admin/replicas/{replica_id}/drain", self.drain, ["POST", "DELETE"]),
        ]
        return [Route(path, openai_errors(handler), methods=methods) for path, handler, methods in endpoints]

    # -- per-request policy override ------------------------------------------------------------

    def policy_override(self, request: Request) -> Policy | None:
        """The policy named by ``x-kvroute-policy`` when the caller holds the admin key, else None
        (also for a non-admin caller who sent the header). An unknown name from an admin: 400."""
        name = request.headers.get(POLICY_HEADER)
        if not name or request.scope.get(AUTH_SCOPE_KEY) != ADMIN:
            return None
        if name not in POLICIES:
            raise APIError(
                f"Unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}.",
                param=POLICY_HEADER,
                code="invalid_value",
            )
        if name == self.api.router.policy.name:
            return None
        if name not in self._policies:
            current = self.api.router.policy
            settings: dict[str, Any] = {"lam": current.lam, "decode_weight": current.decode_weight}
            settings["max_queue"] = current.max_queue
            self._policies[name] = make_policy(name, **settings)
        return self._policies[name]

    # -- GET /admin/replicas --------------------------------------------------------------------

    async def replicas(self, request: Request) -> Response:
        api = self.api
        routed = self._requests_by_replica()
        now = time.time()
        rows = []
        live = set()
        for info in api.router.known_replicas():
            live.add(info.replica_id)
            drained = info.replica_id in api.router.drained
            ejected = api.router.health is not None and api.router.health.is_ejected(info.replica_id)
            try:
                indexed = len(api.mirror.index.replica_blocks(info.replica_id))
            except KeyError:
                indexed = 0
            rows.append(
                {
                    "id": info.replica_id,
                    "model": info.model,
                    "url": info.url,
                    "epoch": info.epoch,
                    "healthy": not (drained or ejected),
                    "heartbeat_age_s": round(max(0.0, now - info.ts), 3),
                    "drained": drained,
                    "ejected": ejected,
                    "load": {
                        "running": info.running,
                        "waiting": info.waiting,
                        "waiting_prefill_tokens": info.waiting_prefill_tokens,
                        "gateway_inflight": api.router.inflight(info.replica_id),
                    },
                    "kv": {
                        "used_pages": info.kv_used_pages,
                        "total_pages": info.kv_total_pages,
                        "block_size": info.block_size,
                    },
                    "indexed_blocks": indexed,
                    "requests_routed": routed.get(info.replica_id, 0),
                }
            )
        for replica_id in sorted(api.router.drained - live):  # drained and gone: still worth showing
            rows.append(
                {
                    "id": replica_id,
                    "healthy": False,
                    "listed": False,
                    "drained": True,
                    "requests_routed": routed.get(replica_id, 0),
                }
            )
        return JSONResponse(
            {
                "redis": "stale" if api.mirror.stale else "ok",
                "policy": api.router.policy.name,
                "replicas": rows,
                "models": self._cache_tokens_by_model(),
            }
        )

    def _requests_by_replica(self) -> dict[str, int]:
        counts: dict[str, int] = defaultdict(int)
        for metric in self.api.metrics.requests.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    counts[sample.labels["replica"]] += int(sample.value)
        return counts

    def _cache_tokens_by_model(self) -> dict[str, dict[str, int]]:
        metrics = self.api.metrics
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for field, counter in (
            ("prompt_tokens", metrics.prompt_tokens),
            ("predicted_cached_tokens", metrics.predicted_cached_tokens),
            ("cached_tokens", metrics.cached_tokens),
        ):
            for metric in counter.collect():
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        out[sample.labels["model"]][field] = int(sample.value)
        return dict(out)

    # -- POST /admin/route ----------------------------------------------------------------------

    async def route(self, request: Request) -> Response:
        """The decision the request path would take for this body, without sending anything."""
        api = self.api
        raw = await read_body(request, api.settings.max_body_bytes)
        try:
            parsed = json.loads(raw)
            is_chat = isinstance(parsed, dict) and "messages" in parsed
        except ValueError:
            is_chat = False  # parse_request reports the bad JSON
        body: ChatCompletionRequest | CompletionRequest = (
            parse_request(ChatCompletionRequest, raw) if is_chat else parse_request(CompletionRequest, raw)
        )
        route, prompt_ids = await api.decide(request, body)
        router = api.router
        replicas = router.replicas_by_fingerprint(body.model)[1]
        by_id = {info.replica_id: info for info in replicas}
        candidates = []
        for score in route.decision.scores:
            info = by_id[score.replica_id]
            candidates.append(
                {
                    "replica_id": score.replica_id,
                    "url": info.url,
                    "matched_tokens": score.matched_tokens,
                    "load": _finite(score.load),
                    "cost": _finite(score.cost),
                    "capped": score.capped,
                    "running": info.running,
                    "waiting": info.waiting,
                    "waiting_prefill_tokens": info.waiting_prefill_tokens,
                    "gateway_inflight": router.inflight(score.replica_id),
                }
            )
        return JSONResponse(
            {
                "model": body.model,
                "endpoint": "/v1/chat/completions" if is_chat else "/v1/completions",
                "policy": route.decision.policy,
                "prompt_tokens": len(prompt_ids),
                "blocks": len(route.hashes),
                "winner": route.decision.replica_id,
                "order": [info.replica_id for info in route.ordered],
                "drained": sorted(router.drained & set(by_id)),
                "candidates": candidates,
            }
        )

    # -- drain ----------------------------------------------------------------------------------

    async def drain(self, request: Request) -> Response:
        replica_id = request.path_params["replica_id"]
        drained = self.api.router.drained
        if request.method == "DELETE":
            drained.discard(replica_id)
        else:
            known = {r.replica_id for r in self.api.router.known_replicas()}
            if replica_id not in drained and replica_id not in known:
                raise APIError(f"No live replica {replica_id!r}.", 404, param="id", code="replica_not_found")
            drained.add(replica_id)
        return JSONResponse({"id": replica_id, "drained": replica_id in drained})
