"""engine.structured: grammar compilation, matcher semantics and bitmasks, on the real default
model's tokenizer (skipped when the model has not been fetched).

The walks drive a matcher with random allowed tokens (seeded; uniform over the mask, EOS as
soon as it is allowed) and check the text is what the spec asked for."""

from __future__ import annotations

import json
import random
import re
import threading

import numpy as np
import pytest
import torch

from engine.structured import (KINDS, GrammarCompiler, GrammarError, StructuredSpec,
                               apply_bitmask, bitmask_words, new_bitmask)

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "name": {"type": "string", "maxLength": 6},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 5},
                           "ok": {"type": "boolean"}},
            "required": ["level", "ok"],
        },
        "points": {
            "type": "array",
            "items": {"type": "object",
                      "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                     "label": {"enum": ["p", "q"]}},
                      "required": ["x", "label"]},
            "minItems": 1,
            "maxItems": 2,
        },
        "note": {"type": "string", "maxLength": 3},
    },
    "required": ["id", "kind", "name", "score", "tags", "owner", "points"],
}
REGEXES = [r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
           r"[a-z]{1,6}@[a-z]{1,6}\.(com|org|net)"]
CHOICES = ["red", "green", "blue", "light blue", 'say "hi"\n']


def validate(value, schema, path="$") -> None:
    """The schema features used here (xgrammar's strict mode: no properties beyond those
    named)."""
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
        return
    t = schema["type"]
    if t == "object":
        assert isinstance(value, dict), path
        props = schema.get("properties", {})
        assert set(value) <= set(props), f"{path}: unexpected keys {set(value) - set(props)}"
        for k in schema.get("required", []):
            assert k in value, f"{path}: missing {k}"
        for k, v in value.items():
            validate(v, props[k], f"{path}.{k}")
    elif t == "array":
        assert isinstance(value, list), path
        assert schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30), path
        for i, v in enumerate(value):
            validate(v, schema["items"], f"{path}[{i}]")
    elif t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), path
        assert schema.get("minimum", -1 << 60) <= value <= schema.get("maximum", 1 << 60), path
    elif t == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), path
    elif t == "string":
        assert isinstance(value, str), path
        assert len(value) <= schema.get("maxLength", 1 << 30), f"{path}: {value!r} too long"
    elif t == "boolean":
        assert isinstance(value, bool), path
    else:
        raise AssertionError(f"validator does not know type {t}")


def assert_compact(text: str) -> None:
    """One line, json.dumps' separators, no other whitespace (strings aside)."""
    skeleton = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    assert not re.search(r"[\t\n\r]|  ", skeleton), text
    assert all(skeleton[i - 1] in ",:" for i, ch in enumerate(skeleton) if ch == " "), text
    assert ", " in skeleton and ": " in skeleton, text


def allowed_array(bitmask: torch.Tensor, row: int, vocab: int) -> np.ndarray:
    """The allowed token ids of a row (numpy: single-threaded, cheap on a busy machine)."""
    bits = np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:vocab])


def allowed(bitmask: torch.Tensor, row: int, vocab: int) -> list[int]:
    return allowed_array(bitmask, row, vocab).tolist()


