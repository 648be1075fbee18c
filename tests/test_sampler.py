"""Sampler: seeded reproducibility independent of batch position, top-k / top-p, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine.request import SamplingParams
from engine.sampler import _filter, draw, sample, uniform


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    toks, lps = sample(logits, [SamplingParams(temperature=0, logprobs=True, top_logprobs=2)], [0])
    assert toks == [1]
    ref = logits[0].log_softmax(-1)
    assert math.isclose(lps[0].logprob, float(ref[1]), rel_tol=1e-6)
    assert [t for t, _ in lps[0].top] == [1, 2]


def test_seeded_sampling_depends_only_on_seed_and_index():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=1.0, seed=1234)
    a, _ = sample(logits, [p, p, p], [0, 1, 2])
    # same request row alone, in another position of another batch: same tokens
    b = [sample(torch.stack([torch.randn(50), logits[i]]), [SamplingParams(temperature=0.0), p],
                [0, i])[0][1] for i in range(3)]
    assert a == b
    draws = {tuple(sample(logits[:1], [SamplingParams(temperature=1.0, seed=s)], [0])[0])
             for s in range(40)}
    assert len(draws) > 5, "different seeds must give different draws"


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().unsqueeze(0)
    counts = torch.zeros(3)
    for seed in range(3000):
        counts[sample(logits, [SamplingParams(temperature=1.0, seed=seed)], [0])[0][0]] += 1
    assert torch.allclose(counts / 3000, probs, atol=0.03)


def test_top_k_and_top_p_masks():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(_filter(logits, 2, 1.0)).tolist() == [False, False, True, True]
    p = logits.softmax(-1)                      # ~[0.64, 0.24, 0.09, 0.03]
    kept = ~torch.isinf(_filter(logits, 0, float(p[0]) + 0.01))
    assert kept.tolist() == [True, True, False, False]
    kept = ~torch.isinf(_filter(logits, 0, 0.1))
    assert kept.tolist() == [True, False, False, False]
    for seed in range(50):
        tok = sample(logits.unsqueeze(0), [SamplingParams(temperature=1.0, top_k=2, seed=seed)],
                     [0])[0][0]
        assert tok in (0, 1)


def test_draw_never_picks_a_zero_probability_token():
    """Inverse-CDF draws over unnormalized weights with zeros at both ends and in the middle:
    zeros are never drawn, the rest within 0.015 of their share over 20,000 seeds (over 4
    standard deviations), and a draw whose uniform rounds up to the total still lands on the
    last token that has mass."""
    weights = torch.tensor([0.0, 2.0, 0.0, 5.0, 3.0, 0.0])
    counts = torch.zeros(6)
    for seed in range(20_000):
        counts[draw(weights, uniform(seed, 7))] += 1
    assert counts[[0, 2, 5]].sum() == 0
    assert torch.allclose(counts / 20_000, weights / weights.sum(), atol=0.015)

    assert draw(weights, 1.0) == 4


def test_batched_rows_match_the_per_row_reference_at_their_uniform():
    """Every row of one batched call (greedy, temperature, top-k, top-p, both, different seeds
    and output indices) draws what the per-row reference draws at that row's uniform number."""
    from engine.sampler import sampling_probs

    torch.manual_seed(3)
    logits = torch.randn(8, 300) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=0.7, top_k=5, seed=2),
              SamplingParams(temperature=1.3, top_p=0.8, seed=3),
              SamplingParams(temperature=1.0, top_k=40, top_p=0.5, seed=4),
              SamplingParams(temperature=2.0, top_k=299, seed=5),
              SamplingParams(temperature=0.5, top_p=0.999, seed=6),
              SamplingParams(temperature=1.0, top_k=1000, seed=7)]
    for index in range(25):
        toks, _ = sample(logits, params, [index] * len(params))
        for row, (p, tok) in enumerate(zip(params, toks)):
            want = (int(logits[row].argmax()) if p.greedy else
                    draw(sampling_probs(logits[row], p), uniform(p.seed, index)))
            assert tok == want, (row, index)


def test_batched_logprobs_per_row():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [1.0, 1.0, 3.0, 0.0]])
    params = [SamplingParams(temperature=0, logprobs=True, top_logprobs=3),
              SamplingParams(temperature=0, logprobs=False),
              ]
    toks, lps = sample(logits, params, [0, 0])
    assert toks == [1, 2] and lps[1] is None
    ref = logits[0].log_softmax(-1)
    assert [t for t, _ in lps[0].top] == [1, 2, 0]
    assert math.isclose(lps[0].top[2][1], float(ref[0]), rel_tol=1e-6)


def test_uniform_is_a_pure_function_of_seed_index_and_stream():
    assert uniform(5, 3) == uniform(5, 3)
    values = {uniform(s, i, k) for s in range(20) for i in range(20) for k in (0, 1)}
    assert len(values) == 800 and all(0.0 <= u < 1.0 for u in values)
    mean = sum(values) / len(values)
    assert abs(mean - 0.5) < 0.03


