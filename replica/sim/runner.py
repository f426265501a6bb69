"""The simulated engine backend (``kvroute replica --engine sim``): a SIMULATION, not inference.

Everything but the forward pass is the real replica: scheduler, KV manager, radix cache with its
block hashes and event outbox, Redis publisher, HTTP server and metrics. ``SimRunner`` stands in
for ``ModelRunner``: for each scheduled batch it sleeps for the step time a cost profile predicts
(``time.sleep`` releases the GIL, like a forward pass) and appends deterministic filler tokens.
It loads no weights and never imports torch, so one machine holds dozens of these replicas.

The cost model (docs/SIMULATION.md has the fields, the built-in profiles and their sources):

    prefill part  = prefill_base_s + prefill_token_s · tokens + prefill_pair_s · attention pairs
                    + prefill_seq_s · chunks
    decode part   = decode_base_s + decode_seq_s · sequences + decode_context_s · context tokens
    step          = the parts present; a mixed step pays only the prefill part's base

A chunk of L tokens after s computed ones has L·s + L(L+1)/2 query-key pairs; a decoding
sequence's context is every token it attends to (its computed tokens plus the new one).
"""

from __future__ import annotations

import json
import logging
import math
import time
from array import array
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import xxhash

from kvroute.text.tokenizer import TextTokenizer
from replica.engine.config import EngineConfig
from replica.engine.outputs import TokenLogprob
from replica.engine.scheduler import ScheduledBatch
from replica.engine.sequence import Sequence
from replica.kvcache.pool import PagePool, pool_pages
from replica.model.config import ModelConfig

log = logging.getLogger("kvroute.replica")

COEFFICIENTS = (
    "prefill_base_s",
    "prefill_token_s",
    "prefill_pair_s",
    "prefill_seq_s",
    "decode_base_s",
    "decode_seq_s",
    "decode_context_s",
)
# KV bytes per element when a profile does not say how big a token's KV is (auto: bf16).
_DTYPE_BYTES = {"auto": 2, "float32": 4, "bfloat16": 2, "float16": 2}
# The filler the simulation "generates": its distinct ordinary tokens, in order, cycled.
_FILLER = (
    "This reply comes from a simulated replica: no model ran, and the words only stand in for tokens. "
    "Each step of the engine appends one more of them, so a request receives exactly the number it "
    "asked for, while the scheduler, cache and server behave as they would under real load."
)


@dataclass(frozen=True)
class StepShape:
    """What a step's cost depends on, read from the batch before it is computed."""

    prefill_tokens: int = 0
    prefill_pairs: int = 0  # query-key pairs the prefill chunks attend over
    prefill_seqs: int = 0  # prefill chunks in the step
    decode_seqs: int = 0
    decode_context: int = 0  # tokens the decoding sequences attend to, summed

    @classmethod
    def of(cls, batch: ScheduledBatch) -> StepShape:
        decode_context = sum(seq.num_computed + 1 for seq in batch.decodes)
        chunks = [(seq.num_computed, chunk) for seq, chunk in batch.prefills]
        return cls(
            prefill_tokens=sum(length for _, length in chunks),
            prefill_pairs=sum(length * start + length * (length + 1) // 2 for start, length in chunks),
            prefill_seqs=len(chunks),
            decode_seqs=len(batch.decodes),
            decode_context=decode_context,
        )


@dataclass(frozen=True)
class SimProfile:
    """A cost model: seconds per step from the step's shape. The JSON file holds these fields."""

    name: str
    prefill_base_s: float
    prefill_token_s: float
    prefill_pair_s: float
    prefill_seq_s: float
    decode_base_s: float
    decode_seq_s: float
    decode_context_s: float
    kv_bytes_per_token: int | None = None  # sizes the pool from --kv-cache-memory-gb; None: the model's
    description: str = ""
    source: str = ""
    calibration: dict[str, Any] = field(default_factory=dict)  # how the numbers were obtained

    def __post_init__(self) -> None:
        for name in COEFFICIENTS:
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"sim profile {self.name!r}: {name} must be a number >= 0, not {value!r}")
        if self.kv_bytes_per_token is not None and self.kv_bytes_per_token < 1:
            raise ValueError(f"sim profile {self.name!r}: kv_bytes_per_token must be positive")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SimProfile:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"sim profile: unknown fields {', '.join(unknown)}")
        missing = [name for name in ("name", *COEFFICIENTS) if name not in raw]
        if missing:
            raise ValueError(f"sim profile: missing fields {', '.join(missing)}")
        return cls(**raw)

    @classmethod
    def load(cls, name_or_path: str | Path) -> SimProfile:
        """A profile JSON file, or the name of a built-in one (replica/sim/profiles/NAME.json)."""
        path = Path(name_or_path)
        if path.is_file():
            return cls.from_dict(json.loads(path.read_text()))
        builtin = resources.files("replica.sim") / "profiles" / f"{name_or_path}.json"
        if not builtin.is_file():
            raise ValueError(
                f"no sim profile {str(name_or_path)!r}: not a file, and the built-in profiles are "
                f"{', '.join(builtin_profiles())}"
            )
        return cls.from_dict(json.loads(builtin.read_text()))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def step_seconds(self, shape: StepShape) -> float:
        seconds = 0.0
        if shape.prefill_seqs:
            seconds += (
                self.prefill_base_s
                + self.prefill_token_s * shape.prefill_tokens
                + self.prefill_pair_s * shape.prefill_pairs
                + self.prefill_seq_s * shape.prefill_seqs
            )
        if shape.decode_seqs:
            seconds += (
                (0.0 if shape.prefill_seqs else self.decode_base_s)
                + self.decode_seq_s * shape.decode_seqs
                + self.decode_context_s * shape.decode_context
            )
        return seconds

    def weight_bytes(self) -> int:
        """A cost model holds no weights (the engine reports its model's size)."""
        return 0


