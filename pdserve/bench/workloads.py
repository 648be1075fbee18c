"""Benchmark prompts of exact token lengths, and arrival times.

A prompt is random token ids drawn from the middle of the vocabulary (never an added/special
token), decoded to text and re-encoded; ids are corrected (truncated or topped up) until the text
encodes back to exactly the wanted count. Sending the text therefore costs every server the same
number of prompt tokens, as long as it tokenizes with this tokenizer and adds no BOS of its own.

Everything is seeded: the same seed gives the same prompts and arrivals on every server.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

MAX_ATTEMPTS = 50   # fresh random draws before giving up on one prompt
FIX_ROUNDS = 8      # decode/re-encode corrections per draw


@dataclass(frozen=True)
class Prompt:
    """One request to send. `kind` groups requests in the report (e.g. "short" and "long")."""

    kind: str
    text: str
    token_ids: tuple[int, ...]
    output_len: int

    @property
    def input_len(self) -> int:
        return len(self.token_ids)


class PromptMaker:
    """Builds exact-length prompts from a model folder's tokenizer.json (no transformers)."""

    def __init__(self, tokenizer_dir: str | Path, seed: int) -> None:
        folder = Path(tokenizer_dir)
        if not (folder / "tokenizer.json").is_file():
            raise SystemExit(f"no tokenizer.json in {folder}: pass --tokenizer MODEL_DIR")
        self.tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        vocab = self.tok.get_vocab_size(with_added_tokens=True)
        config = folder / "config.json"
        if config.is_file():  # the model may have fewer real rows than the tokenizer has ids
            vocab = min(vocab, json.loads(config.read_text()).get("vocab_size", vocab))
        special = set(self.tok.get_added_tokens_decoder())
        self.pool = [i for i in range(vocab // 8, vocab - vocab // 8) if i not in special]
        self.rng = random.Random(seed)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def random_ids(self, n: int) -> list[int]:
        return [self.rng.choice(self.pool) for _ in range(n)]

    def extend(self, prefix: str, n: int,
               avoid_first: set[int] = frozenset()) -> tuple[str, list[int]]:
        """Text T such that encode(prefix + T) == encode(prefix) + exactly n more ids, the first
        of which is not in `avoid_first`. Returns (T, encode(prefix + T))."""
        base = self.encode(prefix) if prefix else []
        for _ in range(MAX_ATTEMPTS):
            ids = self.random_ids(n)
            for _ in range(FIX_ROUNDS):
                text = self.decode(ids)
                full = self.encode(prefix + text)
                if full[:len(base)] != base:
                    break  # the new text merged with the prefix's last token: draw again
                got = full[len(base):]
                if len(got) == n:
                    if n and got[0] in avoid_first:
                        break
                    return text, full
                ids = got[:n] if len(got) > n else got + self.random_ids(n - len(got))
        raise RuntimeError(f"could not build a prompt of exactly {n} tokens")

    def prompt(self, kind: str, input_len: int, output_len: int) -> Prompt:
        text, ids = self.extend("", input_len)
        return Prompt(kind, text, tuple(ids), output_len)


def random_prompts(maker: PromptMaker, n: int, input_len: int, output_len: int,
                   kind: str = "random") -> list[Prompt]:
    return [maker.prompt(kind, input_len, output_len) for _ in range(n)]


def code_edit_prompts(maker: PromptMaker, n: int, output_len: int) -> list[Prompt]:
    """Chat prompts asking for an edited copy of a code snippet (pdserve.bench.code_edit):
    answers that repeat the prompt. Lengths are whatever the texts encode to."""
    from pdserve.bench.code_edit import code_edit_texts

    return [Prompt("code-edit", text, tuple(maker.encode(text)), output_len)
            for text in code_edit_texts(n)]


def shared_prefix_prompts(maker: PromptMaker, num_groups: int, users_per_group: int,
                          prefix_len: int, question_len: int, output_len: int) -> list[Prompt]:
    """num_groups x users_per_group prompts, shuffled. Prompts of one group share exactly their
    first prefix_len tokens: their questions all start with different tokens."""
    out = []
    for _ in range(num_groups):
        prefix, _ = maker.extend("", prefix_len)
        firsts: set[int] = set()
        for _ in range(users_per_group):
            question, ids = maker.extend(prefix, question_len, avoid_first=firsts)
            if question_len:
                firsts.add(ids[prefix_len])
            out.append(Prompt("shared-prefix", prefix + question, tuple(ids), output_len))
    maker.rng.shuffle(out)
    return out


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start for n requests arriving as a Poisson process of
    `rate` requests/s (exponential gaps; the first request also waits one gap). An infinite rate
    sends everything at 0."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out
