"""The admin API under ``/admin`` (the admin key guards it: see :mod:`gateway.auth`).

* ``GET /admin/replicas``: every replica the gateway knows: from Redis (``"source": "redis"``:
  heartbeat age, load, KV usage) or ``--replica`` (``"static"``: no heartbeat, so no KV usage or
  queue figures; ``"listed": false`` while it does not answer, or while Redis replicas serve its
  model), with its model, URL, epoch, health (``healthy`` = listed, neither drained nor ejected),
  indexed blocks, requests routed to it and, over the answers whose usage came back, prompt
  tokens against predicted and real cached tokens; the same totals per model.
* ``POST /admin/route``: a chat or completions body (the JSON of ``/v1/...``) in, the routing
  decision out, nothing sent: per replica matched tokens, load and cost (``null`` with
  ``"capped": true`` for a replica over the queue cap), the winner, the policy, prompt tokens.
  Honours ``x-kvroute-policy`` like the request path does for admins.
* ``POST /admin/replicas/{id}/drain`` takes a replica out of rotation (new requests only; what it
  is serving finishes); ``DELETE`` on the same path puts it back. Drains go through Redis, so
  every gateway sharing it applies them (``"shared": true``); with no Redis, or while it cannot
  be written, only this gateway does (``false``). A static replica's id is ``host:port`` of its
  URL, answering or not.

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
from gateway.health import STATIC_EPOCH
from gateway.index_mirror import ReplicaInfo
from gateway.metrics import ReplicaStats
from gateway.policies import POLICIES, Policy, make_policy
from kvroute.http import openai_errors, read_body
from kvroute.openai_api.errors import APIError
from kvroute.openai_api.schema import ChatCompletionRequest, CompletionRequest, parse_request

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
        rows = [self._replica_row(info) for info in api.router.known_replicas()]
        listed = {row["id"] for row in rows}
        health = api.replica_health
        answering = {info.url: info for info in health.static_replicas()}
        for replica_id, url in health.static_ids().items():
            if replica_id not in listed:  # not answering, or its model is served by Redis replicas
                info = answering.get(url)
                row = self._replica_row(info) if info else self._silent_static_row(replica_id, url)
                rows.append(row | {"listed": False, "answering": info is not None, "healthy": False})
        listed = {row["id"] for row in rows}
        for replica_id in sorted(api.router.drained - listed):  # drained and gone: still worth showing
            rows.append(
                {"id": replica_id, "healthy": False, "listed": False, "drained": True}
                | self._outcomes(replica_id)
            )
        return JSONResponse(
            {
                "redis": "none" if not api.router.use_index else "stale" if api.mirror.stale else "ok",
                "policy": api.router.policy.name,
                "replicas": rows,
                "models": self._cache_tokens_by_model(),
            }
        )

    def _replica_row(self, info: ReplicaInfo) -> dict[str, Any]:
        """One replica as the gateway knows it. A static replica has no heartbeat: no KV usage, no
        queue figures, only the gateway's own in-flight count."""
        api = self.api
        router = api.router
        static = info.epoch == STATIC_EPOCH
        drained = info.replica_id in router.drained
        ejected = api.replica_health.is_ejected(info.replica_id)
        return {
            "id": info.replica_id,
            "source": "static" if static else "redis",
            "model": info.model,
            "url": info.url,
            "epoch": info.epoch,
            "listed": True,
            "healthy": not (drained or ejected),
            "drained": drained,
            "ejected": ejected,
            "heartbeat_age_s": None if static else round(max(0.0, time.time() - info.ts), 3),
            "load": {
                "running": None if static else info.running,
                "waiting": None if static else info.waiting,
                "waiting_prefill_tokens": None if static else info.waiting_prefill_tokens,
                "gateway_inflight": router.inflight(info.replica_id),
            },
            "kv": None
            if static
            else {
                "used_pages": info.kv_used_pages,
                "total_pages": info.kv_total_pages,
                "block_size": info.block_size,
            },
            "indexed_blocks": api.mirror.index.num_blocks(info.replica_id),
        } | self._outcomes(info.replica_id)

    def _silent_static_row(self, replica_id: str, url: str) -> dict[str, Any]:
        """A static replica that did not answer its last discovery: its model is unknown."""
        drained = replica_id in self.api.router.drained
        row = {"id": replica_id, "source": "static", "url": url, "drained": drained}
        return row | self._outcomes(replica_id)

    def _outcomes(self, replica_id: str) -> dict[str, Any]:
        """Requests routed to the replica, and for those whose usage came back, predicted against
        real cached tokens."""
        stats = self.api.replica_stats.get(replica_id) or ReplicaStats()
        return {
            "requests_routed": stats.requests,
            "usage": {
                "reports": stats.usage_reports,
                "prompt_tokens": stats.prompt_tokens,
                "predicted_cached_tokens": stats.predicted_cached_tokens,
                "cached_tokens": stats.cached_tokens,
            },
        }

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
        route, prompt = await api.decide(request, body)
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
                "prompt_tokens": len(prompt),
                "blocks": len(route.hashes),
                "winner": route.decision.replica_id,
                "order": [info.replica_id for info in route.ordered],
                "drained": sorted(router.drained & set(by_id)),
                "candidates": candidates,
            }
        )

    # -- drain ----------------------------------------------------------------------------------

    async def drain(self, request: Request) -> Response:
        """POST drains, DELETE puts back; ``shared`` says whether every gateway sharing this
        Redis sees it (False: this gateway only, as Redis could not be written, or there is none)."""
        replica_id = request.path_params["replica_id"]
        router = self.api.router
        drain = request.method != "DELETE"
        if drain and replica_id not in router.drained:
            known = {r.replica_id for r in router.known_replicas()}
            known.update(self.api.replica_health.static_ids())
            if replica_id not in known:
                raise APIError(f"No live replica {replica_id!r}.", 404, param="id", code="replica_not_found")
        shared = await router.set_drained(replica_id, drain)
        return JSONResponse({"id": replica_id, "drained": replica_id in router.drained, "shared": shared})
