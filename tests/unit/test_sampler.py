"""Random sampling draws from the distribution that temperature, top-k and top-p define: token
frequencies over many seeded draws, tokens outside the kept set never drawn, and the kept set
equal to the one a sort of the whole vocabulary gives."""

from __future__ import annotations

import pytest
import torch

from replica.engine.sampling_params import SamplingParams
from replica.model.sampler import _nucleus, _sample_row

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
DRAWS = 20_000


def _expected(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution written the long way: temperature, top-k mask, full sort for top-p."""
    row = logits / params.temperature
    if params.top_k > 0:
        row = row.masked_fill(row < torch.topk(row, params.top_k).values[-1], float("-inf"))
    probs = row.softmax(dim=-1)
    order = torch.argsort(probs, descending=True)
    ahead = torch.cumsum(probs[order], dim=0) - probs[order]
    dropped = order[ahead >= params.top_p]
    probs[dropped] = 0.0
    return probs / probs.sum()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=2.0, top_k=4, top_p=0.7),
    ],
    ids=["plain", "cold", "top_k", "top_p", "all"],
)
def test_draws_follow_the_distribution(params: SamplingParams) -> None:
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(LOGITS))
    for _ in range(DRAWS):
        counts[_sample_row(LOGITS.clone(), params, generator)] += 1
    expected = _expected(LOGITS, params)
    assert torch.all(counts[expected == 0] == 0), "a token outside the kept set was drawn"
    assert torch.all(counts[expected * DRAWS >= 20] > 0)
    frequencies = counts / DRAWS
    sigma = (expected * (1 - expected) / DRAWS).sqrt()
    assert torch.all((frequencies - expected).abs() <= 5 * sigma + 1e-9), (frequencies, expected)


@pytest.mark.parametrize("top_p", [0.1, 0.9, 0.999])
def test_nucleus_matches_a_full_sort_on_a_large_flat_vocabulary(top_p: float) -> None:
    """A flat distribution over 49,152 tokens makes the nucleus hold thousands of tokens, beyond
    the first candidates taken."""
    logits = torch.randn(49_152, generator=torch.Generator().manual_seed(1)) * 0.3
    probs = logits.softmax(dim=-1)
    values, ids = _nucleus(probs, 0, top_p)
    expected = _expected(logits, SamplingParams(top_p=top_p)).nonzero().flatten()
    assert len(ids) > 64
    assert set(ids.tolist()) == set(expected.tolist())
    assert torch.equal(values, probs[ids])


def test_same_seed_same_tokens() -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95)
    logits = torch.randn(1_000, generator=torch.Generator().manual_seed(2))
    draws = [
        [_sample_row(logits.clone(), params, generator) for _ in range(50)]
        for generator in (torch.Generator().manual_seed(5), torch.Generator().manual_seed(5))
    ]
    assert draws[0] == draws[1]
    assert len(set(draws[0])) > 5
