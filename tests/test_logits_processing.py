"""Logits processing in the batched sampler (logit_bias, min_tokens, repetition / frequency /
presence penalties, min_p) against the per-row reference `process_row`, a plain loop written
from the definitions, and against HF's logits processors where HF has one."""

from __future__ import annotations

import random

import pytest
import torch

from engine.request import SamplingParams
from engine.sampler import RowSampling, _filter, draw, process_row, sample, uniform

EOS = (3,)
V = 12


def _naive(logits: torch.Tensor, p: SamplingParams, output: list[int], prompt: list[int]):
    """The definitions, one token at a time, without torch indexing tricks."""
    x = logits.tolist()
    for tok, bias in p.logit_bias:
        x[tok] += bias
    if len(output) < p.min_tokens:
        for tok in set(EOS) | set(p.stop_token_ids):
            x[tok] = float("-inf")
    for tok in range(len(x)):
        if p.repetition_penalty != 1.0 and (tok in prompt or tok in output):
            x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
        c = output.count(tok)
        if c:
            x[tok] -= p.frequency_penalty * c + p.presence_penalty
    return torch.tensor(x)


def _random_params(rng: random.Random, greedy: bool) -> SamplingParams:
    bias = tuple((rng.randrange(V), rng.choice([-100.0, -3.5, 2.0, 7.25]))
                 for _ in range(rng.randrange(3)))
    return SamplingParams(
        temperature=0.0 if greedy else rng.choice([0.5, 1.0, 1.7]), seed=rng.randrange(1 << 30),
        presence_penalty=rng.choice([0.0, 0.5, -1.0, 2.0]),
        frequency_penalty=rng.choice([0.0, 0.3, 1.5, -0.5]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.7, 2.0]), logit_bias=bias,
        min_tokens=rng.choice([0, 0, 3]), stop_token_ids=rng.choice([(), (5,), (5, 7)]),
        min_p=0.0 if greedy else rng.choice([0.0, 0.05, 0.3]), max_tokens=32,
        top_k=0 if greedy else rng.choice([0, 4]))


def test_batched_processing_matches_the_per_row_reference_and_the_definitions():
    """48 rows of random settings and histories (greedy and drawn, every field on and off) in
    one batched call: each row's token is the one the reference picks from its processed logits
    at that row's uniform number; the processed logits equal the plain definitions."""
    rng = random.Random(0)
    torch.manual_seed(0)
    logits = torch.randn(48, V) * 3
    rows, refs = [], []
    for r in range(48):
        p = _random_params(rng, greedy=r % 3 == 0)
        out = [rng.randrange(V) for _ in range(rng.randrange(6))]
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 8))]
        rows.append(RowSampling(p, len(out), output=out,
                                prompt=prompt if p.repetition_penalty != 1.0 else ()))
        ref = process_row(logits[r], p, out, prompt, EOS)
        assert torch.allclose(ref, _naive(logits[r], p, out, prompt), atol=1e-5), r
        refs.append(ref)
    toks, _ = sample(logits, [], [], rows=rows, eos_token_ids=EOS)
    for r, (row, ref, tok) in enumerate(zip(rows, refs, toks)):
        p = row.params
        want = (int(ref.argmax()) if p.greedy else
                draw(_filter(ref / p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1),
                     uniform(p.seed, row.index)))
        assert tok == want, r


def test_min_tokens_holds_eos_and_stop_ids_back_then_lets_them_through():
    logits = torch.full((1, V), -5.0)
    logits[0, EOS[0]] = 10.0
    logits[0, 5] = 9.0
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(5,), max_tokens=8)
    early = sample(logits, [], [], rows=[RowSampling(p, 1, output=[0])], eos_token_ids=EOS)[0]
    late = sample(logits, [], [], rows=[RowSampling(p, 2, output=[0, 1])], eos_token_ids=EOS)[0]
    assert early[0] not in (EOS[0], 5) and late == [EOS[0]]


def test_logit_bias_of_minus_100_bans_and_plus_100_forces():
    torch.manual_seed(1)
    logits = torch.randn(1, V)
    top = int(logits.argmax())
    ban = SamplingParams(temperature=0, logit_bias=((top, -100.0),))
    force = SamplingParams(temperature=1.0, seed=9, logit_bias=((7, 100.0),))
    toks, _ = sample(logits.repeat(2, 1), [ban, force], [0, 0])
    assert toks[0] != top and toks[1] == 7


def test_logprobs_stay_those_of_the_raw_model():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    p = SamplingParams(temperature=0, logprobs=True, logit_bias=((3, 50.0),))
    toks, lps = sample(logits, [p], [0])
    assert toks == [3]
    assert lps[0].logprob == pytest.approx(float(logits[0].log_softmax(-1)[3]), rel=1e-6)


def test_repetition_penalty_matches_hf():
    """HF applies the repetition penalty to the tokens of the sequence so far (prompt and
    output): the same scores as ours for the same tokens."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    torch.manual_seed(2)
    scores = torch.randn(1, 50) * 4
    prompt, out = [1, 4, 4, 9, 17], [17, 30, 2]
    for penalty in (0.6, 1.2, 1.9):
        hf = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + out]),
                                                       scores.clone())
        p = SamplingParams(temperature=0, repetition_penalty=penalty)
        ours = process_row(scores[0], p, out, prompt)
        assert torch.allclose(ours, hf[0], atol=1e-6)
        row = RowSampling(p, len(out), output=out, prompt=prompt)
        assert sample(scores, [], [], rows=[row])[0] == [int(hf[0].argmax())]


def test_min_p_keeps_tokens_within_a_share_of_the_top():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = ~torch.isinf(_filter(logits, 0, 1.0, 0.2))     # threshold 0.1
    assert kept.tolist() == [True, True, True, False]
    p = SamplingParams(temperature=1.0, min_p=0.5, seed=0)  # threshold 0.25: tokens 0 and 1
    drawn = {sample(logits[None], [SamplingParams(temperature=1.0, min_p=0.5, seed=s)], [0])[0][0]
             for s in range(200)}
    assert drawn == {0, 1} and p.min_p == 0.5
