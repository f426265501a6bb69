"""One API request as the engine sees it: one engine request per prompt, each with ``n`` choices,
merged into one stream of choice deltas.

A request whose client goes away is cancelled, and cancelling closes the engine generators, which
aborts the engine requests and frees their KV pages.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from kvroute.openai_api.errors import APIError, internal_error
from replica.engine.async_engine import AsyncEngine, EngineDeadError
from replica.engine.outputs import ChoiceDelta, RequestOutput
from replica.engine.sampling_params import SamplingParams
from replica.server.metrics import ReplicaMetrics, RequestTracker

log = logging.getLogger("kvroute.replica")


@dataclass
class EngineJob:
    """One engine request: a prompt with its ``n`` choices, numbered from ``first_choice``."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    first_choice: int
    tracker: RequestTracker
    last: RequestOutput | None = None


class Generation:
    """The engine requests behind one API request, merged into one stream of choice deltas."""

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ReplicaMetrics,
        base_id: str,
        specs: list[tuple[list[int], SamplingParams]],
        source: str | None = None,
    ) -> None:
        self._engine = engine
        self._source = source
        self.jobs: list[EngineJob] = []
        self.num_choices = 0
        for i, (prompt_ids, params) in enumerate(specs):
            self.jobs.append(
                EngineJob(f"{base_id}-{i}", prompt_ids, params, self.num_choices, metrics.track())
            )
            self.num_choices += params.n

    async def deltas(self) -> AsyncGenerator[tuple[int, ChoiceDelta], None]:
        """``(choice index, delta)`` as the engine produces them.

        One task per engine request feeds a queue. Closing this generator (or cancelling its
        consumer) cancels those tasks, which closes their engine generators, which abort. All of
        it is synchronous, so it still happens inside an already-cancelled scope.
        """
        queue: asyncio.Queue[tuple[EngineJob, RequestOutput] | EngineJob | Exception] = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(job, queue)) for job in self.jobs]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                if isinstance(item, EngineJob):
                    running -= 1
                    continue
                job, output = item
                job.last = output
                job.tracker.observe(output)
                for delta in output.deltas:
                    yield job.first_choice + delta.index, delta
        finally:
            for task in tasks:
                task.cancel()
            for job in self.jobs:
                job.tracker.close(job.params.n)

    async def _pump(self, job: EngineJob, queue: asyncio.Queue[Any]) -> None:
        try:
            generation = self._engine.generate(job.request_id, job.prompt_ids, job.params, self._source)
            async for output in generation:
                queue.put_nowait((job, output))
        except Exception as error:
            queue.put_nowait(error)
        else:
            queue.put_nowait(job)

    def usage(self) -> dict[str, Any]:
        """OpenAI usage; ``cached_tokens`` is what the radix cache really served."""
        prompt = sum(len(job.prompt_ids) for job in self.jobs)
        completion = sum(job.last.completion_tokens for job in self.jobs if job.last is not None)
        cached = sum(job.last.cached_tokens for job in self.jobs if job.last is not None)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def as_api_error(error: Exception) -> APIError:
    """What a client sees for a failure during generation."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return APIError("The engine is not running; retry on another replica.", 503)
    if isinstance(error, ValueError):  # the engine's own request checks
        return APIError(str(error), 400)
    log.error("generation failed", exc_info=error)
    return internal_error("The engine failed while generating this request.")
