"""Compiled grammars and per-sequence matchers, on xgrammar.

GrammarCompiler: one per worker (one tokenizer, one logits width). compile(spec) turns a
StructuredSpec into a CompiledGrammar (LRU-cached by spec; concurrent compiles of one spec run
once). CompiledGrammar.matcher() gives a GrammarMatcher: the state of one sequence, which fills
its row of a token bitmask and accepts / rolls back tokens. Matchers are not thread-safe (one
sequence, one thread); the compiler is.

xgrammar is imported when the first compiler is built, so `engine.structured`'s bitmask
helpers cost nothing to import.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import Iterable

import torch

from engine.structured.bitmask import bitmask_words
from engine.structured.spec import (GrammarError, StructuredSpec, choice_ebnf, choice_options,
                                    clean_reason, regex_newlines_escaped,
                                    schema_newlines_escaped)

# JSON output format for json_object / json_schema: the whitespace the model chooses between
# elements (newlines and indentation as it learned to write JSON), at most
# MAX_JSON_WHITESPACE characters in a row: xgrammar's unbounded any_whitespace lets a small
# model at temperature 0 fall into a run of spaces or newlines it never leaves, and the cap
# ends that. A spec marked compact (the request's structured_outputs.disable_any_whitespace)
# gets one line with json.dumps' separators (", " and ": ") and no other whitespace. Inside
# strings the model may write what it likes either way.
MAX_JSON_WHITESPACE = 16
_JSON_FORMAT = dict(any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
_COMPACT_JSON = dict(any_whitespace=False)
# xgrammar's strict mode: properties / items the schema does not name are not generated (as if
# unevaluatedProperties / unevaluatedItems were false). The output is still valid against the
# schema; it keeps a model from inventing fields. Applies whether the request said strict or not.
_STRICT = True
_ANY_OBJECT = '{"type": "object"}'


class CompiledGrammar:
    """An immutable compiled grammar, shareable by any number of matchers and threads."""

    def __init__(self, spec: StructuredSpec, compiled, stop_token_ids: tuple[int, ...],
                 vocab_size: int):
        self.spec = spec
        self._compiled = compiled
        self._stop = stop_token_ids
        self._vocab_size = vocab_size
        words = [0] * bitmask_words(vocab_size)
        for t in stop_token_ids:
            words[t // 32] |= 1 << (t % 32)
        # the mask row of a terminated matcher: only the stop tokens (as signed int32 words)
        self._stop_row = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                                      dtype=torch.int32)

    @property
    def memory_bytes(self) -> int:
        return int(self._compiled.memory_size_bytes)

    def matcher(self) -> "GrammarMatcher":
        import xgrammar as xgr
        m = xgr.GrammarMatcher(self._compiled, override_stop_tokens=list(self._stop) or None)
        return GrammarMatcher(self, m, 0)


class GrammarMatcher:
    """The grammar state of one sequence.

    EOS ids are allowed once the output may end (`completed`), beside whatever continuation
    the grammar still allows; when it must end they are the only tokens allowed. Accepting one
    terminates the matcher. A request cut by max_tokens simply ends ("length") with the prefix
    generated so far (for JSON: not parseable); nothing here needs to know.
    """

    def __init__(self, grammar: CompiledGrammar, m, accepted: int):
        self._g = grammar
        self._m = m
        self._n = accepted       # tokens accepted and not rolled back: the rollback bound

    @property
    def grammar(self) -> CompiledGrammar:
        return self._g

    @property
    def num_accepted(self) -> int:
        return self._n

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (int32 [R, words] CPU tensor,
        words = bitmask_words(vocab_size)). Tokens beyond the tokenizer (up to the logits
        width) are never allowed. A terminated matcher allows only the EOS ids."""
        if self._m.is_terminated():
            bitmask[row].copy_(self._g._stop_row)
            return
        self._m.fill_next_token_bitmask(bitmask, row)

    def fill_draft_masks(self, tokens: list[int], bitmask: torch.Tensor, row: int) -> None:
        """For speculative verification: rows row .. row + len(tokens) get the masks after
        each prefix tokens[:i] (i = 0 .. len(tokens)), i.e. the mask for each verified position
        and the bonus one. Every token must be accepted in order (truncate with valid_prefix
        first); the state is left unchanged."""
        done = 0
        try:
            for i, t in enumerate(tokens):
                self.fill_mask(bitmask, row + i)
                if not self.accept(t):
                    raise ValueError(f"draft token {t} at position {i} is not allowed by the "
                                     "grammar (truncate with valid_prefix first)")
                done += 1
            self.fill_mask(bitmask, row + len(tokens))
        finally:
            self.rollback(done)

    def allows_only_end(self, bitmask: torch.Tensor, row: int) -> bool:
        """bitmask[row] (as fill_mask wrote it) allows nothing but the EOS ids: the output must
        end here."""
        return torch.equal(bitmask[row], self._g._stop_row)

    def accept(self, token: int) -> bool:
        """Advance by one token. False (state unchanged) when the grammar forbids it, when the
        matcher has terminated, or for an id outside the vocabulary."""
        if not 0 <= token < self._g._vocab_size:
            return False
        if self._m.accept_token(int(token)):
            self._n += 1
            return True
        return False

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (an accepted EOS included)."""
        if n < 0 or n > self._n:
            raise ValueError(f"cannot roll back {n} tokens: {self._n} accepted")
        if n:
            self._m.rollback(n)
            self._n -= n

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens the grammar accepts in order (state unchanged)."""
        k = 0
        for t in tokens:
            if not self.accept(t):
                break
            k += 1
        self.rollback(k)
        return k

    @property
    def terminated(self) -> bool:
        """An EOS id was accepted after a complete output."""
        return bool(self._m.is_terminated())

    @property
    def completed(self) -> bool:
        """The tokens so far are a complete output (EOS allowed now); true once terminated."""
        return bool(self._m.is_terminated() or self._m.is_completed())

    def fork(self) -> "GrammarMatcher":
        """An independent copy in the same state (rollback history included)."""
        return GrammarMatcher(self._g, self._m.fork(), self._n)


