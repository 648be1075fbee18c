"""Continuous batching on tiny random-weight models: a batch gives each sequence exactly the
tokens it gets alone, through chunked prefill, mixed prefill/decode steps, preemption and aborts;
and every block goes back to the pool."""

from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import Request, SamplingParams
from tests.test_model_parity import make_model

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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_model(d, "llama")
    return d


def engine(model_dir, **kw) -> Engine:
    cfg = dict(num_blocks=128, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)
    cfg.update(kw)
    return Engine(model_dir, EngineConfig(**cfg))


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                    SamplingParams(temperature=0.9, top_p=0.9, seed=3,
                                                   max_tokens=24, ignore_eos=True)],
                         ids=["greedy", "seeded"])
def test_batch_equals_each_sequence_alone(model_dir, params):
    alone = {}
    for r in requests(params):
        alone.update(run(engine(model_dir), [r]))
    eng = engine(model_dir)
    together = run(eng, requests(params))
    assert together == alone
    assert eng.stats.steps < sum(len(v) for v in alone.values())   # steps were shared
    assert eng.pool.num_free == eng.pool.num_blocks


def test_preemption_keeps_outputs_and_frees_everything(model_dir):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    big = run(engine(model_dir), requests(params))
    eng = engine(model_dir, num_blocks=24, max_num_batched_tokens=64)
    small = run(eng, requests(params))
    assert eng.stats.preemptions > 0, "the pool was meant to be too small for all at once"
    assert small == big
    assert eng.pool.num_free == eng.pool.num_blocks and eng.kv_manager.num_requests == 0


def test_aborts_free_blocks_the_same_step(model_dir):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng = engine(model_dir)
    rng = random.Random(0)
    cut = {str(i): rng.randint(0, 10) for i in range(0, len(PROMPTS), 2)}
    got = run(eng, requests(params), abort_after=cut)
    for rid, n in cut.items():
        assert len(got[rid]) <= n + 1
    for rid in set(got) - set(cut):
        assert len(got[rid]) == 40
    assert eng.pool.num_free == eng.pool.num_blocks and not eng.scheduler.running


def test_request_that_can_never_fit_is_refused(model_dir):
    eng = engine(model_dir, num_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request(Request("x", list(range(1, 30)), SamplingParams(max_tokens=8)))
