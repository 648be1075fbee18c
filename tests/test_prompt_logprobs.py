"""Prompt logprobs in the engine: scored from the logits of the forward pass that computes the
prompt (no second pass), chunk by chunk, against every position's logits; the prefix cache is
not read for such a request (a cached block has no logits, as in vLLM); tensor parallelism
scores them on rank 0 with the same values as one rank."""

from __future__ import annotations

import pytest
import torch

from engine.request import Request, SamplingParams
from pdserve.gpucheck import engine_logits
from tests.conftest import make_engine
from tests.test_model_parity import make_model

IDS = torch.randint(0, 128, (37,), generator=torch.Generator().manual_seed(5)).tolist()


def _prompt_logprobs(eng, ids, k, rid="r", **params):
    eng.add_request(Request(rid, ids, SamplingParams(temperature=0, max_tokens=2,
                                                     prompt_logprobs=k, **params)))
    got = None
    while eng.has_work():
        for o in eng.step():
            if o.prompt_logprobs is not None:
                assert got is None, "the prompt's logprobs come once, with the first token"
                got = o.prompt_logprobs
    return got


def _reference(model_dir, ids):
    """Every position's logits, from an engine of its own (nothing cached)."""
    eng = make_engine(model_dir)
    try:
        return engine_logits(eng, ids)
    finally:
        eng.close()


def _check(got, logits, ids, k):
    lp = logits.float().log_softmax(-1)
    assert lp.shape[0] == len(ids)
    assert len(got) == len(ids) and got[0] is None
    for i, e in enumerate(got[1:], start=1):
        row = lp[i - 1]
        assert e.token_id == ids[i]
        assert e.logprob == pytest.approx(float(row[ids[i]]), abs=1e-5)
        assert e.rank == int((row > row[ids[i]]).sum()) + 1
        assert [t for t, _ in e.top] == (row.topk(k).indices.tolist() if k else [])


@pytest.mark.parametrize("budget", [8, 64])
def test_prompt_logprobs_equal_the_positions_logits(tiny_model_dir, budget):
    """A chunked prompt (8-token steps) and a whole one score the same, each position once."""
    eng = make_engine(tiny_model_dir, max_num_batched_tokens=budget)
    try:
        got = _prompt_logprobs(eng, IDS, 3)
        _check(got, _reference(tiny_model_dir, IDS), IDS, 3)
        assert eng.pool.num_free == eng.pool.num_blocks
    finally:
        eng.close()


def test_a_cached_prompt_is_scored_again_and_every_choice_shares_it(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    try:
        _prompt_logprobs(eng, IDS, None, "warm")     # the prompt's blocks now cached
        plain = Request("plain", IDS, SamplingParams(temperature=0, max_tokens=1))
        eng.add_request(plain)
        while eng.has_work():
            eng.step()
        assert plain.num_cached_tokens > 0            # the cache holds the prompt
        req = Request("again", IDS, SamplingParams(temperature=0, max_tokens=2, n=3,
                                                   prompt_logprobs=0))
        eng.add_request(req)
        got, firsts = None, 0
        while eng.has_work():
            for o in eng.step():
                firsts += o.prompt_logprobs is not None
                got = got or o.prompt_logprobs
        assert req.num_cached_tokens == 0 and firsts == 1
        _check(got, _reference(tiny_model_dir, IDS), IDS, 0)
    finally:
        eng.close()


def test_prompt_logprobs_under_tensor_parallelism(tmp_path):
    make_model(tmp_path, "llama")
    out = {}
    for tp in (1, 2):
        eng = make_engine(tmp_path, tensor_parallel_size=tp, max_num_batched_tokens=16)
        try:
            out[tp] = _prompt_logprobs(eng, IDS, 2)
        finally:
            eng.close()
    assert [e.token_id for e in out[2][1:]] == IDS[1:]
    for a, b in zip(out[1][1:], out[2][1:]):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5) and a.rank == b.rank
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
