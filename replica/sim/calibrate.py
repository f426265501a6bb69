"""``kvroute calibrate``: measures the real torch engine and fits a cost profile for ``--engine sim``.

It drives ``LLMEngine`` directly (no HTTP) and times only the runner's ``execute`` (the forward
pass and sampling), because that is exactly what ``SimRunner`` replaces: the scheduler, cache and
bookkeeping around it run for real in the simulation too. Measured steps:

- single prefills of several sizes, with and without a cached prefix (one step each: the token
  budget is larger than any prompt, and ``max_tokens=1`` ends the request in that step);
- the admission of a batch of requests sharing a cached prefix (one prefill step, many chunks);
- the decode steps of that batch, at several batch sizes and context lengths.

The configurations are measured round-robin, ``repeats`` times over, and each one's fastest step
is kept: on a shared machine other work only ever adds time, so the minimum is the best estimate
of the step's own cost. Those times are fitted by non-negative least squares on relative error
(a 15 ms step matters as much as a 1 s one): prefill steps on ``[1, tokens, pairs, chunks]``,
decode steps on ``[1, sequences, context]`` (see ``replica.sim.runner``).
"""

from __future__ import annotations

import itertools
import platform
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from replica.engine.config import EngineConfig
from replica.engine.llm_engine import LLMEngine, Runner, StepModel
from replica.engine.outputs import RequestOutput, TokenLogprob
from replica.engine.sampling_params import SamplingParams
from replica.engine.scheduler import ScheduledBatch
from replica.engine.sequence import Sequence
from replica.kvcache.pool import PagePool
from replica.sim.runner import COEFFICIENTS, SimProfile, StepShape

_ADMIT_SUFFIX = 8  # unique tokens after the shared prefix of each request in a decode batch


@dataclass(frozen=True)
class Plan:
    """What to measure: prefills as (cached, new) tokens, decode batches as (sequences, context)."""

    prefills: tuple[tuple[int, int], ...]
    batches: tuple[tuple[int, int], ...]
    repeats: int  # rounds over every configuration
    decode_steps: int  # per decode batch and round
    kv_cache_tokens: int
    max_num_batched_tokens: int


FULL_PLAN = Plan(
    prefills=(
        *((0, n) for n in (16, 64, 128, 256, 512, 1024)),
        *((512, n) for n in (32, 128, 512)),
        *((1024, n) for n in (128, 512)),
    ),
    batches=((1, 64), (1, 1024), (4, 256), (8, 64), (8, 1024), (16, 512), (32, 64), (32, 1024)),
    repeats=3,
    decode_steps=4,
    kv_cache_tokens=16384,
    max_num_batched_tokens=2048,
)
QUICK_PLAN = Plan(
    prefills=((0, 16), (0, 64), (0, 128), (64, 64)),
    batches=((1, 32), (4, 128), (8, 32)),
    repeats=2,
    decode_steps=4,
    kv_cache_tokens=4096,
    max_num_batched_tokens=256,
)


@dataclass
class Group:
    """One measured configuration: its label and its fastest step's shape and time."""

    label: str
    shape: StepShape
    seconds: float


class _TimedRunner:
    """Wraps the engine's runner and records the shape and duration of every ``execute``."""

    def __init__(self, inner: Runner) -> None:
        self.inner = inner
        self.model: StepModel = inner.model
        self.pool: PagePool = inner.pool
        self.steps: list[tuple[StepShape, float]] = []

    @property
    def description(self) -> str:
        return self.inner.description

    def generator(self, seed: int) -> Any:
        return self.inner.generator(seed)

    def execute(self, batch: ScheduledBatch) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        shape = StepShape.of(batch)
        start = time.perf_counter()
        sampled = self.inner.execute(batch)
        self.steps.append((shape, time.perf_counter() - start))
        return sampled


