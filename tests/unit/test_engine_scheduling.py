"""Engine behaviour: continuous batching, chunked prefill, prefix reuse, preemption, cancellation,
sampling options. Every test ends with the page-accounting integrity check."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvroute.protocol import EventKind
from replica.engine.llm_engine import LLMEngine
from replica.engine.outputs import RequestOutput, TokenLogprob
from replica.engine.sampling_params import SamplingParams
from replica.engine.sequence import SequenceStatus
from replica.model.sampler import _apply_penalties
from tests.conftest import EngineFactory
from tests.unit.test_engine_logits import random_prompt

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


class Collected:
    """Per-request token ids, text and finish reasons gathered from step outputs."""

    def __init__(self) -> None:
        self.tokens: dict[str, dict[int, list[int]]] = {}
        self.text: dict[str, dict[int, str]] = {}
        self.reasons: dict[str, dict[int, str | None]] = {}
        self.final: dict[str, RequestOutput] = {}
        self.logprobs: dict[str, dict[int, list[TokenLogprob]]] = {}

    def add(self, out: RequestOutput) -> None:
        for delta in out.deltas:
            self.tokens.setdefault(out.request_id, {}).setdefault(delta.index, []).extend(delta.token_ids)
            texts = self.text.setdefault(out.request_id, {})
            texts[delta.index] = texts.get(delta.index, "") + delta.text
            self.reasons.setdefault(out.request_id, {})[delta.index] = delta.finish_reason
            self.logprobs.setdefault(out.request_id, {}).setdefault(delta.index, []).extend(
                delta.logprobs or []
            )
        if out.finished:
            self.final[out.request_id] = out


def run_all(engine: LLMEngine, collected: Collected | None = None, max_steps: int = 5000) -> Collected:
    collected = collected or Collected()
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return collected
        for out in engine.step():
            collected.add(out)
    raise AssertionError("engine did not finish")


@pytest.fixture
def engine(make_engine: EngineFactory) -> Iterator[LLMEngine]:
    built = make_engine()
    yield built
    built.check_integrity()
    assert built.pool.num_free + built.cache.num_cached_pages == built.pool.num_pages, "pages leaked"


def test_generated_tokens_are_cached_for_the_next_turn(engine: LLMEngine) -> None:
    prompt = random_prompt(40, seed=1)
    engine.add_request("turn1", prompt, GREEDY)
    first = run_all(engine)
    history = prompt + first.tokens["turn1"][0]
    engine.add_request("turn2", [*history, *random_prompt(9, seed=2)], GREEDY)
    second = run_all(engine)
    # all but the last generated token have K/V; whole pages of that are reusable
    assert second.final["turn2"].cached_tokens == (len(history) - 1) // 16 * 16
    assert first.final["turn1"].cached_tokens == 0


def test_queued_load_counts_only_the_uncached_tail(engine: LLMEngine) -> None:
    """Gateways weigh a replica's queued prefill tokens against a cache hit: a queued request whose
    prefix is cached must not look like a cold one."""
    prompt = random_prompt(100, seed=30)
    engine.add_request("warm-up", prompt, GREEDY)
    run_all(engine)
    coldest = min(engine.cache.iter_nodes(), key=lambda node: node.last_access).last_access
    engine.add_request("hit", [*prompt[:96], *random_prompt(20, seed=31)], GREEDY)
    engine.add_request("cold", random_prompt(50, seed=32), GREEDY)
    assert engine.stats().waiting_prefill_tokens == (116 - 96) + 50
    # the estimate only peeks: queueing does not refresh the cached pages' LRU position
    assert min(node.last_access for node in engine.cache.iter_nodes()) == coldest
    run_all(engine)
    assert engine.stats().waiting_prefill_tokens == 0


def cold_prefill_under_way(
    make_engine: EngineFactory, seed: int, cold_tokens: int, max_num_seqs: int, budget: int = 64
) -> tuple[LLMEngine, list[int]]:
    """A ``budget``-token-budget engine (in every step: the larger budget of steps without
    decodes is the same) holding a cached 100-token prompt (returned) and running the first
    chunk of a cold prompt, request "cold"."""
    engine = make_engine(
        max_num_batched_tokens=budget, max_prefill_step_tokens=budget, max_num_seqs=max_num_seqs
    )
    prompt = random_prompt(100, seed=seed)
    engine.add_request("warm-up", prompt, ONE_TOKEN)
    run_all(engine)
    engine.add_request("cold", random_prompt(cold_tokens, seed=seed + 1), GREEDY)
    engine.step()  # the cold prompt's first 64-token chunk
    return engine, prompt


def test_a_cache_hit_jumps_ahead_of_a_long_prefill(make_engine: EngineFactory) -> None:
    """A hit's few uncached tokens go into the next step, not after every chunk of a cold prompt."""
    engine, prompt = cold_prefill_under_way(make_engine, seed=40, cold_tokens=600, max_num_seqs=8)
    engine.add_request("hit", [*prompt[:96], *random_prompt(10, seed=42)], GREEDY)
    first = {out.request_id for out in engine.step() for delta in out.deltas if delta.token_ids}
    assert first == {"hit"}, "the hit got its first token while the cold prompt is still prefilling"
    collected = run_all(engine)
    assert collected.final["hit"].cached_tokens == 96
    assert len(collected.tokens["cold"][0]) == 12 and len(collected.tokens["hit"][0]) == 11
    engine.check_integrity()


