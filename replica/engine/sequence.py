"""One generated sequence (a request has ``n`` of them): its tokens, pages and output progress."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from replica.engine.outputs import TokenLogprob
from replica.engine.sampling_params import SamplingParams
from replica.engine.stop_text import StopTextTracker
from replica.kvcache.radix_cache import RadixNode

if TYPE_CHECKING:
    import torch


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids are prompt + output; the first ``num_computed`` of them have K/V in pages."""

    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generator: torch.Generator | None,
        text: StopTextTracker,
        root: RadixNode,
        source: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.source = source  # the gateway that sent it, so its heartbeat share can be reported
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.generator = generator
        self.text = text
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.finish_reported = False
        # KV state
        self.page_table: list[int] = []
        self.num_tree_pages = 0  # leading pages owned by the radix tree (the rest are private)
        self.tree_node = root  # deepest locked tree node; root means none
        self.num_computed = 0
        self.num_cached_tokens: int | None = None  # prompt tokens hit in the cache at first admission
        self.expected_cached_tokens = 0  # while waiting: what the cache held when it was queued
        # output not yet handed to the client
        self.pending_token_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def private_pages(self) -> list[int]:
        return self.page_table[self.num_tree_pages :]
