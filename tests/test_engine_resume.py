"""A resumed request (a stream moved from a decode worker that failed) on the engines: the
prompt + the tokens already sent as its output, their KV computed by a prefill engine (or on the
decode engine), go on with exactly the tokens of the uninterrupted request, greedy and seeded
sampled with penalties and min_tokens; a grammar's state is advanced through the resumed
tokens; requests of n > 1 and resumes that leave no max_tokens are refused."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from engine.engine import Engine
from engine.request import Request, SamplingParams
from engine.structured import StructuredSpec
from tests.conftest import make_engine

PROMPT = [5, 9, 17, 3, 3, 100, 41, 8, 8, 2, 77]       # 11 tokens: 2 full blocks of 4 + 3
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=20,
                         frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2,
                         min_tokens=15)


def engines(model_dir) -> tuple[Engine, Engine]:
    """(prefill, decode) engines of one model, prefix caching on."""
    return tuple(make_engine(model_dir, num_blocks=64, max_num_seqs=8, role=role)
                 for role in ("prefill", "decode"))


def disaggregated(p: Engine, d: Engine, req: Request) -> tuple[list[int], int]:
    """Run `req` as the workers do: D reserves blocks for prompt + output, P computes them and
    samples the next token, the KV is copied into D's blocks past those D had cached, D goes
    on. -> (D's new tokens, blocks copied)."""
    twin = Request(req.request_id, list(req.prompt_token_ids), req.params,
                   list(req.output_token_ids))
    blocks = d.reserve_remote(req)
    assert len(blocks) == -(-req.num_tokens // d.cfg.block_size)
    p.add_request(twin)
    sent: list[int] = []
    first = None
    while first is None:
        for o in p.step():
            sent += o.kv_blocks or []
            if o.finished:
                assert o.finish_reason == "prefilled"
                first = o
    assert len(sent) == len(blocks)
    cached = req.num_cached_blocks
    d.kv[:, :, blocks[cached:]] = p.kv[:, :, sent[cached:]]
    p.save_done(req.request_id)
    out = d.remote_ready(req.request_id, first.new_token_ids[0], None)
    tokens = list(out.new_token_ids)
    while d.has_work():
        for o in d.step():
            tokens += o.new_token_ids
    assert p.pool.num_free == p.pool.num_blocks and d.pool.num_free == d.pool.num_blocks
    return tokens, len(blocks) - cached


def local(d: Engine, req: Request) -> list[int]:
    d.add_request(req)
    tokens: list[int] = []
    while d.has_work():
        for o in d.step():
            tokens += o.new_token_ids
    return tokens


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded-penalized"])
def test_a_resumed_request_goes_on_with_the_same_tokens(tiny_model_dir, params):
    p, d = engines(tiny_model_dir)
    full, _ = disaggregated(p, d, Request("r", list(PROMPT), params))
    assert len(full) == params.max_tokens
    for k in (1, 6, 13, 19):          # 6, 19: the resumed tokens end inside a block
        p2, d2 = engines(tiny_model_dir)    # workers that never saw the request
        rest, copied = disaggregated(p2, d2, Request(f"m{k}", list(PROMPT), params, full[:k]))
        assert rest == full[k:], k
        assert copied == -(-(len(PROMPT) + k) // 4)
        # the same decode engine again: the prompt and resumed tokens it had cached stay
        again, copied = disaggregated(p2, d2, Request(f"n{k}", list(PROMPT), params, full[:k]))
        assert again == full[k:] and copied == (1 if (len(PROMPT) + k) % 4 else 0)
        assert local(d2, Request(f"l{k}", list(PROMPT), params, full[:k])) == full[k:]


def test_resume_is_refused_for_n_gt_1_and_without_tokens_left(tiny_model_dir):
    with pytest.raises(ValueError, match="n > 1"):
        Request("r", list(PROMPT), replace(SAMPLED, n=2), [4, 5])
    with pytest.raises(ValueError, match="max_tokens"):
        Request("r", list(PROMPT), replace(GREEDY, max_tokens=2), [4, 5])
    p, _ = engines(tiny_model_dir)
    p.check_fits(Request("r", list(PROMPT), GREEDY, [4] * 19))       # prefill: 31 tokens fit
    with pytest.raises(ValueError, match="max_model_len"):
        p.check_fits(Request("r", [1] * (p.cfg.max_model_len - 3), GREEDY, [4] * 3))


def test_a_grammar_is_advanced_through_the_resumed_tokens(model_dir):
    """The default model under a regex: resumed mid-way, it goes on as it would have (the
    worker's Grammars.attach advances the matcher); tokens the grammar refuses are an error."""
    from engine.config import EngineConfig
    from gateway.tokenizer import Tokenizer
    from serving.worker import Grammars

    eng = Engine(model_dir, EngineConfig(role="decode", num_blocks=64, block_size=16,
                                         max_num_batched_tokens=128, max_num_seqs=4))
    grammars = Grammars(eng)
    params = SamplingParams(temperature=0, max_tokens=12,
                            structured=StructuredSpec("regex", r"20[0-9]{2}-(0[1-9]|1[0-2])"))
    prompt = [1, 504, 3458, 314, 253, 1300, 30]

    def run(rid: str, resume: list[int]) -> list[int]:
        req = Request(rid, list(prompt), params, list(resume))
        asyncio.run(grammars.attach(req))
        return local(eng, req)

    full = run("full", [])
    assert len(full) >= 4
    for k in (1, 3):
        assert run(f"r{k}", full[:k]) == full[k:]
    letter = Tokenizer(model_dir).encode("x")
    with pytest.raises(ValueError, match="does not continue"):
        run("bad", letter)