@pytest.fixture(scope="module")
def setup(model_dir):
    from tokenizers import Tokenizer

    from engine.config import ModelConfig

    cfg = ModelConfig.from_dir(model_dir)
    compiler = GrammarCompiler(model_dir, cfg.vocab_size, cfg.eos_token_ids)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return compiler, tok, cfg


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def walk(compiler, tok, eos, spec, seed, max_steps=400) -> str:
    """Random allowed tokens until EOS; the text (EOS excluded)."""
    rng = random.Random(seed)
    m = compiler.compile(spec).matcher()
    bm = new_bitmask(1, compiler.vocab_size)
    out = []
    for _ in range(max_steps):
        m.fill_mask(bm, 0)
        stop = [t for t in eos if (int(bm[0, t // 32]) >> (t % 32)) & 1]
        if stop:
            t = stop[0]
        else:
            ids = allowed_array(bm, 0, compiler.vocab_size)
            assert ids.size, f"empty mask after {tok.decode(out)!r}"
            t = int(ids[rng.randrange(ids.size)])
        assert m.accept(t)
        if t in eos:
            assert m.terminated
            return tok.decode(out, skip_special_tokens=False)
        out.append(t)
    raise AssertionError(f"no EOS after {max_steps} tokens: {tok.decode(out)!r}")


# --- specs and compilation ------------------------------------------------------------------

def test_spec_validation():
    from gateway.params import STRUCTURED_KINDS

    # the kinds a client may ask the gateway for are those the engine builds, each of them
    assert KINDS == STRUCTURED_KINDS
    values = {"json_object": "", "json_schema": json.dumps(SCHEMA), "regex": "a+",
              "choice": '["a", "b"]', "grammar": 'root ::= "a"'}
    assert [StructuredSpec(k, values[k]).kind for k in STRUCTURED_KINDS] == list(KINDS)
    with pytest.raises(ValueError, match="json_object, json_schema, regex, choice, grammar"):
        StructuredSpec("xml", "<a/>")
    with pytest.raises(ValueError, match="takes no value"):
        StructuredSpec("json_object", "{}")
    with pytest.raises(ValueError, match="must be a string"):
        StructuredSpec("regex", 3)
    assert StructuredSpec("regex", "a+") == StructuredSpec("regex", "a+")


def test_compile_each_kind(setup):
    compiler, tok, cfg = setup
    specs = {
        "json_object": StructuredSpec("json_object"),
        "json_schema": StructuredSpec("json_schema", json.dumps(SCHEMA)),
        "regex": StructuredSpec("regex", REGEXES[0]),
        "choice": StructuredSpec("choice", json.dumps(CHOICES)),
        "grammar": StructuredSpec("grammar", 'root ::= "x" [0-9]+ ("," [0-9]+)*'),
    }
    assert set(specs) == set(KINDS)
    bm = new_bitmask(2, compiler.vocab_size)
    assert bm.shape == (2, bitmask_words(cfg.vocab_size)) and bm.dtype == torch.int32
    for kind, spec in specs.items():
        m = compiler.compile(spec).matcher()
        m.fill_mask(bm, 1)
        ids = allowed(bm, 1, compiler.vocab_size)
        assert ids and not set(ids) & set(cfg.eos_token_ids), kind   # nothing complete yet
        assert not m.terminated and m.num_accepted == 0


def test_json_object_compact(setup):
    compiler, tok, cfg = setup
    g = compiler.compile(StructuredSpec("json_object", compact=True))
    text = json.dumps({"a": [1, {"b": None}], "c": "x y", "d": {"e": True}})
    m = g.matcher()
    assert m.valid_prefix(encode(tok, text) + list(cfg.eos_token_ids[:1])) == \
        len(encode(tok, text)) + 1
    for bad in ("[1]", "{ ", '{"a":1}', '{"a": 1}\n'):    # not an object; not compact JSON
        ids = encode(tok, bad)
        assert g.matcher().valid_prefix(ids) < len(ids), bad


def test_json_whitespace_is_the_models_but_bounded(setup):
    """By default the model may lay JSON out as it learned to (newlines, indentation), up to
    MAX_JSON_WHITESPACE characters of whitespace in a row: a run of them cannot go on."""
    from engine.structured.grammar import MAX_JSON_WHITESPACE

    compiler, tok, cfg = setup
    for spec in (StructuredSpec("json_object"), StructuredSpec("json_schema", json.dumps({
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "array",
                                             "items": {"type": "string"}}},
            "required": ["a", "b"]}))):
        g = compiler.compile(spec)
        pretty = json.dumps({"a": 1, "b": ["x", "y"]}, indent=2)
        ids = encode(tok, pretty) + list(cfg.eos_token_ids[:1])
        assert g.matcher().valid_prefix(ids) == len(ids), spec.kind
        compact = json.dumps({"a": 1, "b": ["x", "y"]})
        assert g.matcher().valid_prefix(encode(tok, compact)) == len(encode(tok, compact))
        endless = "{" + " " * (MAX_JSON_WHITESPACE + 1)
        ids = encode(tok, endless)
        assert g.matcher().valid_prefix(ids) < len(ids), spec.kind
        ok = "{" + "\n" + " " * (MAX_JSON_WHITESPACE - 1)
        assert g.matcher().valid_prefix(encode(tok, ok)) == len(encode(tok, ok))


def test_json_schema_walk(setup):
    compiler, tok, cfg = setup
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA), compact=True)
    for seed in range(8):
        text = walk(compiler, tok, cfg.eos_token_ids, spec, seed)
        value = json.loads(text)
        validate(value, SCHEMA)
        assert_compact(text)


def test_regex_walk(setup):
    compiler, tok, cfg = setup
    for rx in REGEXES:
        spec = StructuredSpec("regex", rx)
        for seed in range(8):
            text = walk(compiler, tok, cfg.eos_token_ids, spec, seed)
            assert re.fullmatch(rx, text), (rx, text)


