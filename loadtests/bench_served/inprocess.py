"""The replica's engine on the benchmark's prompts with no server: the ``LLMEngine.step`` loop on
this process's main thread, ``concurrency`` requests in flight as a client would keep them."""

from __future__ import annotations

import time
from collections import deque

from replica.engine.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.engine.sampling_params import SamplingParams


class InProcessEngine:
    def __init__(self, config: EngineConfig, temperature: float) -> None:
        self.engine = LLMEngine(config)
        self.temperature = temperature
        self._next_id = 0

    def generate(self, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[int, float]:
        """Output tokens and the seconds they took, prefills included (as a served run), from an
        empty prefix cache."""
        self.engine.reset_prefix_cache()
        params = SamplingParams(max_tokens=max_tokens, temperature=self.temperature, ignore_eos=True)
        queue, in_flight, produced = deque(prompts), 0, 0
        started = time.perf_counter()
        while queue or in_flight:
            while queue and in_flight < concurrency:
                self._next_id += 1
                self.engine.add_request(f"bench-{self._next_id}", queue.popleft(), params)
                in_flight += 1
            for output in self.engine.step():
                produced += sum(len(delta.token_ids) for delta in output.deltas)
                in_flight -= output.finished
        return produced, time.perf_counter() - started
