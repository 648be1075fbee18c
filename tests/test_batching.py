"""Continuous batching on tiny random-weight models: a batch gives each sequence exactly the
tokens it gets alone, through chunked prefill, mixed prefill/decode steps, preemption and aborts;
and every block goes back to the pool."""

from __future__ import annotations

import functools
import random

import pytest

from engine.engine import Engine
from engine.request import Request, SamplingParams
from tests.conftest import make_engine

PROMPTS = [[5, 9, 17, 3, 3, 100, 41], [7] * 13, [1, 2, 3], list(range(20, 60)), [99, 98],
           [11, 12, 13, 14, 15, 16, 17, 18, 19]]


def run(engine: Engine, reqs: list[Request], abort_after: dict[str, int] | None = None):
    """Step until idle; abort request r once it has abort_after[r] tokens. -> tokens per id."""
    for r in reqs:
        engine.add_request(r)
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    while engine.has_work():
        for o in engine.step():
            got[o.request_id].extend(o.new_token_ids)
        for rid, n in (abort_after or {}).items():
            if len(got[rid]) >= n:
                engine.abort(rid)          # a no-op once the request is gone
    return got


def requests(params: SamplingParams) -> list[Request]:
    return [Request(str(i), p, params) for i, p in enumerate(PROMPTS)]


# what these tests need beyond the small engine: 128 blocks, 8 sequences at once
engine = functools.partial(make_engine, num_blocks=128, max_num_seqs=8)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                    SamplingParams(temperature=0.9, top_p=0.9, seed=3,
                                                   max_tokens=24, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_batch_equals_each_sequence_alone(tiny_model_dir, params):
    alone = {}
    for r in requests(params):
        alone.update(run(engine(tiny_model_dir), [r]))
    eng = engine(tiny_model_dir)
    together = run(eng, requests(params))
    assert together == alone
    assert eng.stats.steps < sum(len(v) for v in alone.values())   # steps were shared
    assert eng.pool.num_free == eng.pool.num_blocks


def test_preemption_keeps_outputs_and_frees_everything(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    big = run(engine(tiny_model_dir), requests(params))
    eng = engine(tiny_model_dir, num_blocks=24, max_num_batched_tokens=64)
    small = run(eng, requests(params))
    assert eng.stats.preemptions > 0, "the pool was meant to be too small for all at once"
    assert small == big
    assert eng.pool.num_free == eng.pool.num_blocks and eng.kv_manager.num_requests == 0


def test_aborts_free_blocks_the_same_step(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng = engine(tiny_model_dir)
    rng = random.Random(0)
    cut = {str(i): rng.randint(0, 10) for i in range(0, len(PROMPTS), 2)}
    got = run(eng, requests(params), abort_after=cut)
    for rid, n in cut.items():
        assert len(got[rid]) <= n + 1
    for rid in set(got) - set(cut):
        assert len(got[rid]) == 40
    assert eng.pool.num_free == eng.pool.num_blocks and not eng.scheduler.running


def test_request_that_can_never_fit_is_refused(tiny_model_dir):
    eng = engine(tiny_model_dir, num_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request(Request("x", list(range(1, 30)), SamplingParams(max_tokens=8)))