class GrammarCompiler:
    """Thread-safe; compiled grammars cached by spec (LRU, max_cached entries).

    model_dir: an HF-format folder (its tokenizer is loaded with transformers). vocab_size: the
    logits width (config.json's vocab_size), which may exceed the tokenizer's size; those extra
    ids are always masked off. eos_token_ids: the stop tokens allowed once an output is
    complete. threads: xgrammar's compile threads and the threads of fill_masks.
    """

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Iterable[int],
                 max_cached: int = 256, threads: int = 1):
        import xgrammar as xgr
        from transformers import AutoTokenizer

        if max_cached < 0:
            raise ValueError(f"max_cached must be >= 0, got {max_cached}")
        self._vocab_size = int(vocab_size)
        self._eos = tuple(int(t) for t in eos_token_ids)
        bad = [t for t in self._eos if not 0 <= t < self._vocab_size]
        if bad:
            raise ValueError(f"EOS ids {bad} outside the vocabulary [0, {self._vocab_size})")
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self._info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self._vocab_size, stop_token_ids=list(self._eos) or None)
        if not self._eos:
            self._eos = tuple(int(t) for t in self._info.stop_token_ids)
        self._xgr = xgr.GrammarCompiler(self._info, max_threads=max(1, threads),
                                        cache_enabled=False)
        self._threads = max(1, threads)
        self._batch = None
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredSpec, CompiledGrammar] = OrderedDict()
        self._pending: dict[StructuredSpec, Future] = {}
        self.hits = 0
        self.misses = 0           # compiles started (failed ones included)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def cache_info(self) -> dict:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "size": len(self._cache),
                    "max_cached": self._max_cached}

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """The spec's grammar; raises GrammarError when it cannot be compiled (not cached)."""
        if not isinstance(spec, StructuredSpec):
            raise TypeError(f"expected a StructuredSpec, got {type(spec).__name__}")
        with self._lock:
            g = self._cache.get(spec)
            if g is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return g
            fut = self._pending.get(spec)
            owner = fut is None
            if owner:
                fut = self._pending[spec] = Future()
                self.misses += 1
            else:
                self.hits += 1
        if not owner:
            return fut.result()
        try:
            g = CompiledGrammar(spec, self._compile(spec), self._eos, self._vocab_size)
        except BaseException as e:
            with self._lock:
                del self._pending[spec]
            fut.set_exception(e)
            raise
        with self._lock:
            del self._pending[spec]
            if self._max_cached:
                self._cache[spec] = g
                while len(self._cache) > self._max_cached:
                    self._cache.popitem(last=False)
        fut.set_result(g)
        return g

    def _compile(self, spec: StructuredSpec):
        kind, value = spec.kind, spec.value
        if kind == "choice":
            value = choice_ebnf(choice_options(value))       # GrammarError on a bad list
        elif kind == "json_schema":
            try:
                schema = json.loads(value)
            except json.JSONDecodeError as e:
                raise GrammarError(kind, f"schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(kind, "schema must be a JSON object (or a boolean)")
            escaped = schema_newlines_escaped(schema)
            if escaped is not schema:
                value = json.dumps(escaped)
        elif kind == "regex":
            value = regex_newlines_escaped(value)
        try:
            fmt = _COMPACT_JSON if spec.compact else _JSON_FORMAT
            if kind == "json_object":
                return self._xgr.compile_json_schema(_ANY_OBJECT, strict_mode=False, **fmt)
            if kind == "json_schema":
                return self._xgr.compile_json_schema(value, strict_mode=_STRICT, **fmt)
            if kind == "regex":
                return self._xgr.compile_regex(value)
            return self._xgr.compile_grammar(value)          # grammar, choice
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(kind, clean_reason(e)) from None

    def fill_masks(self, items: list[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """fill_mask for many sequences at once: items (matcher, row); xgrammar's batch filler
        on `threads` threads (the GIL released), terminated matchers as in fill_mask."""
        live = []
        for m, row in items:
            if m._m.is_terminated():
                bitmask[row].copy_(m._g._stop_row)
            else:
                live.append((m, row))
        if not live:
            return
        if len(live) == 1 or self._threads == 1:
            for m, row in live:
                m._m.fill_next_token_bitmask(bitmask, row)
            return
        with self._lock:
            if self._batch is None:
                import xgrammar as xgr
                self._batch = xgr.BatchGrammarMatcher(self._threads)
        self._batch.batch_fill_next_token_bitmask([m._m for m, _ in live], bitmask,
                                                  [row for _, row in live])