def test_choice_walk(setup):
    compiler, tok, cfg = setup
    spec = StructuredSpec("choice", json.dumps(CHOICES))
    seen = set()
    for seed in range(12):
        text = walk(compiler, tok, cfg.eos_token_ids, spec, seed)
        assert text in CHOICES
        seen.add(text)
    assert len(seen) >= 2


def test_raw_newlines_in_regexes(setup):
    """A raw LF inside a character class (JSON "\n" decodes to one) works like the escape."""
    compiler, tok, cfg = setup
    eos = cfg.eos_token_ids[0]
    rx = "<[^\n>]{1,4}>"
    schema = {"type": "object", "properties": {"t": {"type": "string", "pattern": rx}},
              "required": ["t"]}
    for spec, good, bad in [
            (StructuredSpec("regex", rx + "\n"), "<ab>\n", "<a\nb>\n"),
            (StructuredSpec("json_schema", json.dumps(schema)), '{"t": "<ab>"}',
             '{"t": "<abcde>"}')]:
        g = compiler.compile(spec)
        ids = encode(tok, good) + [eos]
        assert g.matcher().valid_prefix(ids) == len(ids), good
        ids = encode(tok, bad)
        assert g.matcher().valid_prefix(ids) < len(ids), bad


def test_grammar_errors(setup):
    compiler, tok, cfg = setup
    cases = [
        (StructuredSpec("json_schema", '{"type": "foo"}'), "json_schema", "Unsupported type"),
        (StructuredSpec("json_schema", '{"type": '), "json_schema", "not valid JSON"),
        (StructuredSpec("json_schema", '[1, 2]'), "json_schema", "JSON object"),
        (StructuredSpec("json_schema", '{"type": "string", "pattern": "(a"}'), "json_schema",
         "parenthesis"),
        (StructuredSpec("regex", "(abc"), "regex", "parenthesis is not closed"),
        (StructuredSpec("regex", "a{3,1}"), "regex", "3 > 1"),
        (StructuredSpec("grammar", "root ::= foo"), "grammar", 'Rule "foo" is not defined'),
        (StructuredSpec("grammar", 'root ::= "a" |'), "grammar", "EBNF parser error"),
        (StructuredSpec("choice", "[]"), "choice", "non-empty"),
        (StructuredSpec("choice", '["a", 1]'), "choice", "string"),
        (StructuredSpec("choice", "red"), "choice", "JSON list"),
    ]
    before = compiler.cache_info()["size"]
    for spec, kind, reason in cases:
        with pytest.raises(GrammarError) as e:
            compiler.compile(spec)
        assert isinstance(e.value, ValueError) and e.value.kind == kind
        msg = str(e.value)
        assert msg.startswith(f"invalid {kind}: ") and reason in msg, msg
        assert ".cc:" not in msg and "Check failed" not in msg, msg
    assert compiler.cache_info()["size"] == before           # failures are not cached


