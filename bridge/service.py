"""One vLLM server in kvroute's cache index: its events re-hashed, its load polled, both published
exactly as a kvroute replica publishes its own (``replica.publisher.KVPublisher``).

The server is registered while it answers: a *session* starts when its ``/metrics`` first
answers (a new epoch, nothing known yet) and ends, deregistered at once, when it stops answering
for ``DOWN_AFTER_POLLS`` polls in a row. A restart noticed while it answers (its sequence numbers
start again, a gap nothing can replay, or a new process start time in ``/metrics``) clears what
is known under a new epoch, in the same session. Generation requests never pass through here:
gateways call the vLLM server directly; the heartbeat's ``url`` is its URL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from bridge.chains import ChainTranslator
from bridge.engine_load import EngineLoad, parse_metrics
from bridge.subscriber import EventSubscriber, Restart
from bridge.vllm_events import EventBatch
from kvroute.protocol import EventKind, model_seed
from kvroute.text.tokenizer import TextTokenizer
from replica.kvcache.events import KVEventOutbox
from replica.publisher import KVPublisher, PublisherConfig

log = logging.getLogger("kvroute.bridge")

DOWN_AFTER_POLLS = 3  # failed /metrics polls in a row that end a session (1.5 s by default)


@dataclass
class _Session:
    model: str
    translator: ChainTranslator
    outbox: KVEventOutbox
    publisher: KVPublisher
    misconfigured: bool = False  # reported once


class Bridge:
    def __init__(
        self,
        publisher_config: PublisherConfig,
        tokenizer: TextTokenizer,
        subscriber: EventSubscriber,
        *,
        engine_url: str,
        block_size: int,
        served_model_name: str | None = None,
        engine_key: str | None = None,
    ) -> None:
        self.publisher_config = publisher_config
        self.tokenizer = tokenizer
        self.subscriber = subscriber
        self.engine_url = engine_url.rstrip("/")
        self.block_size = block_size
        self.served_model_name = served_model_name
        headers = {"Authorization": f"Bearer {engine_key}"} if engine_key else {}
        self._http = httpx.AsyncClient(headers=headers, timeout=max(1.0, publisher_config.heartbeat_interval))
        self.load = EngineLoad(0, 0, 0, 0, None)
        self.session: _Session | None = None
        self.max_model_len: int | None = None
        self.sessions = self.epoch_restarts = 0
        self._failed_polls = 0
        self._restarted_by_events = False

    @property
    def model(self) -> str | None:
        return None if self.session is None else self.session.model

    @property
    def translator(self) -> ChainTranslator | None:
        return None if self.session is None else self.session.translator

    async def run(self) -> None:
        """Both loops, until cancelled; the session, if any, is ended (deregistered) on the way out."""
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._watch_engine(), name="kvroute-bridge-engine")
                group.create_task(self._follow_events(), name="kvroute-bridge-events")
        finally:
            await self._end_session("the bridge is stopping")
            await self._http.aclose()

    # -- the engine -----------------------------------------------------------------------------

    async def _watch_engine(self) -> None:
        while True:
            try:
                load = await self._poll()
            except (httpx.HTTPError, ValueError) as error:
                self._failed_polls += 1
                if self.session is not None and self._failed_polls >= DOWN_AFTER_POLLS:
                    await self._end_session(f"{self.engine_url} is not answering ({type(error).__name__})")
            else:
                self._failed_polls = 0
                restarted = self.load.started_at is not None and load.started_at != self.load.started_at
                self.load = load
                if self.session is None:
                    await self._start_session()
                elif restarted and not self._restarted_by_events:
                    self._restarted("vLLM's process start time changed: it restarted")
                self._restarted_by_events = False
            await asyncio.sleep(self.publisher_config.heartbeat_interval)

    async def _poll(self) -> EngineLoad:
        response = await self._http.get(self.engine_url + "/metrics")
        return parse_metrics(response.raise_for_status().text, self.block_size)

    async def _served_model(self) -> str:
        """vLLM's served model name (its /v1/models), unless one was given; and its window."""
        models = (await self._http.get(self.engine_url + "/v1/models")).raise_for_status().json()
        card = models["data"][0]
        self.max_model_len = card.get("max_model_len")
        return self.served_model_name or str(card["id"])

    async def _start_session(self) -> None:
        try:
            model = await self._served_model()
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as error:
            log.warning("%s answers /metrics but not /v1/models (%s); retrying", self.engine_url, error)
            return
        outbox = KVEventOutbox()
        publisher = KVPublisher(
            self.publisher_config,
            model=model,
            fingerprint=self.tokenizer.fingerprint,
            block_size=self.block_size,
            outbox=outbox,
            stats=lambda: self.load,
        )
        translator = ChainTranslator(model_seed(model, self.tokenizer.fingerprint), self.block_size)
        await publisher.start()
        self.session = _Session(model, translator, outbox, publisher)
        self.subscriber.request_catch_up()
        self.sessions += 1
        log.info(
            "%s serves %s: registered as replica %s (epoch %s)",
            self.engine_url,
            model,
            self.publisher_config.replica_id,
            publisher.epoch,
        )

    async def _end_session(self, reason: str) -> None:
        session, self.session = self.session, None
        if session is not None:
            log.warning("%s; deregistering replica %s", reason, self.publisher_config.replica_id)
            await session.publisher.stop()

    def _restart(self, reason: str) -> None:
        """Whatever vLLM held is unknown now: forget it, under a new epoch."""
        if self.session is None:
            return
        self.epoch_restarts += 1
        log.warning("%s: starting a new epoch", reason)
        self.session.outbox.append(EventKind.CLEARED, [], time.time())
        self.session.translator.clear()

    def _restarted(self, reason: str) -> None:
        """vLLM restarted without its events saying so yet: start over from what it buffers."""
        self._restart(reason)
        self.subscriber.request_catch_up()

    # -- the events -----------------------------------------------------------------------------

    async def _follow_events(self) -> None:
        async for item in self.subscriber.stream():
            if isinstance(item, Restart):
                self._restarted_by_events = True
                self._restart(item.reason)
            elif self.session is not None:
                self._apply(self.session, item)

    def _apply(self, session: _Session, batch: EventBatch) -> None:
        for event in batch.events:
            try:
                changes = session.translator.apply(event)
            except ValueError as error:  # a block size kvroute's does not divide: nothing can be indexed
                if not session.misconfigured:
                    log.error("%s", error)
                session.misconfigured = True
                continue
            for kind, hashes in changes:
                session.outbox.append(kind, hashes, time.time())
