"""The request path of ``POST /v1/chat/completions`` and ``POST /v1/completions``.

**parse** (the shared OpenAI schema, so bad input never reaches a replica) → **tokenize** exactly
as the model's replicas do (their own tokenizer, fetched once and checked against the fingerprint
they registered; ids reused across a chat's turns, see ``gateway.tokenizer_registry``) → **plan**
(block hashes, index lookup, load, policy: ``gateway.routing``) → **dispatch** (counted in flight
on the winner, retried on the next-best replica until one answers, before any byte reached the
client: ``gateway.proxy.relay``) → **relay** (the whole answer, or the stream passed through
untouched), with ``x-kvroute-replica`` and ``x-kvroute-predicted-cached-tokens`` headers.

Plain ASGI (:meth:`Pipeline.serve`): Starlette's routing, middleware and response layers cost more
CPU per request than the gateway's own work. Failures before the response starts become OpenAI
error replies; a stream that breaks off after it started says so in the stream itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from array import array
from contextlib import aclosing
from dataclasses import KW_ONLY, dataclass
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from gateway.auth import ADMIN, AUTH_SCOPE_KEY
from gateway.fleet.fleet import Fleet
from gateway.fleet.replica import Replica
from gateway.metrics import GatewayMetrics, ModelMetrics
from gateway.policies import POLICIES, Policy
from gateway.proxy.connection import UpstreamError, UpstreamResponse
from gateway.proxy.relay import SSERelay, Upstream, UpstreamUnavailable, forwarded_body, open_upstream
from gateway.proxy.upstream import UpstreamPool
from gateway.routing import RoutePlan, Router
from gateway.tokenizer_registry import TokenizerError, TokenizerRegistry
from kvroute.http import RequestLimits, read_body, unless_client_leaves
from kvroute.openai_api.errors import APIError, echo, internal_error, model_not_found
from kvroute.openai_api.schema import ChatCompletionRequest, CompletionRequest, parse_request
from kvroute.text.bounds import refuse_surely_too_long
from kvroute.text.prompt_ids import PromptIds

log = logging.getLogger("kvroute.gateway")

GENERATION_PATHS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}
POLICY_HEADER = "x-kvroute-policy"  # an admin's choice of policy for one request
_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


@dataclass(slots=True)
class _Dispatched:
    """A request a replica has started answering: what relaying its answer needs."""

    replica: Replica
    ticket: int  # its count in flight there (``Fleet.sent``)
    response: UpstreamResponse
    predicted: int  # prompt tokens expected cached there
    metrics: ModelMetrics
    started: float  # time.monotonic() when the request came in
    forward_usage: bool  # the client asked for the usage event of a stream

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [
            (b"x-kvroute-replica", self.replica.replica_id.encode()),
            (b"x-kvroute-predicted-cached-tokens", b"%d" % self.predicted),
        ]


@dataclass(slots=True)
class Pipeline:
    """The generation request path; :meth:`serve` is the ASGI app of both endpoints."""

    fleet: Fleet
    router: Router
    tokenizers: TokenizerRegistry
    upstream: UpstreamPool
    metrics: GatewayMetrics
    _: KW_ONLY
    request_limits: RequestLimits
    ttfb_timeout_s: float  # a stream's first bytes from a replica, at most

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app of both endpoints: each step of the request path, and the error replies."""
        request = Request(scope, receive)
        try:
            started = time.monotonic()
            raw = await read_body(request, self.request_limits)
            body = parse_request(GENERATION_PATHS[scope["path"]], raw)
            plan, prompt = await self.decide(request, body)
            self.metrics.routing.observe(time.monotonic() - started)
            if plan.winner is None:
                raise APIError(
                    "Every replica of this model has a full queue; retry later.",
                    429,
                    code="rate_limit_exceeded",
                )
            sent = await self._dispatch(request, body, raw, plan, len(prompt), started)
            if body.stream and sent.response.status == 200:
                await self._relay_stream(request, send, sent)
            else:
                await self._relay_whole(send, sent)
        except APIError as error:
            await error.to_response()(scope, receive, send)
        except ClientDisconnect:
            pass  # nobody to answer
        except Exception:
            log.exception("unhandled error in POST %s", scope["path"])
            await internal_error().to_response()(scope, receive, send)

    async def decide(
        self, request: Request, body: ChatCompletionRequest | CompletionRequest
    ) -> tuple[RoutePlan, PromptIds]:
        """Tokenize as the replicas do (for a batch of completions prompts: the first one) and let
        the policy (or an admin's override) plan.

        The request path and ``POST /admin/route`` both call this, so the explained decision is
        the one a real request would get.
        """
        roster = self.fleet.routable(body.model)
        if roster is None and self.fleet.listed_lately(body.model):
            raise APIError(
                f"No replica of `{echo(body.model)}` is available right now; retry shortly.",
                503,
                code="service_unavailable",
                headers={"retry-after": "1"},
            )
        if roster is None:
            raise model_not_found(body.model)
        if roster.mismatched:
            self.metrics.fingerprint_mismatch(body.model, roster.mismatched)
        tokenizer = self.tokenizers.cached(body.model, roster.fingerprint)
        if tokenizer is None:
            try:
                tokenizer = await self.tokenizers.get(body.model, roster.fingerprint, roster.tokenizer_urls())
            except TokenizerError as error:
                raise APIError(
                    f"Cannot tokenize for {echo(body.model)}: {error}", 503, code="tokenizer_unavailable"
                ) from None
        window = self.tokenizers.window(body.model, roster.fingerprint)
        refuse_surely_too_long(body, tokenizer, window, self.request_limits.max_prompt_chars)
        try:
            if isinstance(body, ChatCompletionRequest):
                prompt = await self.tokenizers.encode_chat(tokenizer, *body.template_inputs())
            elif isinstance(first := body.prompt[0], list):
                prompt = PromptIds.of(first)
            else:
                prompt = await self.tokenizers.encode_prompt(tokenizer, first)
        except OverflowError:
            raise APIError("Invalid 'prompt': token ids must be below 2**32.", param="prompt") from None
        except ValueError as error:
            raise APIError(f"Invalid 'messages': {error}", param="messages", code="invalid_value") from None
        plan = self.router.plan(
            roster, prompt, request.headers.get("x-session-id"), self._policy_override(request)
        )
        if plan is None:
            raise APIError("Every replica of this model is drained.", 503, code="service_unavailable")
        return plan, prompt

    def _policy_override(self, request: Request) -> Policy | None:
        """The policy named by ``x-kvroute-policy`` when the caller holds the admin key, else None
        (also for a non-admin caller who sent the header). An unknown name from an admin: 400."""
        name = request.headers.get(POLICY_HEADER)
        if not name or request.scope.get(AUTH_SCOPE_KEY) != ADMIN:
            return None
        try:
            return self.router.override(name)
        except KeyError:
            raise APIError(
                f"Unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}.",
                param=POLICY_HEADER,
                code="invalid_value",
            ) from None

    async def _dispatch(
        self,
        request: Request,
        body: ChatCompletionRequest | CompletionRequest,
        raw: bytes,
        plan: RoutePlan,
        prompt_tokens: int,
        started: float,
    ) -> _Dispatched:
        """Sends the request down the plan's order until a replica answers, counted in flight on
        the replica that does."""
        # Count the request on the winner before awaiting anything: decisions taken meanwhile (a
        # burst of requests with one new prefix) must see its load and its predicted blocks.
        replica = plan.ordered[0]
        ticket = self.router.commit(plan, replica, prompt_tokens, body.num_sequences)
        try:
            forward, client_wants_usage = await self._forwarded(raw, body, plan)
            upstream = await self._open(request, body, forward, plan.ordered)
        except UpstreamUnavailable as error:
            self.fleet.done(ticket)
            self.fleet.report_failures(plan.ordered, error.failures)
            raise APIError(
                f"No replica could take the request: {error}", 503, code="service_unavailable"
            ) from None
        except BaseException:  # cancelled: the request is no longer in flight
            self.fleet.done(ticket)
            raise
        self.fleet.report_failures(plan.ordered, upstream.failures)
        if upstream.url != replica.url:  # retried elsewhere: move the count and the prediction
            self.fleet.done(ticket)
            replica = next(r for r in plan.ordered if r.url == upstream.url)
            ticket = self.router.commit(plan, replica, prompt_tokens, body.num_sequences)
        response = upstream.response
        predicted = plan.predicted_tokens.get(replica.replica_id, 0)
        metrics = self.metrics.routed(
            body.model,
            replica,
            plan.decision.policy,
            response.status,
            prompt_tokens=prompt_tokens,
            predicted=predicted,
            retries=len(upstream.failures),
        )
        return _Dispatched(replica, ticket, response, predicted, metrics, started, client_wants_usage)

    async def _forwarded(
        self, raw: bytes, body: ChatCompletionRequest | CompletionRequest, plan: RoutePlan
    ) -> tuple[bytes, bool]:
        """``forwarded_body``, with the prompt's ids where they go along: not for a prompt over the
        model's window (the replica refuses it, from its length alone), nor where they would take
        the body over the body limit (a replica's is the same flag); encoded off the event loop
        when there are many (65,536 ids take ~9 ms)."""
        ids = _prompt_ids_to_forward(body, plan)
        window = self.tokenizers.window(body.model, plan.roster.fingerprint)
        if ids is not None and (
            (window is not None and len(ids) > window)
            or len(raw) + _ID_BYTES * len(ids) > self.request_limits.max_body_bytes
        ):
            ids = None
        if ids is not None and len(ids) > _IDS_ENCODED_ON_LOOP:
            return await asyncio.to_thread(forwarded_body, raw, body, ids)
        return forwarded_body(raw, body, ids)

    async def _open(
        self,
        request: Request,
        body: ChatCompletionRequest | CompletionRequest,
        forward: bytes,
        ordered: list[Replica],
    ) -> Upstream:
        """``open_upstream`` down ``ordered``, each attempt watched by the fleet (given up if its
        replica leaves the index or is ejected); the one that answers stays watched."""
        by_url = {replica.url: replica for replica in ordered}
        watched: list[tuple[Replica, UpstreamResponse]] = []

        def watch(url: str, response: UpstreamResponse) -> None:
            self.fleet.watch(by_url[url], response)
            watched.append((by_url[url], response))

        opening = open_upstream(
            self.upstream,
            list(by_url),
            request.scope["path"],
            forward,
            whole=not body.stream,
            first_data_within=self.ttfb_timeout_s if body.stream else None,
            on_response=watch,
        )
        upstream = None
        try:
            # A whole reply (or a stream's first bytes) can take minutes: a client that leaves
            # meanwhile cancels it, which closes the replica connection, so the replica aborts the
            # request (a stream's client is watched the same way in _relay_stream).
            if (upstream := await unless_client_leaves(request.receive, opening)) is None:
                raise ClientDisconnect()
            return upstream
        finally:
            kept = None if upstream is None else upstream.response
            for replica, response in watched:
                if response is not kept:
                    self.fleet.unwatch(replica, response)

    def _over(self, sent: _Dispatched, usage: dict[str, Any] | None = None) -> None:
        """The request is no longer in flight at its replica; ``usage``: its answer's, if it came."""
        completion_tokens = (usage or {}).get("completion_tokens")
        self.fleet.done(sent.ticket, completion_tokens if isinstance(completion_tokens, int) else 0)
        self.fleet.unwatch(sent.replica, sent.response)

    async def _relay_whole(self, send: Send, sent: _Dispatched) -> None:
        replica, response = sent.replica, sent.response
        usage = None
        try:
            content = await response.read()
            if response.status == 200:
                usage = json.loads(content).get("usage")
        except UpstreamError as error:
            self.fleet.failed(replica, str(error))
            raise APIError(
                f"Replica {replica.replica_id} failed before completing the response ({error}).",
                502,
                code="upstream_failed",
            ) from None
        finally:
            response.close()
            self._over(sent, usage)
        sent.metrics.e2e.observe(time.monotonic() - sent.started)
        if response.status == 200:
            self.fleet.succeeded(replica)
            self.metrics.answered(sent.metrics, replica, sent.predicted, usage)
        await send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": [*_JSON_HEADERS, (b"content-length", b"%d" % len(content)), *sent.headers()],
            }
        )
        await send({"type": "http.response.body", "body": content})

    async def _relay_stream(self, request: Request, send: Send, sent: _Dispatched) -> None:
        """Relays the replica's events. If the client leaves, the upstream request is closed, so the
        replica aborts it and frees its pages; if the replica breaks off (killed, connection lost),
        the client gets an OpenAI error event and ``[DONE]``."""
        replica, response = sent.replica, sent.response
        relay = SSERelay(response, forward_usage=sent.forward_usage)
        # The server answers receive() when the client disconnects (or once the response is over).
        client_left = asyncio.ensure_future(request.receive())
        client_left.add_done_callback(lambda _: response.close())
        broken: str | None = None
        try:
            await send(
                {"type": "http.response.start", "status": 200, "headers": [*_SSE_HEADERS, *sent.headers()]}
            )
            async with aclosing(aiter(relay)) as events:
                try:
                    async for events_read in events:
                        if relay.finished:  # out of flight before the client can send its next turn
                            self._over(sent, relay.usage)
                        await send({"type": "http.response.body", "body": events_read, "more_body": True})
                except UpstreamError as error:
                    broken = str(error)
            if client_left.done():
                return
            if broken is None and not relay.finished:
                broken = "the stream ended without [DONE]"
            if broken is None:
                self.fleet.succeeded(replica)
            else:
                self.fleet.failed(replica, broken)
                log.warning("stream from replica %s broke off: %s", replica.replica_id, broken)
                await send(
                    {"type": "http.response.body", "body": _broken_off(replica, broken), "more_body": True}
                )
            await send({"type": "http.response.body", "body": b""})
        except OSError:
            pass  # the client left (servers of ASGI spec 2.4 and later say so on send)
        finally:
            client_left.cancel()
            response.close()
            self._over(sent)
            if relay.first_event_at is not None:
                sent.metrics.ttft.observe(relay.first_event_at - sent.started)
            sent.metrics.e2e.observe(time.monotonic() - sent.started)
            self.metrics.answered(sent.metrics, replica, sent.predicted, relay.usage)