class _Bench:
    """Runs requests on the engine to completion and groups the steps they took."""

    def __init__(self, engine: LLMEngine, plan: Plan, progress: Callable[[str], None]) -> None:
        self.engine = engine
        self.plan = plan
        self.progress = progress
        self.timed = _TimedRunner(engine.runner)
        engine.runner = self.timed
        self.rng = random.Random(0)
        self.vocab = engine.model_config.vocab_size
        self._ids = itertools.count()

    def tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(count)]

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[RequestOutput]:
        """Runs the prompts together until all finish; returns each one's last output."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = [f"calibrate-{next(self._ids)}" for _ in prompts]
        for request_id, prompt in zip(ids, prompts, strict=True):
            self.engine.add_request(request_id, prompt, params)
        last: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for output in self.engine.step():
                last[output.request_id] = output
        return [last[request_id] for request_id in ids]

    def prefill(self, prefix: list[int], new: int) -> tuple[StepShape, float]:
        """One prefill of ``new`` tokens after ``prefix`` (cached again first): its single step."""
        if prefix:
            self.run([prefix], 1)
        self.timed.steps.clear()
        (output,) = self.run([prefix + self.tokens(new)], 1)
        if output.cached_tokens != len(prefix) or len(self.timed.steps) != 1:
            raise RuntimeError(f"the prefill of {new} tokens after {len(prefix)} cached took several steps")
        return self.timed.steps[0]

    def batch(self, prefix: list[int], size: int) -> list[tuple[StepShape, float]]:
        """``size`` requests sharing ``prefix``: their admission step, then their decode steps."""
        self.run([prefix], 1)
        self.timed.steps.clear()
        self.run([prefix + self.tokens(_ADMIT_SUFFIX) for _ in range(size)], self.plan.decode_steps + 1)
        admit, *decodes = self.timed.steps
        if admit[0].prefill_seqs != size or any(shape.decode_seqs != size for shape, _ in decodes):
            raise RuntimeError(f"the batch of {size} was not admitted and decoded together")
        return self.timed.steps[:]

    def measure(self) -> list[Group]:
        """Every configuration, round-robin ``repeats`` times; one group per kind and configuration."""
        prefixes = {cached: self.tokens(cached) for cached, _ in self.plan.prefills}
        prefixes |= {context: self.tokens(context) for _, context in self.plan.batches}
        steps: dict[str, list[tuple[StepShape, float]]] = {}
        for round_ in range(self.plan.repeats):
            self.progress(f"round {round_ + 1} of {self.plan.repeats}")
            for cached, new in self.plan.prefills:
                steps.setdefault(f"prefill new={new} cached={cached}", []).append(
                    self.prefill(prefixes[cached], new)
                )
            for size, context in self.plan.batches:
                admit, *decodes = self.batch(prefixes[context], size)
                steps.setdefault(f"admit batch={size} cached={context}", []).append(admit)
                steps.setdefault(f"decode batch={size} context~{context + _ADMIT_SUFFIX}", []).extend(decodes)
        return [_fastest(label, measured) for label, measured in steps.items()]

    def warm_up(self) -> None:
        self.run([self.tokens(64) for _ in range(4)], 8)


def _fastest(label: str, steps: list[tuple[StepShape, float]]) -> Group:
    shape, seconds = min(steps, key=lambda step: step[1])
    return Group(label, shape, seconds)


def nonnegative_lstsq(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: the best of the exact fits on each column subset
    whose solution is non-negative (few columns, so trying them all is cheap and exact)."""
    columns = features.shape[1]
    best, best_residual = np.zeros(columns), float(np.sum(target**2))
    for size in range(1, columns + 1):
        for subset in itertools.combinations(range(columns), size):
            solution = np.linalg.lstsq(features[:, subset], target, rcond=None)[0]
            if np.any(solution < 0):
                continue
            residual = float(np.sum((features[:, subset] @ solution - target) ** 2))
            if residual < best_residual:
                best, best_residual = np.zeros(columns), residual
                best[list(subset)] = solution
    return best


def prefill_features(shape: StepShape) -> list[float]:
    """The prefill coefficients' multipliers, in ``COEFFICIENTS`` order."""
    return [1.0, shape.prefill_tokens, shape.prefill_pairs, shape.prefill_seqs]


def decode_features(shape: StepShape) -> list[float]:
    """The decode coefficients' multipliers, in ``COEFFICIENTS`` order."""
    return [1.0, shape.decode_seqs, shape.decode_context]


def _relative_fit(features: list[list[float]], seconds: list[float]) -> np.ndarray:
    """Coefficients minimising the squared relative errors (each row divided by its time)."""
    scale = 1 / np.array(seconds)
    return nonnegative_lstsq(np.array(features) * scale[:, None], np.ones(len(seconds)))