def test_the_step_that_finishes_a_hit_stays_short(make_engine: EngineFactory) -> None:
    """A hit's first token does not wait for a whole chunk of the cold prompt beside it: that
    step gives the cold prompt no more tokens than the hit takes or a quarter of the budget
    (here both under a page, and a prefill under way always gets its page)."""
    engine, prompt = cold_prefill_under_way(make_engine, seed=60, cold_tokens=600, max_num_seqs=8)
    cold = next(seq for seq in engine.scheduler.running if seq.request_id == "cold")
    page = engine.config.block_size
    engine.add_request("hit", [*prompt[:96], *random_prompt(10, seed=61)], GREEDY)
    before = cold.num_computed
    first = {out.request_id for out in engine.step() for delta in out.deltas if delta.token_ids}
    assert first == {"hit"}
    assert cold.num_computed - before == page, "the hit's step carried a long chunk of the cold prompt"
    before = cold.num_computed
    engine.step()  # the hit decodes: the cold prompt has the rest of the budget again
    assert cold.num_computed - before == 64 - 1
    run_all(engine)
    engine.check_integrity()


def test_hits_take_at_most_three_quarters_of_a_long_prefills_steps(make_engine: EngineFactory) -> None:
    """With a hit in every step, a long prompt still gets a quarter of each step's budget."""
    budget = 256
    engine, prompt = cold_prefill_under_way(
        make_engine, seed=70, cold_tokens=900, max_num_seqs=64, budget=budget
    )
    cold = next(seq for seq in engine.scheduler.running if seq.request_id == "cold")
    for i in range(4):
        engine.add_request(f"hit-{i}", [*prompt[:96], *random_prompt(10, seed=71 + i)], ONE_TOKEN)
        before = cold.num_computed
        engine.step()
        assert cold.num_computed - before == budget // 4
    run_all(engine)
    engine.check_integrity()


def test_a_stream_of_cache_hits_cannot_starve_a_long_prefill(make_engine: EngineFactory) -> None:
    """Hits go first, but a prefill under way still advances at least a page every step."""
    engine, prompt = cold_prefill_under_way(make_engine, seed=50, cold_tokens=300, max_num_seqs=64)
    cold = next(seq for seq in engine.scheduler.running if seq.request_id == "cold")
    for i in range(6):
        before = cold.num_computed
        # each hit's 20-token tail fits in the step, and together they would fill all of it
        for j in range(3):
            tail = random_prompt(20, seed=100 + 3 * i + j)
            engine.add_request(f"hit-{i}-{j}", [*prompt[:96], *tail], ONE_TOKEN)
        engine.step()
        assert cold.num_computed - before >= 16, "the cold prompt made no progress this step"
    run_all(engine)
    engine.check_integrity()