def builtin_profiles() -> list[str]:
    entries = (resources.files("replica.sim") / "profiles").iterdir()
    return sorted(entry.name.removesuffix(".json") for entry in entries if entry.name.endswith(".json"))


def filler_tokens(tokenizer: TextTokenizer, vocab_size: int, stop_ids: list[int]) -> list[int]:
    """The distinct ordinary tokens of the filler text: never special, never a stop token."""
    banned = {*tokenizer.all_special_ids, *stop_ids}
    ids = tokenizer.encode(_FILLER, add_special_tokens=False)
    cycle = list(dict.fromkeys(t for t in ids if t not in banned and t < vocab_size))
    if not cycle:
        raise ValueError("the tokenizer encodes the simulation's filler text to no ordinary tokens")
    return cycle


class SimRunner:
    """Sleeps for the profile's step time and emits the filler: a runner without a model."""

    def __init__(self, profile: SimProfile, pool: PagePool, cycle: list[int]) -> None:
        self.model = profile
        self.pool = pool
        self._cycle = cycle
        self._position = {token: i for i, token in enumerate(cycle)}

    @classmethod
    def load(
        cls, config: EngineConfig, model_config: ModelConfig, tokenizer: TextTokenizer, stop_ids: list[int]
    ) -> SimRunner:
        profile = SimProfile.load(config.sim_profile)
        bytes_per_token = profile.kv_bytes_per_token or model_config.kv_bytes_per_token(
            _DTYPE_BYTES[config.dtype]
        )
        pool = PagePool(pool_pages(config, bytes_per_token), config.block_size)
        log.warning(
            "SIMULATED replica (--engine sim, profile %r): no model runs and no weights are loaded; "
            "step times come from the profile's cost model and the text is filler",
            profile.name,
        )
        return cls(profile, pool, filler_tokens(tokenizer, model_config.vocab_size, stop_ids))

    @property
    def description(self) -> str:
        return f"SIMULATED by cost profile {self.model.name!r}, no weights"

    def generator(self, seed: int) -> None:
        """The filler is deterministic: no random stream to seed."""
        return None

    def execute(self, batch: ScheduledBatch) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        time.sleep(self.model.step_seconds(StepShape.of(batch)))
        sampled: list[tuple[Sequence, int, TokenLogprob | None]] = []
        for seq, start, length in batch.spans():
            seq.num_computed = start + length
            if seq.num_computed == len(seq.token_ids):
                token = self._next_token(seq)
                sampled.append((seq, token, self._logprob(token, seq.params.logprobs)))
        return sampled

    def _next_token(self, seq: Sequence) -> int:
        """The filler token after the last one; the first is picked by hashing the prompt, so equal
        requests get equal text (the choice index and seed tell ``n`` choices apart)."""
        if seq.num_output_tokens:
            return self._cycle[(self._position[seq.token_ids[-1]] + 1) % len(self._cycle)]
        prompt = array("I", seq.token_ids[: seq.num_prompt_tokens]).tobytes()
        salt = seq.index * 1_000_003 + (seq.params.seed or 0)
        return self._cycle[xxhash.xxh3_64_intdigest(prompt, seed=salt % 2**64) % len(self._cycle)]

    def _logprob(self, token: int, top: int | None) -> TokenLogprob | None:
        """The filler is certain: the chosen token has log-probability 0, the next ones -inf."""
        if top is None:
            return None
        start, size = self._position[token], len(self._cycle)
        others = [(self._cycle[(start + i) % size], -math.inf) for i in range(1, top)]
        return TokenLogprob(token, 0.0, [(token, 0.0), *others] if top else [])
