"""The admin API under ``/admin`` (the admin key guards it: see :mod:`gateway.auth`).

* ``GET /admin/replicas``: every replica the gateway knows: from Redis (``"source": "redis"``:
  heartbeat age, load, KV usage) or ``--replica`` (``"static"``: no heartbeat, so no KV usage or
  queue figures; ``"listed": false`` while it does not answer, or while Redis replicas serve its
  model), with its model, URL, epoch, health (``healthy`` = listed, neither drained nor ejected),
  indexed blocks, requests routed to it and, over the answers whose usage came back, prompt
  tokens against predicted and real cached tokens; the same totals per model.
* ``POST /admin/route``: a chat or completions body (the JSON of ``/v1/...``) in, the routing
  decision out, nothing sent: per replica matched tokens, load and cost (``null`` with
  ``"capped": true`` for a replica over the queue cap), the turns it awaits and whether this
  request continues one it answered (which wins a tie), the winner, the policy, prompt tokens.
  Honours ``x-kvroute-policy`` like the request path does for admins.
* ``POST /admin/replicas/{id}/drain`` takes a replica out of rotation (new requests only; what it
  is serving finishes); ``DELETE`` on the same path puts it back. Drains go through Redis, so
  every gateway sharing it applies them (``"shared": true``); with no Redis, or while it cannot
  be written, only this gateway does (``false``). A static replica's id is ``host:port`` of its
  URL, answering or not.

Per-request policy override: a ``/v1`` request with ``x-kvroute-policy: <name>`` and the admin
key as its Bearer token is routed by that policy (``gateway.pipeline``); the header is ignored for
any other caller, so clients that send it blindly are not broken by it.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from dataclasses import KW_ONLY, dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.fleet.fleet import Fleet
from gateway.fleet.replica import Replica
from gateway.index.block_index import BlockIndex
from gateway.index.drains import SharedDrains
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline
from gateway.routing import Router
from kvroute.http import RequestLimits, openai_errors, read_body
from kvroute.openai_api.errors import APIError
from kvroute.openai_api.schema import ChatCompletionRequest, CompletionRequest, parse_request

STATIC_EPOCH = "static"  # the epoch shown for a static replica (it has no heartbeat)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass
class AdminAPI:
    """``drains``: where drains are shared (None without Redis: they stay this gateway's)."""

    fleet: Fleet
    router: Router
    pipeline: Pipeline
    metrics: GatewayMetrics
    index: BlockIndex
    _: KW_ONLY
    drains: SharedDrains | None
    request_limits: RequestLimits

    def routes(self) -> list[Route]:
        endpoints = [
            ("/admin/replicas", self.replicas, ["GET"]),
            ("/admin/route", self.route, ["POST"]),
            ("/admin/replicas/{replica_id}/drain", self.drain, ["POST", "DELETE"]),
        ]
        return [Route(path, openai_errors(handler), methods=methods) for path, handler, methods in endpoints]

    # -- GET /admin/replicas --------------------------------------------------------------------

    async def replicas(self, request: Request) -> Response:
        fleet = self.fleet
        rows = [self._replica_row(replica) for replica in fleet.listed()]
        listed = {row["id"] for row in rows}
        for replica_id, url in fleet.static_ids().items():
            if replica_id not in listed:  # not answering, or its model is served by Redis replicas
                replica = fleet.get(replica_id)
                answering = replica is not None and fleet.static_answer(url) is not None
                row = self._replica_row(replica) if answering else self._silent_static_row(replica_id, url)
                rows.append(row | {"listed": False, "answering": answering, "healthy": False})
        listed = {row["id"] for row in rows}
        for replica_id in sorted(fleet.drained - listed):  # drained and gone: still worth showing
            rows.append(
                {"id": replica_id, "healthy": False, "listed": False, "drained": True}
                | self._outcomes(replica_id)
            )
        return JSONResponse(
            {
                "redis": self.router.index_status,
                "policy": self.router.policy.name,
                "replicas": rows,
                "models": self._cache_tokens_by_model(),
            }
        )

    def _replica_row(self, replica: Replica) -> dict[str, Any]:
        """One replica as the gateway knows it. A static replica has no heartbeat: no KV usage, no
        queue figures, only the gateway's own in-flight count."""
        beat = replica.heartbeat
        load: dict[str, int | None] = {"running": None, "waiting": None, "waiting_prefill_tokens": None}
        kv = None
        if beat is not None:
            load = {
                "running": beat.running,
                "waiting": beat.waiting,
                "waiting_prefill_tokens": beat.waiting_prefill_tokens,
            }
            kv = {
                "used_pages": beat.kv_used_pages,
                "total_pages": beat.kv_total_pages,
                "block_size": beat.block_size,
            }
        return {
            "id": replica.replica_id,
            "source": replica.source,
            "model": replica.model,
            "url": replica.url,
            "epoch": STATIC_EPOCH if beat is None else beat.epoch,
            "listed": True,
            "healthy": not (replica.drained or replica.ejected),
            "drained": replica.drained,
            "ejected": replica.ejected,
            "heartbeat_age_s": None if beat is None else round(max(0.0, time.time() - beat.ts), 3),
            "load": load | {"gateway_inflight": replica.inflight},
            "kv": kv,
            "indexed_blocks": self.index.num_blocks(replica.replica_id),
        } | self._outcomes(replica.replica_id)

    def _silent_static_row(self, replica_id: str, url: str) -> dict[str, Any]:
        """A static replica that did not answer its last discovery: its model is unknown."""
        drained = replica_id in self.fleet.drained
        row = {"id": replica_id, "source": "static", "url": url, "drained": drained}
        return row | self._outcomes(replica_id)

    def _outcomes(self, replica_id: str) -> dict[str, Any]:
        """Requests routed to the replica, and for those whose usage came back, predicted against
        real cached tokens."""
        stats = self.fleet.stats(replica_id)
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
        metrics = self.metrics
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
        raw = await read_body(request, self.request_limits)
        try:
            parsed = json.loads(raw)
            is_chat = isinstance(parsed, dict) and "messages" in parsed
        except ValueError:
            is_chat = False  # parse_request reports the bad JSON
        body: ChatCompletionRequest | CompletionRequest = (
            parse_request(ChatCompletionRequest, raw) if is_chat else parse_request(CompletionRequest, raw)
        )
        plan, prompt = await self.pipeline.decide(request, body)
        by_id = {replica.replica_id: replica for replica in plan.roster.replicas}
        within = self.router.expect_return_s
        candidates = []
        for score in plan.decision.scores:
            replica = by_id[score.replica_id]
            beat = replica.heartbeat
            candidates.append(
                {
                    "replica_id": score.replica_id,
                    "url": replica.url,
                    "matched_tokens": score.matched_tokens,
                    "load": _finite(score.load),
                    "cost": _finite(score.cost),
                    "capped": score.capped,
                    "running": 0 if beat is None else beat.running,
                    "waiting": 0 if beat is None else beat.waiting,
                    "waiting_prefill_tokens": 0 if beat is None else beat.waiting_prefill_tokens,
                    "gateway_inflight": replica.inflight,
                    # answered lately: their next turns are awaited (this request continues none)
                    "awaited_turns": replica.flights.awaited(prompt, within)[0],
                    "continues": score.continues,
                }
            )
        return JSONResponse(
            {
                "model": body.model,
                "endpoint": "/v1/chat/completions" if is_chat else "/v1/completions",
                "policy": plan.decision.policy,
                "prompt_tokens": len(prompt),
                "blocks": len(plan.hashes),
                "winner": plan.winner,
                "order": [replica.replica_id for replica in plan.ordered],
                "drained": sorted(rid for rid, replica in by_id.items() if replica.drained),
                "candidates": candidates,
            }
        )

    # -- drain ----------------------------------------------------------------------------------

    async def drain(self, request: Request) -> Response:
        """POST drains, DELETE puts back; ``shared`` says whether every gateway sharing this
        Redis sees it (False: this gateway only, as Redis could not be written, or there is none)."""
        replica_id = request.path_params["replica_id"]
        fleet = self.fleet
        drain = request.method != "DELETE"
        if drain and replica_id not in fleet.drained:
            known = {replica.replica_id for replica in fleet.listed()}
            known.update(fleet.static_ids())
            if replica_id not in known:
                raise APIError(f"No live replica {replica_id!r}.", 404, param="id", code="replica_not_found")
        fleet.drain(replica_id, drain)  # at once, here; then for every gateway, if Redis takes it
        shared = self.drains is not None and await self.drains.share(replica_id, drain)
        if shared:
            fleet.drain(replica_id, drain, shared=True)
        return JSONResponse({"id": replica_id, "drained": replica_id in fleet.drained, "shared": shared})
