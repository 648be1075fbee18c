"""grammarbench: structured-output engines on the default model's vocabulary.

For each engine (xgrammar through engine.structured, which is what the workers use;
llguidance; outlines-core) and each case (a nested JSON schema with objects, enums and arrays,
and the same without its maxLength bounds; an email regex; a date regex; a 5-way choice):

  compile   a fresh compile of the case (no cache), median over --repeat
  first     the first token mask after compiling (llguidance builds its lexer lazily, so its
            real start-up cost is compile + first)
  fill      filling one sequence's bitmask row, mean over the steps of a walk
  accept    advancing the state by one token, mean over the same steps

A walk generates a fixed valid output token by token (the HF tokenizer's tokens of a compact
JSON / an email / a date / one choice, then EOS): at each step the mask is filled, the next
token's bit is checked, then the token is accepted. It runs --repeat times on fresh matchers.

JSON format: compact one-line JSON with ", " and ": " separators in every engine (xgrammar
any_whitespace=False, llguidance whitespace_flexible=false with those separators, outlines a
whitespace pattern of "[ ]?"), so the same target text is valid in all of them. Outlines does
not advance on EOS (its caller stops); its EOS step only checks the mask. outlines-core 0.2.14
drops the transitions from an accepting state into a non-accepting one (`a(bc)?` cannot go
past "a"), so its email walk fails at "engine" + "." ; that case reports its compile only.
Outlines also ignores integer minimum / maximum (not in these schemas).

llguidance and outlines-core are not dependencies of pdserve: install them to measure them
(`pip install llguidance outlines-core`); a missing engine is reported and skipped.

    pdserve grammarbench [--model DIR] [--engines xgrammar,llguidance,outlines]
                         [--repeat 5] [--out grammar.json]
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.paths import default_model_dir
from pdserve.flags import DefaultsFormatter

if TYPE_CHECKING:
    import torch

ENGINES = ("xgrammar", "llguidance", "outlines")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "[0-9]{5}"},
            },
            "required": ["street", "city", "zip"],
        },
        "scores": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"subject": {"enum": ["math", "art", "music"]},
                               "value": {"type": "number"}},
                "required": ["subject", "value"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "address", "scores", "active"],
}
SCHEMA_TARGET = json.dumps({
    "name": "Ada Lovelace", "age": 36, "role": "editor", "tags": ["math", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10115"},
    "scores": [{"subject": "math", "value": 9.5}, {"subject": "music", "value": 7}],
    "active": True,
})

def _without(schema, key: str):
    """schema with every `key` constraint removed (xgrammar expands bounded repetition such
    as maxLength at compile time: the case with and without shows what that costs)."""
    if isinstance(schema, dict):
        return {k: _without(v, key) for k, v in schema.items() if k != key}
    if isinstance(schema, list):
        return [_without(v, key) for v in schema]
    return schema


EMAIL = r"[a-z0-9._%+-]{1,32}@[a-z0-9-]{1,32}(\.[a-z0-9-]{1,32})*\.[a-z]{2,6}"
DATE = r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = ["strongly agree", "agree", "neutral", "disagree", "strongly disagree"]

# case: (kind, spec value, the output walked)
CASES = {
    "json_schema": ("json_schema", json.dumps(SCHEMA), SCHEMA_TARGET),
    "json_nomaxlen": ("json_schema", json.dumps(_without(SCHEMA, "maxLength")), SCHEMA_TARGET),
    "regex_email": ("regex", EMAIL, "ada.lovelace+notes@analytical-engine.co.uk"),
    "regex_date": ("regex", DATE, "2024-02-29"),
    "choice": ("choice", json.dumps(CHOICES), "strongly disagree"),
}


def _bit(bitmask: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def _regex_alternation(options: list[str]) -> str:
    return "(" + "|".join("".join("\\" + c if c in r"\.+*?()|[]{}^$#&-~" else c for c in o)
                          for o in options) + ")"


class _XGrammar:
    """xgrammar through engine.structured (cache off: every compile is a real one)."""

    name = "xgrammar"

    def __init__(self, model_dir, tokenizer, vocab_size, eos):
        from engine.structured import GrammarCompiler

        self.compiler = GrammarCompiler(model_dir, vocab_size, eos, max_cached=0)

    def compile(self, kind, value):
        from engine.structured import StructuredSpec

        return self.compiler.compile(StructuredSpec(kind, value))

    def matcher(self, compiled):
        return compiled.matcher()

    def fill(self, m, bitmask):
        m.fill_mask(bitmask, 0)

    def accept(self, m, token, eos):
        return m.accept(token)


class _LLGuidance:
    name = "llguidance"

    def __init__(self, model_dir, tokenizer, vocab_size, eos):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                eos_token=list(eos))

    def compile(self, kind, value):
        M = self.llg.LLMatcher
        if kind == "json_schema":
            grammar = M.grammar_from_json_schema(value, defaults={
                "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        elif kind == "regex":
            grammar = M.grammar_from_regex(value)
        else:
            grammar = M.grammar_from_lark("start: " + " | ".join(
                json.dumps(c) for c in json.loads(value)))
        m = M(self.tok, grammar)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return grammar, m

    def matcher(self, compiled):
        # a new matcher per sequence, as for a new request: its lazily built lexer states are
        # part of the per-token cost (a deep copy would reuse the compiled one's)
        grammar, _ = compiled
        return self.llg.LLMatcher(self.tok, grammar)

    def fill(self, m, bitmask):
        self.lt.fill_next_token_bitmask(m, bitmask, 0)

    def accept(self, m, token, eos):
        return m.consume_token(token) and not m.is_error()


class _Outlines:
    name = "outlines"

    def __init__(self, model_dir, tokenizer, vocab_size, eos):
        import outlines_core

        self.oc = outlines_core
        self.eos = eos[0]
        special = set(tokenizer.all_special_ids)
        table = {ch: b for b, ch in _byte_level_chars().items()}
        tokens: dict[bytes, list[int]] = {}
        for text, i in tokenizer.get_vocab().items():
            if i in special or i >= vocab_size:
                continue
            try:
                raw = bytes(table[c] for c in text)
            except KeyError:                        # not a byte-level token: keep its UTF-8
                raw = text.encode()
            tokens.setdefault(raw, []).append(i)
        self.vocab = outlines_core.Vocabulary(self.eos, tokens)

    def compile(self, kind, value):
        from outlines_core.json_schema import build_regex_from_schema

        if kind == "json_schema":
            regex = build_regex_from_schema(value, r"[ ]?")
        elif kind == "regex":
            regex = value
        else:
            regex = _regex_alternation(json.loads(value))
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, m, bitmask):
        m.write_mask_into(bitmask.data_ptr(), bitmask.shape[1], 4)

    def accept(self, m, token, eos):
        if token in eos:                            # the caller stops on EOS; no state after it
            return m.is_finished()
        m.advance(token, return_tokens=False)
        return True


def _byte_level_chars() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes stand for
    themselves, the others (controls, space, ...) map in order to chr(256), chr(257), ..."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


_ADAPTERS = {"xgrammar": _XGrammar, "llguidance": _LLGuidance, "outlines": _Outlines}


def _walk(engine, compiled, tokens, eos, words) -> dict:
    import torch

    bitmask = torch.full((1, words), -1, dtype=torch.int32)
    m = engine.matcher(compiled)
    fill_ns, accept_ns, bad = [], [], 0
    for t in tokens:
        a = time.perf_counter_ns()
        engine.fill(m, bitmask)
        b = time.perf_counter_ns()
        bad += not _bit(bitmask, t)
        ok = engine.accept(m, t, eos)
        c = time.perf_counter_ns()
        bad += not ok
        fill_ns.append(b - a)
        accept_ns.append(c - b)
    return {"fill_ns": fill_ns, "accept_ns": accept_ns, "rejected": bad}


def bench_engine(name, model_dir, tokenizer, vocab_size, eos, repeat) -> dict:
    import torch

    words = (vocab_size + 31) // 32
    t0 = time.perf_counter()
    try:
        engine = _ADAPTERS[name](model_dir, tokenizer, vocab_size, eos)
    except ImportError as e:
        return {"error": f"not installed ({e.name or e}); pip install it to measure"}
    out = {"setup_ms": (time.perf_counter() - t0) * 1e3, "cases": {}}
    for case, (kind, value, text) in CASES.items():
        tokens = tokenizer.encode(text, add_special_tokens=False) + [eos[0]]
        compile_s, first_s = [], []
        try:
            for _ in range(repeat):
                a = time.perf_counter()
                compiled = engine.compile(kind, value)
                b = time.perf_counter()
                m = engine.matcher(compiled)
                bm = torch.full((1, words), -1, dtype=torch.int32)
                c = time.perf_counter()
                engine.fill(m, bm)
                first_s.append(time.perf_counter() - c)
                compile_s.append(b - a)
        except Exception as e:                      # an engine that cannot do this case
            out["cases"][case] = {"error": f"compile: {type(e).__name__}: {e}"[:300]}
            continue
        r = out["cases"][case] = {
            "compile_ms": statistics.median(compile_s) * 1e3,
            "compile_ms_all": [s * 1e3 for s in compile_s],
            "first_mask_us": statistics.median(first_s) * 1e6,
            "tokens": len(tokens),
        }
        try:
            walks = [_walk(engine, compiled, tokens, eos, words) for _ in range(repeat)]
        except Exception as e:                      # the engine rejected the valid output
            r["error"] = f"walk: {type(e).__name__}: {e}"[:300]
            continue
        fill = [x for w in walks for x in w["fill_ns"]]
        acc = [x for w in walks for x in w["accept_ns"]]
        r.update({
            "fill_us": statistics.fmean(fill) / 1e3,
            "fill_p50_us": statistics.median(fill) / 1e3,
            "fill_max_us": max(fill) / 1e3,
            "accept_us": statistics.fmean(acc) / 1e3,
            "rejected": sum(w["rejected"] for w in walks),
        })
    return out


def bench_apply(vocab_size, repeat) -> dict:
    """engine.structured.apply_bitmask (pure torch) on CPU logits, for a sense of its cost."""
    import torch

    from engine.structured import apply_bitmask

    out = {}
    for rows in (1, 32):
        logits = torch.randn(rows, vocab_size)
        bm = torch.randint(-(1 << 31), 1 << 31, (rows, (vocab_size + 31) // 32),
                           dtype=torch.int32)
        apply_bitmask(logits, bm)
        n = max(20, repeat * 20)
        t = time.perf_counter()
        for _ in range(n):
            apply_bitmask(logits, bm)
        out[f"rows_{rows}_us"] = (time.perf_counter() - t) / n * 1e6
    return out


def run(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from cluster.paths import resolve_model
    from engine.config import ModelConfig

    model_dir = resolve_model(args.model)
    cfg = ModelConfig.from_dir(model_dir)
    eos = list(cfg.eos_token_ids)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    torch.set_num_threads(1)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINES:
            raise SystemExit(f"unknown engine {e!r}; choose from {', '.join(ENGINES)}")
    result = {"model": Path(model_dir).name, "vocab_size": cfg.vocab_size,
              "tokenizer_size": len(tokenizer), "eos_token_ids": eos, "repeat": args.repeat,
              "engines": {}}
    for e in engines:
        result["engines"][e] = bench_engine(e, model_dir, tokenizer, cfg.vocab_size, eos,
                                            args.repeat)
    result["apply_bitmask_cpu"] = bench_apply(cfg.vocab_size, args.repeat)
    _print(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _print(result: dict) -> None:
    print(f"model {result['model']}: vocab {result['vocab_size']} (tokenizer "
          f"{result['tokenizer_size']}), repeat {result['repeat']}")
    print(f"{'engine':<11} {'case':<14} {'compile ms':>10} {'first us':>9} {'fill us':>8} "
          f"{'fill max':>9} {'accept us':>9} {'tokens':>6} {'bad':>4}")
    for name, r in result["engines"].items():
        if "error" in r:
            print(f"{name:<11} {r['error']}")
            continue
        for case, c in r["cases"].items():
            if "compile_ms" not in c:
                print(f"{name:<11} {case:<14} {c['error']}")
                continue
            head = f"{name:<11} {case:<14} {c['compile_ms']:>10.2f} {c['first_mask_us']:>9.1f} "
            if "error" in c:
                print(head + c["error"])
                continue
            print(head + f"{c['fill_us']:>8.1f} {c['fill_max_us']:>9.1f} {c['accept_us']:>9.1f} "
                  f"{c['tokens']:>6} {c['rejected']:>4}")
        print(f"{name:<11} {'(setup)':<14} {r['setup_ms']:>10.1f}  tokenizer/vocabulary build")
    a = result["apply_bitmask_cpu"]
    print("apply_bitmask (torch, CPU): " + ", ".join(
        f"{k.replace('_us', '').replace('_', ' ')}: {v:.0f} us" for k, v in a.items()))


def register(sub) -> None:
    p = sub.add_parser(
        "grammarbench", help="structured-output engines on the model's vocabulary",
        formatter_class=DefaultsFormatter,
        description="Compile time and per-token mask / accept cost of xgrammar (what the "
                    "workers use), llguidance and outlines-core (when installed) on a nested "
                    "JSON schema, regexes and a choice, with the model's tokenizer.")
    p.add_argument("--model", default=None,
                   help=f"model folder (default: {default_model_dir()})")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma list")
    p.add_argument("--repeat", type=int, default=5, help="compiles and walks per case")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    p.set_defaults(target="pdserve.bench.grammarbench:main")


def main(args) -> int:
    run(args)
    return 0