def test_cache(setup):
    compiler, tok, cfg = setup
    spec = StructuredSpec("regex", r"cache-[0-9]{2}")
    info = compiler.cache_info()
    g = compiler.compile(spec)
    assert compiler.compile(StructuredSpec("regex", r"cache-[0-9]{2}")) is g
    after = compiler.cache_info()
    assert after["misses"] == info["misses"] + 1 and after["hits"] == info["hits"] + 1

    # concurrent first compiles of one spec: compiled once, one object for everyone
    spec = StructuredSpec("regex", r"concurrent-[a-z]{3,9}")
    results, barrier = [], threading.Barrier(4)

    def go():
        barrier.wait()
        results.append(compiler.compile(spec))

    threads = [threading.Thread(target=go) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and all(r is results[0] for r in results)
    assert compiler.cache_info()["misses"] == after["misses"] + 1


# --- matcher semantics ----------------------------------------------------------------------

def mask_of(m, vocab) -> torch.Tensor:
    bm = new_bitmask(1, vocab)
    m.fill_mask(bm, 0)
    return bm[0].clone()


def test_accept_rollback_terminate(setup):
    compiler, tok, cfg = setup
    eos = cfg.eos_token_ids[0]
    v = compiler.vocab_size
    m = compiler.compile(StructuredSpec("choice", json.dumps(CHOICES))).matcher()
    start = mask_of(m, v)
    assert not m.accept(encode(tok, "purple")[0])           # forbidden: False, no change
    assert not m.accept(eos) and not m.accept(-1) and not m.accept(v)
    assert torch.equal(mask_of(m, v), start) and m.num_accepted == 0

    ids = encode(tok, "light blue")
    assert len(ids) >= 2
    masks = [start]
    for t in ids:
        assert m.accept(t)
        masks.append(mask_of(m, v))
    assert allowed(masks[-1].unsqueeze(0), 0, v) == [eos]    # complete: only EOS
    assert m.completed and not m.terminated
    m.rollback(len(ids) - 1)
    assert torch.equal(mask_of(m, v), masks[1]) and m.num_accepted == 1
    with pytest.raises(ValueError):
        m.rollback(2)
    for t in ids[1:]:
        assert m.accept(t)
    assert m.accept(eos) and m.terminated
    assert not m.accept(eos) and not m.accept(ids[0])       # nothing after the end
    assert allowed(mask_of(m, v).unsqueeze(0), 0, v) == [eos]   # a terminated row: EOS only
    m.rollback(1)                                            # EOS can be undone
    assert not m.terminated and torch.equal(mask_of(m, v), masks[-1])


def test_prefix_of_another_choice_allows_both(setup):
    compiler, tok, cfg = setup
    eos = cfg.eos_token_ids[0]
    m = compiler.compile(StructuredSpec("choice", '["agree", "agree strongly"]')).matcher()
    for t in encode(tok, "agree"):
        assert m.accept(t)
    ids = allowed(mask_of(m, compiler.vocab_size).unsqueeze(0), 0, compiler.vocab_size)
    assert eos in ids and len(ids) > 1 and m.completed


def test_valid_prefix(setup):
    compiler, tok, cfg = setup
    eos = cfg.eos_token_ids[0]
    v = compiler.vocab_size
    m = compiler.compile(StructuredSpec("regex", REGEXES[0])).matcher()
    good = encode(tok, "2024-12")
    for t in good[:2]:
        assert m.accept(t)
    before = mask_of(m, v)
    rest = good[2:]
    assert m.valid_prefix(rest + encode(tok, "-31") + [eos]) == len(rest) + 4
    assert m.valid_prefix(rest + encode(tok, "x1")) == len(rest)
    assert m.valid_prefix(encode(tok, "x")) == 0 and m.valid_prefix([]) == 0
    assert m.valid_prefix(rest + encode(tok, "-31") + [eos, eos]) == len(rest) + 4
    assert m.num_accepted == 2 and torch.equal(mask_of(m, v), before) and not m.terminated


def test_fill_draft_masks(setup):
    compiler, tok, cfg = setup
    v = compiler.vocab_size
    m = compiler.compile(StructuredSpec("json_schema", json.dumps(SCHEMA))).matcher()
    draft = encode(tok, '{"id": 12, "kind": "beta"')
    bm = new_bitmask(len(draft) + 3, v)
    m.fill_draft_masks(draft, bm, 2)
    assert m.num_accepted == 0
    ref = m.fork()
    for i, t in enumerate(draft):
        assert torch.equal(bm[2 + i], mask_of(ref, v))
        assert ref.accept(t)
    assert torch.equal(bm[2 + len(draft)], mask_of(ref, v))
    assert torch.equal(bm[:2], new_bitmask(2, v))            # other rows untouched
    start = bm[2].clone()
    with pytest.raises(ValueError, match="valid_prefix"):
        m.fill_draft_masks(draft[:2] + encode(tok, "x"), bm, 0)
    assert m.num_accepted == 0 and torch.equal(mask_of(m, v), start)


def test_fork(setup):
    compiler, tok, cfg = setup
    v = compiler.vocab_size
    m = compiler.compile(StructuredSpec("choice", json.dumps(CHOICES))).matcher()
    light = encode(tok, "light blue")
    assert m.accept(light[0])
    f = m.fork()
    assert f.num_accepted == 1 and torch.equal(mask_of(f, v), mask_of(m, v))
    for t in light[1:]:
        assert f.accept(t)
    assert f.accept(cfg.eos_token_ids[0]) and f.terminated
    assert not m.terminated and m.num_accepted == 1           # the original did not move
    f.rollback(len(light) + 1)                                # the fork has the whole history
    g = compiler.compile(StructuredSpec("choice", json.dumps(CHOICES))).matcher()
    assert torch.equal(mask_of(f, v), mask_of(g, v))
    m.rollback(1)
    assert torch.equal(mask_of(m, v), mask_of(g, v))


def test_padded_vocab_and_batch_fill(model_dir, setup):
    """Logits wider than the tokenizer: ids beyond it are never allowed. fill_masks (batched,
    2 threads) equals one fill_mask per matcher. The LRU drops the oldest spec."""
    _, tok, cfg = setup
    pad = cfg.vocab_size + 64
    c = GrammarCompiler(model_dir, pad, cfg.eos_token_ids, max_cached=2, threads=2)
    assert c.vocab_size == pad and c.eos_token_ids == cfg.eos_token_ids
    specs = [StructuredSpec("json_object"), StructuredSpec("regex", "[^\n]*"),
             StructuredSpec("choice", json.dumps(CHOICES))]
    matchers = [c.compile(s).matcher() for s in specs]
    assert c.cache_info()["size"] == 2
    assert c.compile(specs[0]) is not matchers[0].grammar     # evicted: compiled again
    assert c.compile(specs[2]) is matchers[2].grammar
    done = c.compile(specs[2]).matcher()
    for t in encode(tok, "red") + [cfg.eos_token_ids[0]]:
        assert done.accept(t)
    matchers.append(done)
    assert matchers[0].accept(encode(tok, "{")[0])
    bm = new_bitmask(6, pad)
    c.fill_masks([(m, r + 1) for r, m in enumerate(matchers)], bm)
    for r, m in enumerate(matchers):
        one = mask_of(m, pad)
        assert torch.equal(bm[r + 1], one)
        assert not ((one.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
                    ).reshape(-1)[cfg.vocab_size:].any()
    assert len(allowed(bm, 2, pad)) > 40000                   # the regex allows most tokens
    assert torch.equal(bm[0], new_bitmask(1, pad)[0]) and torch.equal(bm[5], bm[0])


# --- bitmasks -------------------------------------------------------------------------------

def test_bitmask_shapes():
    assert [bitmask_words(n) for n in (1, 31, 32, 33, 49152)] == [1, 1, 1, 2, 1536]
    b = new_bitmask(3, 70)
    assert b.shape == (3, 3) and b.dtype == torch.int32 and bool((b == -1).all())
    with pytest.raises(ValueError):
        bitmask_words(0)


def _devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_bitmask_matches_reference(device, dtype):
    g = torch.Generator().manual_seed(0)
    rows, vocab = 5, 70
    logits = torch.randn(rows, vocab, generator=g).to(dtype)
    bm = torch.randint(-(1 << 31), 1 << 31, (rows, bitmask_words(vocab)), generator=g,
                       dtype=torch.int64).to(torch.int32)
    bm[1] = -1                                   # every token allowed: row unchanged
    bm[3] = 0                                    # nothing allowed
    bm[4, 0] = -(1 << 31)                        # only token 31 in the first word
    ref = logits.clone()
    for r in range(rows):
        for j in range(vocab):
            if not (int(bm[r, j // 32]) >> (j % 32)) & 1:
                ref[r, j] = float("-inf")
    out = logits.to(device)
    apply_bitmask(out, bm.to(device))
    assert torch.equal(out.cpu(), ref)
    assert torch.equal(out.cpu()[1], logits[1])
    assert not torch.isinf(out.cpu()[4, 31]) and torch.isinf(out.cpu()[4, :31]).all()

    wide = torch.randn(rows, 100, generator=g).to(dtype).to(device)   # a view: [:, :vocab]
    keep = wide[:, vocab:].clone()
    apply_bitmask(wide[:, :vocab], bm.to(device))
    assert torch.equal(wide[:, vocab:], keep)
    assert torch.equal(torch.isinf(wide[:, :vocab]).cpu(), torch.isinf(ref))


def test_apply_bitmask_errors():
    logits = torch.zeros(2, 70)
    with pytest.raises(ValueError):
        apply_bitmask(logits, new_bitmask(2, 40))             # too few words
    with pytest.raises(ValueError):
        apply_bitmask(logits, new_bitmask(3, 70))             # rows differ
    with pytest.raises(ValueError):
        apply_bitmask(logits, new_bitmask(2, 70).to(torch.int64))
    apply_bitmask(logits, new_bitmask(2, 200))                # extra words are ignored
    assert not torch.isinf(logits).any()


def test_grammarbench_smoke(model_dir, tmp_path):
    """The bench runs (xgrammar only, once) and writes its JSON; the walks stay valid."""
    import argparse

    from pdserve.bench import grammarbench

    out = tmp_path / "grammar.json"
    args = argparse.Namespace(model=str(model_dir), engines="xgrammar", repeat=1, out=str(out))
    assert grammarbench.main(args) == 0
    result = json.loads(out.read_text())
    cases = result["engines"]["xgrammar"]["cases"]
    assert set(cases) == set(grammarbench.CASES)
    for name, c in cases.items():
        assert "error" not in c and c["rejected"] == 0 and c["compile_ms"] > 0, name
    assert result["apply_bitmask_cpu"]["rows_1_us"] > 0
