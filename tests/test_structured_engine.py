"""Structured outputs inside the engine's batched steps, with the real default model: every
output parses and validates (a JSON schema with nested objects, enums and arrays; a regex; a
choice), greedy and sampled, with n-gram speculation on and off, next to free-text requests in
the same batch; n > 1 choices each follow the grammar."""

from __future__ import annotations

import functools
import json
import re

import pytest

from engine.engine import Engine
from engine.request import Request, SamplingParams
from engine.structured import GrammarCompiler, StructuredSpec
from tests.conftest import make_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "pet": {"type": "string", "enum": ["cat", "dog", "fish"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                 "required": ["city"]},
    },
    "required": ["name", "age", "pet", "tags", "home"],
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
CHOICES = ["positive", "negative", "neutral"]


def valid(value, schema) -> bool:
    """The schema features used here, checked by hand."""
    kind = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return False
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", ()))
                and all(k in props and valid(v, props[k]) for k, v in value.items()))
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", 1 << 30)
                and all(valid(v, schema["items"]) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    return True


@pytest.fixture(scope="module")
def compiler(model_dir):
    from engine.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    return GrammarCompiler(model_dir, cfg.vocab_size, cfg.eos_token_ids)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from gateway.tokenizer import Tokenizer
    return Tokenizer(model_dir)


# the real model's prompts and outputs: blocks of 16 tokens, room for 2048 per sequence
engine = functools.partial(make_engine, num_blocks=256, block_size=16,
                           max_num_batched_tokens=256, max_num_seqs=16,
                           num_speculative_tokens=4, max_model_len=2048)


def _run(eng: Engine, reqs: list[Request]) -> dict[tuple[str, int], list[int]]:
    for r in reqs:
        eng.add_request(r)
    got: dict[tuple[str, int], list[int]] = {}
    while eng.has_work():
        for o in eng.step():
            got.setdefault((o.stream_id, o.choice), []).extend(o.new_token_ids)
    return got


def _request(rid, tokenizer, compiler, question, spec, **params):
    ids = tokenizer.encode_chat([{"role": "user", "content": question}])
    p = SamplingParams(max_tokens=params.pop("max_tokens", 96), structured=spec, **params)
    req = Request(rid, ids, p)
    if spec is not None:
        req.structured_state = compiler.compile(spec).matcher()
    return req


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_outputs_parse_and_validate_in_one_batch(model_dir, compiler, tokenizer, speculative):
    schema = StructuredSpec("json_schema", json.dumps(SCHEMA))
    cases = [
        ("json-greedy", "Describe a person as JSON.", schema, dict(temperature=0)),
        ("json-sampled", "Describe a person as JSON.", schema,
         dict(temperature=1.0, top_p=0.95, seed=4)),
        ("date", "When is the next leap day?", StructuredSpec("regex", DATE),
         dict(temperature=0.8, seed=1)),
        ("choice", "Is 'I love it' positive?", StructuredSpec("choice", json.dumps(CHOICES)),
         dict(temperature=0)),
        ("free", "Say hello.", None, dict(temperature=0, max_tokens=12)),
    ]
    eng = engine(model_dir, speculative=speculative)
    reqs = [_request(rid, tokenizer, compiler, q, spec, **p) for rid, q, spec, p in cases]
    got = _run(eng, reqs)
    eos = set(eng.model_cfg.eos_token_ids)
    texts = {rid: tokenizer.decode([t for t in got[(rid, 0)] if t not in eos])
             for rid, *_ in cases}
    for rid in ("json-greedy", "json-sampled"):
        assert valid(json.loads(texts[rid]), SCHEMA), texts[rid]
    assert re.fullmatch(DATE, texts["date"]), texts["date"]
    assert texts["choice"] in CHOICES
    assert got[("free", 0)], "the free-text request ran beside them"
    assert eng.pool.num_free == eng.pool.num_blocks          # cached blocks count as free


def test_choices_each_follow_the_grammar(model_dir, compiler, tokenizer):
    # compact: at temperature 1 the model's own layout can outlast max_tokens
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA), compact=True)
    req = _request("n", tokenizer, compiler, "Describe a person as JSON.", spec,
                   temperature=1.0, seed=8, n=3)
    eng = engine(model_dir)
    got = _run(eng, [req])
    eos = set(eng.model_cfg.eos_token_ids)
    outs = [tokenizer.decode([t for t in got[("n", c)] if t not in eos]) for c in range(3)]
    for text in outs:
        assert valid(json.loads(text), SCHEMA), text
    assert len(set(outs)) > 1


def test_min_tokens_holds_the_end_back_unless_the_grammar_must_end(model_dir, compiler,
                                                                   tokenizer):
    """A regex that may end anywhere ([a-z ]+): EOS is held back until min_tokens are out.
    A JSON object: once it closes only EOS is allowed, and min_tokens yields to the grammar."""
    words = StructuredSpec("regex", "[a-z ]+")
    free = _request("free", tokenizer, compiler, "Say hi.", words, temperature=0, max_tokens=40)
    held = _request("held", tokenizer, compiler, "Say hi.", words, temperature=0, max_tokens=40,
                    min_tokens=24)
    obj = StructuredSpec("json_object")
    small = _request("obj", tokenizer, compiler, "Return {\"ok\": true} as JSON.", obj,
                     temperature=0, max_tokens=60, min_tokens=50)
    eng = engine(model_dir)
    got = _run(eng, [free, held, small])
    assert len(got[("free", 0)]) < 24, "the test needs an output that ends on its own early"
    assert len(got[("held", 0)]) >= 24
    eos = set(eng.model_cfg.eos_token_ids)
    text = tokenizer.decode([t for t in got[("obj", 0)] if t not in eos])
    assert json.loads(text) == {"ok": True} and len(got[("obj", 0)]) < 50


def test_a_token_the_grammar_refuses_ends_the_request_with_an_error(model_dir, compiler,
                                                                   tokenizer):
    """A first token from elsewhere (a prefill worker) that the decode worker's grammar does
    not allow: the request fails loudly and frees its blocks."""
    eng = engine(model_dir, role="decode")
    req = _request("bad", tokenizer, compiler, "Pick.",
                   StructuredSpec("choice", json.dumps(CHOICES)), temperature=0)
    assert eng.reserve_remote(req) is not None
    not_allowed = tokenizer.encode(" zebra", add_special_tokens=False)[0]
    out = eng.remote_ready("bad", not_allowed, None)
    assert out.finish_reason == "error" and "not allowed by" in out.error
    assert eng.pool.num_free == eng.pool.num_blocks          # cached blocks count as free
    assert not eng.has_work()
