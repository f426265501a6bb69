"""Runs the engine on its own thread and bridges its outputs to asyncio.

Forward passes (and the simulation's sleeps) release the GIL, so the HTTP event loop keeps serving
while the engine computes. Requests and aborts reach the engine thread through a queue; outputs
come back with one ``call_soon_threadsafe`` per step.

All of the engine's torch work, loading included, happens on that one thread. OpenMP gives every
thread that runs a parallel op a team of workers of its own; with two teams on the cores, libgomp
stops its workers spinning between ops, and each op then waits for one to wake: matmuls on
SmolLM2's shapes took 3.5x as long, and served decoding ran at half the in-process speed, while
the model was loaded on the HTTP thread and run on another.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from kvroute.text.tokenizer import TextTokenizer
from replica.engine.config import EngineConfig
from replica.engine.llm_engine import EngineStats, LLMEngine
from replica.engine.outputs import RequestOutput
from replica.engine.sampling_params import SamplingParams
from replica.kvcache.events import KVEventOutbox

log = logging.getLogger("kvroute.replica")

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread is not running (stopped, or failed to start)."""


class EngineThread:
    """The one thread the engine's work runs on: calls made from elsewhere, one at a time, and
    finally the engine loop until it returns."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="kvroute-engine", daemon=True)
        self._thread.start()

    def call(self, function: Callable[[], T]) -> T:
        """Runs ``function`` on the thread and returns (or raises) what it did."""
        future: Future[T] = Future()
        self._calls.put((function, future))
        return future.result()

    def run_last(self, function: Callable[[], None]) -> None:
        """Runs ``function`` on the thread, which ends with it (logging what it raised)."""
        done: Future[None] = Future()
        done.add_done_callback(_log_failure)
        self._calls.put((function, done))
        self._calls.put((_END, Future()))

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()

    def _serve(self) -> None:
        while True:
            function, future = self._calls.get()
            if function is _END:
                return
            try:
                future.set_result(function())
            except BaseException as error:  # the caller re-raises it
                future.set_exception(error)


def _END() -> None:
    """Marks the end of an ``EngineThread``'s calls."""


def _log_failure(done: Future[None]) -> None:
    if done.exception() is not None:
        log.error("the engine thread stopped", exc_info=done.exception())


class AsyncEngine:
    """``thread``: the thread that built ``engine`` and will run it (a new one if None)."""

    def __init__(self, engine: LLMEngine, thread: EngineThread | None = None) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = thread
        self._started = False
        self._stopping = False
        self._stats = engine.stats()

    @classmethod
    def from_config(cls, config: EngineConfig, outbox: KVEventOutbox | None = None) -> AsyncEngine:
        """Loads the model on the thread that will run it (see the module's docstring)."""
        thread = EngineThread()
        return cls(thread.call(lambda: LLMEngine(config, outbox)), thread)

    @property
    def tokenizer(self) -> TextTokenizer:
        return self.engine.tokenizer

    @property
    def served_model_name(self) -> str:
        return self.engine.served_model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def generation_defaults(self) -> dict[str, Any]:
        return self.engine.generation_defaults

    @property
    def is_running(self) -> bool:
        return self._started and self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._thread is None:
            self._thread = EngineThread()
        self._thread.run_last(self._run)
        self._started = True

    async def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None and self._started:
            await asyncio.to_thread(self._thread.join)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        source: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's progress; stopping early (aclose, cancellation) aborts it.
        ``source`` names the gateway that sent it (reported per gateway in the heartbeat)."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = stream
        self._inbox.put(("add", request_id, prompt_token_ids, params, source))
        self._wakeup.set()
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wakeup.set()

    async def reset_prefix_cache(self) -> int:
        """Evicts all unused cached pages, on the engine thread (the only one touching the cache)."""
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._inbox.put(("reset", done))
        self._wakeup.set()
        return await done

    def stats(self) -> EngineStats:
        """The engine thread's latest snapshot: reading the live scheduler from here would race it."""
        return self._stats

    # -- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            self._stats = self.engine.stats()
            if not self.engine.has_unfinished():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as error:  # a bug must not kill the replica: fail what was running
                log.exception("engine step failed; aborting the requests in flight")
                self._fail_all(error)
                continue
            if outputs:
                self._post(outputs)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt, params, source = command
                try:
                    self.engine.add_request(request_id, prompt, params, source)
                except ValueError as error:
                    self._post([(request_id, error)])
            elif command[0] == "reset":
                assert self._loop is not None
                self._loop.call_soon_threadsafe(_resolve, command[1], self.engine.reset_prefix_cache())
            else:
                self.engine.abort_request(command[1])

    def _fail_all(self, error: Exception) -> None:
        failed = [seq.request_id for seq in self.engine.live_sequences()]
        for request_id in dict.fromkeys(failed):
            self.engine.abort_request(request_id)
        self._post([(request_id, RuntimeError(f"engine failure: {error}")) for request_id in failed])

    def _post(self, items: list[Any]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._deliver, items)

    def _deliver(self, items: list[Any]) -> None:
        for item in items:
            request_id, payload = (item.request_id, item) if isinstance(item, RequestOutput) else item
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put_nowait(payload)


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():  # its waiter may have gone away meanwhile
        future.set_result(value)