def test_draw_rows_is_draw_of_each_row():
    """The draft proposer draws a whole step's rows on the device (one transfer): the same
    tokens as one `draw` per row, a u of 1.0 (rounds up to the total) and zero-mass tails
    included."""
    import torch

    from engine.sampler import draw, draw_rows

    g = torch.Generator().manual_seed(4)
    probs = torch.rand(6, 50, generator=g)
    probs[2, 30:] = 0.0
    probs[4, :] = 0.0
    probs[4, 7] = 1.0
    us = [0.0, 0.3, 1.0, 0.999999999, 0.5, 0.71]
    assert draw_rows(probs, us).tolist() == [draw(probs[r], u) for r, u in enumerate(us)]


def _sorted_reference(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The definition top-p is held to: a stable descending sort of the whole row, a token
    dropped once the mass ranked above it reaches top_p."""
    if 0 < top_k < x.shape[-1]:
        x = x.masked_fill(x < torch.topk(x, top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        probs = x.softmax(-1)
        order = x.sort(descending=True, stable=True).indices
        p = probs[order]
        drop = (p.cumsum(-1) - p) >= top_p
        x = x.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return x


@pytest.mark.parametrize("spill", [512, 4096])
def test_top_p_without_a_full_sort_keeps_the_sorted_nucleus_and_draws(monkeypatch, spill):
    """Top-p is decided on each row's most likely candidates where its nucleus ends among
    them, on the wider second tier where it ends past those (flat rows), and by a full sort
    where it ends past both (spill 512: the flat rows; ties reaching past the candidates): the
    kept tokens and the drawn tokens are those of the full stable sort in every case, batched
    or alone."""
    import engine.sampler
    from engine.sampler import CANDIDATES, sampling_probs

    monkeypatch.setattr(engine.sampler, "SPILL_CANDIDATES", spill)

    g = torch.Generator().manual_seed(11)
    v = 4 * CANDIDATES
    rows = [torch.randn(v, generator=g) * 6,                     # peaked: fits the candidates
            torch.randn(v, generator=g) * 0.3,                   # flat: the nucleus spills
            torch.randint(0, 3, (v,), generator=g).float() * 4,  # ties at the boundary, spill
            torch.randint(0, 40, (v,), generator=g).float(),     # ties among the candidates
            torch.randn(v, generator=g) * 6,
            torch.randn(v, generator=g) * 6,
            torch.randn(v, generator=g) * 0.3]
    rows[3][:5] = 60.0                                           # five tied leaders
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=1),
              SamplingParams(temperature=1.0, top_p=0.9, seed=2),
              SamplingParams(temperature=1.0, top_p=0.5, seed=3),
              SamplingParams(temperature=1.0, top_p=0.5, seed=4),
              SamplingParams(temperature=0.8, top_k=50, top_p=0.999, seed=5),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, top_k=CANDIDATES + 9, top_p=0.95, seed=6)]
    logits = torch.stack(rows)
    for row, p in enumerate(params):
        if p.greedy:
            continue
        x = logits[row] / p.temperature
        want = _sorted_reference(x, p.top_k, p.top_p)
        got = _filter(x, p.top_k, p.top_p)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), row
    kept_tied = ~torch.isinf(_filter(logits[3], 0, 0.5))
    # 0.2 each: three leaders cover 0.5, and among ties the lowest ids stay
    assert kept_tied[:5].tolist() == [True, True, True, False, False] and kept_tied.sum() == 3
    for index in range(40):
        toks, _ = sample(logits, params, [index] * len(params))
        for row, (p, tok) in enumerate(zip(params, toks)):
            if p.greedy:
                assert tok == int(logits[row].argmax())
                continue
            ref = _sorted_reference(logits[row] / p.temperature, p.top_k, p.top_p)
            assert tok == draw(ref.softmax(-1), uniform(p.seed, index)), (row, index)
            assert tok == draw(sampling_probs(logits[row], p), uniform(p.seed, index))
            # alone, a row held by its candidates draws from their CDF only: the same token
            assert sample(logits[row:row + 1], [p], [index])[0] == [tok]


def test_the_memory_profiles_full_sort_draws_what_the_candidates_draw():
    """The memory profile sorts every top-p row in full (its worst case): the same tokens."""
    from engine.sampler import RowSampling, Sampler

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 2000, generator=g) * 5
    rows = [RowSampling(SamplingParams(temperature=1.0, top_p=0.9, top_k=k, seed=s), 3)
            for s, k in ((1, 0), (2, 50), (3, 0), (4, 7))]
    got = []
    for sort_all in (False, True):
        sampler = Sampler()
        sampler.sort_all = sort_all
        host = {name: torch.zeros(n, dtype=dt).numpy() for name, n, dt in sampler.regions(4)}
        plan = sampler.stage(rows, host)
        dev = {k: torch.from_numpy(a) for k, a in host.items()}
        got.append(sampler.sample(logits, plan, dev)[0])
    assert got[0] == got[1]