def fit_profile(name: str, prefills: list[Group], decodes: list[Group], **metadata: Any) -> SimProfile:
    """The profile whose predictions best match the groups' step times."""
    prefill = _relative_fit([prefill_features(g.shape) for g in prefills], [g.seconds for g in prefills])
    decode = _relative_fit([decode_features(g.shape) for g in decodes], [g.seconds for g in decodes])
    coefficients = dict(zip(COEFFICIENTS, [*prefill, *decode], strict=True))  # features' order
    return SimProfile(name=name, **{k: float(f"{v:.4g}") for k, v in coefficients.items()}, **metadata)


def fit_report(profile: SimProfile, groups: list[Group]) -> tuple[str, dict[str, float]]:
    """A table of measured against predicted times, and the fit quality (R², relative errors)."""
    lines = [f"{'configuration':<40} {'measured ms':>12} {'predicted ms':>13} {'error':>7}"]
    errors, quality = [], {}
    for kind in ("prefill", "admit", "decode"):
        chosen = [g for g in groups if g.label.startswith(kind)]
        measured = np.array([g.seconds for g in chosen])
        predicted = np.array([profile.step_seconds(g.shape) for g in chosen])
        for group, m, p in zip(chosen, measured, predicted, strict=True):
            errors.append(p / m - 1)
            lines.append(f"{group.label:<40} {m * 1e3:>12.2f} {p * 1e3:>13.2f} {p / m - 1:>+7.1%}")
        spread = float(np.sum((measured - measured.mean()) ** 2))
        residual = float(np.sum((measured - predicted) ** 2))
        quality[f"r2_{kind}"] = round(1 - residual / spread, 4) if spread else 1.0
    quality["median_abs_error"] = round(float(np.median(np.abs(errors))), 4)
    quality["max_abs_error"] = round(float(np.max(np.abs(errors))), 4)
    lines.append(
        f"R² prefill {quality['r2_prefill']}, admissions {quality['r2_admit']},"
        f" decode {quality['r2_decode']}; |error| median {quality['median_abs_error']:.1%},"
        f" max {quality['max_abs_error']:.1%}"
    )
    return "\n".join(lines), quality


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibrate(
    model: Path,
    *,
    dtype: str = "auto",
    threads: int | None = None,
    name: str | None = None,
    quick: bool = False,
    progress: Callable[[str], None] = print,
) -> tuple[SimProfile, str]:
    """Measures the torch engine on ``model`` and returns the fitted profile and its fit report."""
    import torch

    from replica.model.runner import resolve_dtype

    plan = QUICK_PLAN if quick else FULL_PLAN
    config = EngineConfig(
        model=model,
        dtype=dtype,
        threads=threads,
        kv_cache_tokens=plan.kv_cache_tokens,
        max_num_seqs=max(batch for batch, _ in plan.batches),
        max_num_batched_tokens=plan.max_num_batched_tokens,
        max_prefill_step_tokens=plan.max_num_batched_tokens,  # the plan's steps, bursts included
    )
    engine = LLMEngine(config)
    bench = _Bench(engine, plan, progress)
    started = time.monotonic()
    bench.warm_up()
    groups = bench.measure()
    decodes = [g for g in groups if g.label.startswith("decode")]
    kv_dtype = resolve_dtype(dtype, engine.model_config, config.device)
    threads_used = torch.get_num_threads()
    profile = fit_profile(
        name or f"cpu-{model.name.lower()}",
        [g for g in groups if not g.label.startswith("decode")],
        decodes,
        kv_bytes_per_token=engine.model_config.kv_bytes_per_token(kv_dtype.itemsize),
        description=(
            f"{engine.served_model_name} ({str(kv_dtype).removeprefix('torch.')}) on the kvroute torch"
            f" engine, {_cpu_model()}, torch threads: {threads_used}"
        ),
        source="measured by `kvroute calibrate` (replica/sim/calibrate.py)",
    )
    report, quality = fit_report(profile, groups)
    calibration = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "cpu": _cpu_model(),
        "threads": threads_used,
        "dtype": str(kv_dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "plan": "quick" if quick else "full",
        "configurations": len(groups),
        "seconds": round(time.monotonic() - started, 1),
        **quality,
    }
    return SimProfile.from_dict({**profile.to_dict(), "calibration": calibration}), report
