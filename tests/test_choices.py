"""n > 1 on the engine: a request's choices are forked from it once its prompt is computed,
sharing the prompt's blocks; each gives exactly the tokens of a lone request with its seed;
the prompt is computed once (plus the last prompt token per extra choice); no block leaks."""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest

from engine.engine import Engine
from engine.request import Request, SamplingParams, choice_seed
from tests.conftest import make_engine

PROMPT = [5, 9, 17, 3, 3, 100, 41, 8, 8, 2, 77]       # 11 tokens: 2 full blocks of 4 + 3


engine = functools.partial(make_engine, num_blocks=64, max_num_seqs=8)


def run(eng: Engine, req: Request, abort_choice: dict[int, int] | None = None):
    """Tokens per choice of one request; abort choice c once it has abort_choice[c] tokens."""
    eng.add_request(req)
    got: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    while eng.has_work():
        for o in eng.step():
            got.setdefault(o.choice, []).extend(o.new_token_ids)
            if o.finish_reason:
                reasons[o.choice] = o.finish_reason
        for c, n in (abort_choice or {}).items():
            if len(got.get(c, [])) >= n and c not in reasons:
                out = eng.abort_choice(req.request_id, c)
                if out is not None:
                    reasons[c] = out.finish_reason
    return got, reasons


def lone(tiny_model_dir, params: SamplingParams, choice: int) -> list[int]:
    p = replace(params, n=1, seed=choice_seed(params.seed, choice))
    got, _ = run(engine(tiny_model_dir), Request("alone", list(PROMPT), p))
    return got[0]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_each_choice_is_the_lone_request_with_its_seed(tiny_model_dir, prefix_cache):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True,
                            n=4)
    eng = engine(tiny_model_dir, enable_prefix_caching=prefix_cache)
    got, reasons = run(eng, Request("r", list(PROMPT), params))
    assert sorted(got) == [0, 1, 2, 3] and set(reasons.values()) == {"length"}
    for c in range(4):
        assert got[c] == lone(tiny_model_dir, params, c), c
    assert len({tuple(t) for t in got.values()}) > 1, "choices must draw their own streams"
    # the prompt once, plus its last token once per extra choice, plus the decodes
    assert eng.stats.tokens == len(PROMPT) + 3 + 4 * (12 - 1)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_greedy_choices_are_identical(tiny_model_dir):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, n=3)
    got, _ = run(engine(tiny_model_dir), Request("g", list(PROMPT), params))
    assert got[0] == got[1] == got[2] == lone(tiny_model_dir, params, 0)


def test_prompt_on_a_block_boundary_and_a_one_token_output(tiny_model_dir):
    prompt = PROMPT[:8]                             # exactly 2 blocks
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=1, n=3)
    eng = engine(tiny_model_dir)
    eng.add_request(Request("b", list(prompt), params))
    got = {}
    while eng.has_work():
        for o in eng.step():
            got.setdefault(o.choice, []).extend(o.new_token_ids)
    for c in range(3):
        p = replace(params, n=1, seed=choice_seed(5, c))
        alone, _ = run(engine(tiny_model_dir), Request("x", list(prompt), p))
        assert got[c] == alone[0]
    assert eng.pool.num_free == eng.pool.num_blocks


def test_one_choice_aborted_the_others_go_on(tiny_model_dir):
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=10, ignore_eos=True, n=3)
    eng = engine(tiny_model_dir)
    got, reasons = run(eng, Request("a", list(PROMPT), params), abort_choice={1: 3})
    assert reasons[1] == "abort" and reasons[0] == reasons[2] == "length"
    assert len(got[0]) == len(got[2]) == 10 and len(got[1]) < 10
    assert got[2] == lone(tiny_model_dir, params, 2)
    assert eng.pool.num_free == eng.pool.num_blocks


def test_abort_of_the_request_ends_every_choice(tiny_model_dir):
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=50, ignore_eos=True, n=4)
    eng = engine(tiny_model_dir)
    eng.add_request(Request("all", list(PROMPT), params))
    for _ in range(4):
        eng.step()
    assert len(eng.scheduler.running) + len(eng.scheduler.waiting) == 4
    assert eng.abort("all")
    assert not eng.has_work() and eng.pool.num_free == eng.pool.num_blocks


def test_choices_survive_preemption(tiny_model_dir):
    """A pool too small for every choice at once: choices are preempted and recomputed, and
    still give their lone tokens."""
    params = SamplingParams(temperature=0.7, seed=9, max_tokens=14, ignore_eos=True, n=4)
    eng = engine(tiny_model_dir, num_blocks=14)
    got, _ = run(eng, Request("p", list(PROMPT), params))
    assert eng.stats.preemptions > 0
    for c in range(4):
        assert got[c] == lone(tiny_model_dir, params, c), c
    assert eng.pool.num_free == eng.pool.num_blocks


@pytest.mark.parametrize("num_blocks,max_seqs", [(6, 1), (7, 2), (6, 2)])
def test_choices_that_cannot_run_together_take_turns(tiny_model_dir, num_blocks, max_seqs):
    """A pool that holds one choice at a time: forked choices waiting with blocks give them up
    to the request ahead of them (no livelock), and each still gives its lone tokens."""
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True, n=4)
    eng = engine(tiny_model_dir, num_blocks=num_blocks, max_num_seqs=max_seqs)
    eng.add_request(Request("t", list(PROMPT), params))
    got: dict[int, list[int]] = {}
    for _ in range(2000):
        if not eng.has_work():
            break
        for o in eng.step():
            got.setdefault(o.choice, []).extend(o.new_token_ids)
    assert not eng.has_work(), "the choices must all finish"
    for c in range(4):
        assert got[c] == lone(tiny_model_dir, params, c), c
    assert eng.pool.num_free == eng.pool.num_blocks


def test_many_requests_of_many_choices_in_a_tight_pool(tiny_model_dir):
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=40, ignore_eos=True, n=8)
    eng = engine(tiny_model_dir, num_blocks=64, max_num_seqs=8)
    for i in range(6):
        eng.add_request(Request(f"m{i}", [i + 1] * 19 + PROMPT, params))
    done = 0
    for _ in range(4000):
        if not eng.has_work():
            break
        done += sum(o.finished for o in eng.step())
    assert done == 48 and eng.pool.num_free == eng.pool.num_blocks


def test_a_fork_aborted_before_its_copy_keeps_the_blocks_until_the_copy_is_done(tiny_model_dir):
    """The block copy of a fork runs at the next step: until then its blocks stay referenced,
    so an abort in between cannot hand them to another request mid-copy."""
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=8, ignore_eos=True, n=3)
    eng = engine(tiny_model_dir)
    eng.add_request(Request("c", list(PROMPT), params))
    while not eng.kv_manager.pending_copies:
        eng.step()
    pairs = eng.kv_manager.pending_copies
    eng.abort("c")
    held = {b for pair in pairs for b in pair}
    assert eng.pool.num_free == eng.pool.num_blocks - len(held)
    assert all(eng.pool.ref_count(b) > 0 for b in held)
    eng.step()
    assert eng.pool.num_free == eng.pool.num_blocks
