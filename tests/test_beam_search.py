"""Beam search on the engine (engine/beam_search.py) against HF's `generate(num_beams=...)` on
the default model in fp32: the same beams, best first, for each early_stopping and length
penalties, prompts that end with EOS and prompts cut by max_tokens; width 1 is greedy; beams
fork and share blocks, and under a pool too small for every search at once the searches take
turns (beams preempted and recomputed) with the same answers and every block back."""

from __future__ import annotations

import pytest
import torch

from engine.beam_search import BeamGroup
from engine.request import Request, SamplingParams
from tests.conftest import make_engine

pytestmark = pytest.mark.slow

CASES = [  # (prompt or chat message, width, length_penalty, early_stopping, max_tokens)
    ("The capital of France is", 3, 1.0, False, 12),
    ("def fib(n):", 2, 1.0, False, 16),
    ("Once upon a time", 4, 0.5, True, 10),
    ("Hi", 2, 1.0, "never", 8),
    ({"role": "user", "content": "What is 2+2?"}, 4, 1.0, True, 30),
    ({"role": "user", "content": "Say yes."}, 3, 2.0, False, 24),
]


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _ids(hf, prompt) -> list[int]:
    if isinstance(prompt, dict):
        return hf[0].apply_chat_template([prompt], add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    return hf[0](prompt).input_ids


def _hf_beams(hf, ids, width, lp, early, max_tokens) -> list[list[int]]:
    eos = hf[1].generation_config.eos_token_id
    out = hf[1].generate(torch.tensor([ids]), num_beams=width, num_return_sequences=width,
                         max_new_tokens=max_tokens, do_sample=False, length_penalty=lp,
                         early_stopping=early, pad_token_id=eos)
    beams = [r[len(ids):].tolist() for r in out]
    return [b[:b.index(eos) + 1] if eos in b else b for b in beams]


def _run(eng, requests) -> dict[tuple[str, int], tuple[list[int], str]]:
    for r in requests:
        eng.add_request(r)
    out = {}
    for _ in range(5000):
        if not eng.has_work():
            break
        for o in eng.step():
            assert o.finished and o.error is None, o
            out[(o.request_id, o.choice)] = (o.new_token_ids, o.finish_reason)
    assert not eng.has_work(), "the searches did not end"
    assert eng.pool.num_free == eng.pool.num_blocks
    return out


def _beam(rid, ids, width, lp, early, max_tokens) -> Request:
    return Request(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens, n=width,
                                            beam_width=width, length_penalty=lp,
                                            early_stopping=early))


@pytest.mark.parametrize("num_blocks,block_size", [(256, 16), (44, 4)])
def test_beams_equal_hf(model_dir, hf, num_blocks, block_size):
    """All six searches in one batch; with 44 blocks of 4 tokens they cannot all hold their
    beams at once (the younger ones' waiting beams give way, and recompute)."""
    eng = make_engine(model_dir, num_blocks=num_blocks, block_size=block_size,
                      max_num_batched_tokens=64)
    try:
        ids = [_ids(hf, c[0]) for c in CASES]
        got = _run(eng, [_beam(f"r{i}", ids[i], *c[1:]) for i, c in enumerate(CASES)])
        if num_blocks < 100:
            assert eng.stats.preemptions > 0
    finally:
        eng.close()
    for i, (prompt, width, lp, early, max_tokens) in enumerate(CASES):
        ref = _hf_beams(hf, ids[i], width, lp, early, max_tokens)
        assert [got[(f"r{i}", c)][0] for c in range(width)] == ref, (prompt, width)
        eos = hf[1].generation_config.eos_token_id
        assert [got[(f"r{i}", c)][1] for c in range(width)] == [
            "stop" if b[-1] == eos else "length" for b in ref]


def test_width_one_is_greedy_and_beams_share_blocks(model_dir, hf):
    ids = _ids(hf, "The best thing about Paris is")
    eng = make_engine(model_dir, num_blocks=64, block_size=16, max_num_batched_tokens=64)
    try:
        one = _run(eng, [_beam("b", ids, 1, 1.0, False, 12)])
        greedy = hf[1].generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                pad_token_id=2)[0, len(ids):].tolist()
        assert one[("b", 0)][0] == greedy[:len(one[("b", 0)][0])]
        # four beams of a 7-token prompt: while they run, their blocks are shared, not 4 copies
        eng.add_request(_beam("w", ids, 4, 1.0, False, 12))
        peak = 0
        while eng.has_work():
            eng.step()
            peak = max(peak, eng.pool.num_blocks - eng.pool.num_free)
        assert peak <= 4 * 2 and eng.pool.num_free == eng.pool.num_blocks
    finally:
        eng.close()


def test_an_aborted_search_gives_every_block_back(model_dir, hf):
    eng = make_engine(model_dir, num_blocks=64, block_size=4, max_num_batched_tokens=64)
    try:
        eng.add_request(_beam("a", _ids(hf, "Tell me a story"), 4, 1.0, False, 40))
        for _ in range(6):
            eng.step()
        assert len(eng.scheduler.running) > 1            # forked beams are running
        assert eng.abort("a")
        assert not eng.has_work() and eng.pool.num_free == eng.pool.num_blocks
        too_big = _beam("big", list(range(5, 45)), 8, 1.0, False, 200)
        with pytest.raises(ValueError, match="beams cannot take turns"):
            eng.check_fits(too_big)
    finally:
        eng.close()


def test_a_group_keeps_the_best_hypotheses_and_stops_as_hf_does():
    """The selection rules alone: EOS among the first `width` ranks finishes a hypothesis,
    below them it is dropped; early_stopping true ends the search once `width` are done."""
    g = BeamGroup(2, 1.0, True, frozenset({0}), 10)
    g.start("a", [])
    assert g.observe("a", [(0, -0.1), (5, -0.5), (0, -0.9), (6, -2.0)])
    going = g.select()
    assert [(c.token, c.score) for c in going] == [(5, -0.5), (6, -2.0)]
    assert [(h.token_ids, h.score) for h in g.finished] == [([0], -0.1)]
    g.adopt("a", going[0], [])
    g.adopt("b", going[1], [])
    g.observe("a", [(0, -0.2), (7, -0.3)])
    assert g.observe("b", [(0, -0.1), (8, -0.4)])
    assert g.select() == [] and g.done
    assert [h.token_ids for h in g.results()] == [[0], [5, 0]]
    with pytest.raises(ValueError, match="early_stopping"):
        BeamGroup(2, 1.0, "sometimes", frozenset(), 4)