def test_a_burst_takes_the_larger_prefill_budget(make_engine: EngineFactory) -> None:
    """While more prompts wait for a first token than streams for a next one (two at least), steps
    take --max-prefill-step-tokens; a prompt alone, or as many prompts as decodes, keep
    --max-num-batched-tokens."""
    engine = make_engine(max_num_batched_tokens=64, max_prefill_step_tokens=256)
    engine.add_request("alone", random_prompt(600, seed=80), GREEDY)
    alone = engine.scheduler.waiting[0]
    engine.step()
    assert alone.num_computed == 64, "a prompt alone took the burst budget"
    run_all(engine)
    engine.add_request("first", random_prompt(200, seed=81), GREEDY)
    engine.add_request("second", random_prompt(200, seed=82), GREEDY)
    first, second = engine.scheduler.waiting
    engine.step()
    assert (first.num_computed, second.num_computed) == (200, 56)
    engine.step()  # one decode, one prompt: the short budget, less the decode's token
    assert second.num_computed == 56 + 64 - 1
    engine.step()  # second's last tokens
    for i in range(3):
        engine.add_request(f"more-{i}", random_prompt(100, seed=83 + i), GREEDY)
    more = list(engine.scheduler.waiting)
    engine.step()  # two decodes, three prompts: a burst
    assert sum(seq.num_computed for seq in more) > 2 * 100, "the burst's step kept the short budget"
    run_all(engine)
    engine.check_integrity()


def test_a_chunk_takes_a_prompts_short_tail_with_it(make_engine: EngineFactory) -> None:
    """A chunk that would leave a prompt no more than a sixteenth of the budget (4 of 64 tokens)
    takes that tail too, so its first token does not wait a whole step more; a longer tail waits."""
    engine = make_engine(max_num_batched_tokens=64, max_prefill_step_tokens=64)
    engine.add_request("decoding", random_prompt(10, seed=120), GREEDY)
    engine.step()

    def first_tokens() -> set[str]:
        return {out.request_id for out in engine.step() for delta in out.deltas if delta.token_ids}

    engine.add_request("one over", random_prompt(64, seed=121), GREEDY)  # 63 tokens of budget left
    assert first_tokens() == {"decoding", "one over"}
    engine.add_request("five over", random_prompt(62 + 5, seed=122), GREEDY)  # two decodes: 62 left
    five_over = engine.scheduler.waiting[0]
    assert first_tokens() == {"decoding", "one over"}
    assert five_over.num_computed == 62
    run_all(engine)
    engine.check_integrity()


@pytest.mark.parametrize("budget", [64, 1024])
def test_a_prefix_new_to_the_cache_is_computed_once(make_engine: EngineFactory, budget: int) -> None:
    """Two prompts sharing a new 300-token prefix arrive together: the second waits while the
    first computes the shared pages, then takes all 18 of them from the cache. Admitted beside
    the first's last chunk (a small budget) it would compute the last two itself; in the first's
    only step (a budget both fit in), all of them."""
    engine = make_engine(max_num_batched_tokens=budget, max_prefill_step_tokens=2 * budget)
    prefix = random_prompt(300, seed=90)
    engine.add_request("first", [*prefix, *random_prompt(10, seed=91)], GREEDY)
    engine.add_request("second", [*prefix, *random_prompt(10, seed=92)], GREEDY)
    collected = run_all(engine)
    assert collected.final["second"].cached_tokens == 288
    assert collected.final["first"].cached_tokens == 0
    engine.check_integrity()


def test_requests_join_the_running_batch_at_step_boundaries(engine: LLMEngine) -> None:
    engine.add_request("a", random_prompt(20, seed=3), GREEDY)
    engine.step()
    engine.add_request("b", random_prompt(20, seed=4), GREEDY)
    outputs = engine.step()
    assert {o.request_id for o in outputs} == {"a", "b"}  # a decodes while b prefills
    run_all(engine)


def test_chunked_prefill_never_stalls_decoding(make_engine: EngineFactory) -> None:
    engine = make_engine(max_num_batched_tokens=64)
    engine.add_request(
        "short", random_prompt(10, seed=5), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    )
    engine.step()
    engine.add_request("long", random_prompt(600, seed=6), GREEDY)
    steps_until_long_starts = 0
    while True:
        ids = {o.request_id for o in engine.step()}
        assert "short" in ids, "the decode was starved by the long prefill"
        steps_until_long_starts += 1
        if "long" in ids:
            break
    assert steps_until_long_starts >= 600 // 64  # the prompt really was cut into chunks
    run_all(engine)
    engine.check_integrity()