_ID_BYTES = len(b"4294967295,")  # the most one forwarded token id adds to the body
_IDS_ENCODED_ON_LOOP = 4096  # more forwarded ids than this are encoded on a worker thread (~0.7 ms)


def _prompt_ids_to_forward(
    body: ChatCompletionRequest | CompletionRequest, plan: RoutePlan
) -> array[int] | None:
    """The prompt's ids as this gateway tokenized them, for the replica to serve instead of
    tokenizing it again: a single prompt (a batch was tokenized for its first prompt only), and
    only where every replica the request may go to takes them (``Replica.takes_prompt_ids``) with
    the tokenizer they were computed with."""
    if isinstance(body, CompletionRequest) and len(body.prompt) != 1:
        return None
    fingerprint = plan.roster.fingerprint
    if all(r.takes_prompt_ids and r.fingerprint == fingerprint for r in plan.ordered):
        return plan.prompt.ids
    return None


def _broken_off(replica: Replica, why: str) -> bytes:
    """The error event, and ``[DONE]``, that end a stream the replica broke off."""
    error = APIError(
        f"Replica {replica.replica_id} failed mid-stream ({why}); the response is incomplete.",
        502,
        code="upstream_failed",
    )
    return b"data: " + json.dumps(error.to_dict()).encode() + b"\n\ndata: [DONE]\n\n"