def test_preempted_requests_still_complete_correctly(make_engine: EngineFactory) -> None:
    prompts = {f"r{i}": random_prompt(30, seed=10 + i) for i in range(4)}
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = make_engine()
    for rid, prompt in prompts.items():
        roomy.add_request(rid, prompt, params)
    expected = run_all(roomy)
    tight = make_engine(kv_cache_tokens=160)  # 10 pages; 4 x 70 tokens need 20
    for rid, prompt in prompts.items():
        tight.add_request(rid, prompt, params)
    got = run_all(tight)
    assert tight.stats().num_preemptions > 0
    assert got.tokens == expected.tokens
    tight.check_integrity()


def test_cancellation_frees_everything(engine: LLMEngine) -> None:
    engine.add_request("gone", random_prompt(100, seed=20), SamplingParams(temperature=0, max_tokens=50))
    engine.add_request("kept", random_prompt(30, seed=21), GREEDY)
    for _ in range(3):
        engine.step()
    final = engine.abort_request("gone")
    assert final is not None and final.finished and final.deltas[0].finish_reason == "abort"
    assert all(seq.request_id == "kept" for seq in engine.scheduler.running)
    engine.check_integrity()
    assert engine.abort_request("gone") is None
    run_all(engine)


def test_n_choices_share_the_prompt_pages(engine: LLMEngine) -> None:
    engine.add_request(
        "n", random_prompt(64, seed=22), SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=8)
    )
    seqs = engine._requests["n"].seqs
    result = run_all(engine)
    assert [s.num_cached_tokens for s in seqs] == [0, 48, 48]  # choices 2-3 reuse 3 of 4 pages
    assert sorted(result.tokens["n"]) == [0, 1, 2]
    assert len({tuple(t) for t in result.tokens["n"].values()}) > 1, "choices should differ"
    assert result.final["n"].completion_tokens == 24


def test_seed_reproducible_whatever_else_is_in_the_batch(make_engine: EngineFactory) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=15, ignore_eos=True)
    prompt = random_prompt(25, seed=23)
    alone = make_engine()
    alone.add_request("x", prompt, params)
    crowded = make_engine()
    for i in range(3):
        others = SamplingParams(temperature=1.0, max_tokens=20)
        crowded.add_request(f"other{i}", random_prompt(30 + i, seed=30 + i), others)
    crowded.add_request("x", prompt, params)
    expected = run_all(alone).tokens["x"]
    assert run_all(crowded).tokens["x"] == expected
    reseeded = make_engine()
    reseeded.add_request(
        "x", prompt, SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=15, ignore_eos=True)
    )
    assert run_all(reseeded).tokens["x"] != expected


def test_stop_strings_are_not_emitted(make_engine: EngineFactory) -> None:
    prompt = random_prompt(20, seed=24)
    free = make_engine()
    free.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    text = run_all(free).text["r"][0]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    stopped = make_engine()
    stopped.add_request(
        "r", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    )
    result = run_all(stopped)
    assert result.text["r"][0] == text[: text.index(stop)]
    assert result.reasons["r"][0] == "stop"


def test_stop_token_ids_and_max_tokens(engine: LLMEngine) -> None:
    prompt = random_prompt(20, seed=25)
    engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    free = run_all(engine)
    assert len(free.tokens["free"][0]) == 10 and free.reasons["free"][0] == "length"
    tokens = free.tokens["free"][0]
    target = next(i for i, t in enumerate(tokens) if t not in tokens[:i])
    engine.add_request(
        "stop", prompt, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[tokens[target]])
    )
    stopped = run_all(engine)
    assert stopped.tokens["stop"][0] == tokens[: target + 1]
    assert stopped.reasons["stop"][0] == "stop"


def test_eos_from_generation_config_stops(engine: LLMEngine) -> None:
    """The tiny model's generation_config lists <|im_end|> and <|endoftext|> as EOS."""
    eos = {engine.tokenizer.token_to_id("<|im_end|>"), engine.tokenizer.token_to_id("<|endoftext|>")}
    assert set(engine.eos_token_ids) == eos
    prompt = random_prompt(20, seed=26)
    engine.add_request("free", prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    tokens = run_all(engine).tokens["free"][0]
    engine.eos_token_ids = [tokens[3]]  # pretend the 4th greedy token is the model's EOS
    engine.add_request("eos", prompt, SamplingParams(temperature=0, max_tokens=10))
    result = run_all(engine)
    assert result.tokens["eos"][0] == tokens[: tokens.index(tokens[3]) + 1]
    assert result.reasons["eos"][0] == "stop"


def test_top_k_one_and_tiny_top_p_are_greedy(engine: LLMEngine) -> None:
    prompt = random_prompt(20, seed=27)
    engine.add_request("greedy", prompt, GREEDY)
    engine.add_request("k1", prompt, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True))
    engine.add_request(
        "p0", prompt, SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=12, ignore_eos=True)
    )
    result = run_all(engine)
    assert result.tokens["k1"] == result.tokens["greedy"] == result.tokens["p0"]


def test_logprobs_are_the_model_distribution(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True)
    engine.add_request("lp", random_prompt(20, seed=28), params)
    result = run_all(engine)
    logprobs = result.logprobs["lp"][0]
    assert [lp.token_id for lp in logprobs] == result.tokens["lp"][0]
    for lp in logprobs:
        ids, values = zip(*lp.top, strict=True)
        assert len(ids) == 3 and list(values) == sorted(values, reverse=True)
        assert ids[0] == lp.token_id and lp.logprob == pytest.approx(values[0])  # greedy takes the top
        assert sum(torch.tensor(values).exp()) <= 1.0


def test_penalties_lower_repeated_tokens() -> None:
    row = torch.zeros(6)
    _apply_penalties(row, [1, 1, 4], SamplingParams(presence_penalty=0.5, frequency_penalty=0.25))
    assert row.tolist() == [0.0, -1.0, 0.0, 0.0, -0.75, 0.0]


def test_events_record_stores_and_evictions(make_engine: EngineFactory) -> None:
    engine = make_engine(kv_cache_tokens=128)  # 8 pages
    engine.add_request("a", random_prompt(70, seed=29), SamplingParams(temperature=0, max_tokens=2))
    run_all(engine)
    events = engine.cache.outbox.drain()  # type: ignore[union-attr]
    stored = [h for e in events if e.kind is EventKind.STORED for h in e.block_hashes]
    assert set(stored) == engine.cache.block_hashes() and len(stored) == 4
    engine.add_request("b", random_prompt(100, seed=30), SamplingParams(temperature=0, max_tokens=2))
    run_all(engine)
    events = engine.cache.outbox.drain()  # type: ignore[union-attr]
    removed = {h for e in events if e.kind is EventKind.REMOVED for h in e.block_hashes}
    assert removed and removed.issubset(set(stored))
    engine.check_integrity()


def test_prefills_starved_of_pages_preempt_instead_of_hanging(make_engine: EngineFactory) -> None:
    """Two sequences mid-prefill holding every page between them: one must yield."""
    engine = make_engine(kv_cache_tokens=160)  # 10 pages
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    engine.add_request("a", random_prompt(150, seed=40), params)
    engine.add_request("b", random_prompt(150, seed=41), params)
    a, b = (engine._requests[rid].seqs[0] for rid in ("a", "b"))
    for seq, pages in ((a, 5), (b, 5)):  # force the state: both admitted, 80 of 150 tokens done
        engine.scheduler.waiting.remove(seq)
        engine.kv.admit(seq)
        assert engine.kv.reserve(seq, pages * 16)
        seq.num_computed = 80
        seq.status = SequenceStatus.RUNNING
        engine.scheduler.running.append(seq)
    assert engine.pool.num_free == 0
    result = run_all(engine, max_steps=200)
    assert sorted(result.final) == ["a", "b"]
    assert engine.stats().num_preemptions >= 1
    engine.check_integrity()
