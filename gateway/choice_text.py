"""The text of a request's choices, kept for the whole request: per choice an incremental
detokenizer, its stop strings and its token count (`ChoiceText`), and which choices have
finished (`Choices`). It outlives any one worker: a stream moved to another decode worker feeds
the same state, so the client sees one stream.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gateway.params import PreparedRequest
from gateway.tokenizer import Tokenizer
from proto import pdserve_pb2

DETOKENIZER_CONTEXT = 4  # prompt tokens that seed the detokenizer (leading-space rules)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]   # (token id, logprob), most likely first
    rank: int | None = None              # token_id's rank (prompt logprobs)


def gateway_logprobs(lps) -> tuple[TokenLogprob, ...]:
    """Wire TokenLogprobs as the gateway keeps them."""
    return tuple(TokenLogprob(lp.token_id, lp.logprob,
                              tuple((t.token_id, t.logprob) for t in lp.top), lp.rank or None)
                 for lp in lps)


@dataclass(frozen=True)
class Delta:
    """What one step of one choice of a request adds. `token_ids` are the new tokens (EOS
    included, its text only with include_stop_str_in_output); `logprobs` has one entry per token
    when asked for; `finish_reason` is None until the choice's last Delta ("stop" or "length");
    `completion_tokens` counts the choice's tokens so far."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None
    completion_tokens: int          # of this choice
    index: int = 0                  # the choice (n > 1)
    cached_tokens: int | None = None   # on the request's last Delta: prompt tokens found cached
    # on each choice's first Delta when the prompt's logprobs were computed: one per prompt
    # token after the first
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


class StopStrings:
    """Cuts generated text at the first stop string; holds back a tail that may start one.

    `feed(text)` returns (text safe to emit, stopped). Once stopped, the emitted text ends just
    before the stop string. `flush()` returns the held-back tail at the natural end.
    """

    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        self._stops = stops
        self._include = include          # the stop string itself is emitted too
        self._pending = ""

    def _held_tail(self) -> int:
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def feed(self, text: str) -> tuple[str, bool]:
        self._pending += text
        if not self._stops:
            out, self._pending = self._pending, ""
            return out, False
        hits = [(i, len(s)) for i, s in ((self._pending.find(s), s) for s in self._stops)
                if i >= 0]
        if hits:
            at, length = min(hits)
            out = self._pending[:at + length] if self._include else self._pending[:at]
            self._pending = ""
            return out, True
        keep = self._held_tail()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


class ChoiceText:
    """One choice's text state: incremental detokenizer + stop strings + token count."""

    def __init__(self, tokenizer: Tokenizer, prepared: PreparedRequest, index: int = 0) -> None:
        p = prepared.params
        self._stop_ids = frozenset(p.stop_token_ids) | (
            frozenset() if p.ignore_eos else tokenizer.eos_token_ids)
        self._keep_stop = p.include_stop_str_in_output
        context = prepared.prompt_token_ids[-DETOKENIZER_CONTEXT:]
        self._detok = tokenizer.detokenizer(context, p.skip_special_tokens)
        self._stops = StopStrings(p.stop, p.include_stop_str_in_output)
        self._min_tokens = p.min_tokens
        self._count = 0
        self.index = index
        self.token_ids: list[int] = []     # consumed so far: what a moved stream resumes from

    def consume(self, batch: pdserve_pb2.TokenBatch) -> Delta:
        ids = tuple(batch.token_ids)
        self.token_ids += ids
        self._count += len(ids)
        finish = batch.finish_reason or None
        text_ids = ids
        if finish == "stop" and ids and ids[-1] in self._stop_ids and not self._keep_stop:
            text_ids = ids[:-1]
        text = self._detok.add(text_ids)
        if finish:
            text += self._detok.flush()
        if self._count < self._min_tokens and not finish:
            stopped = False         # stop strings apply once min_tokens are out
            text = self._stops.flush() + text
        else:
            text, stopped = self._stops.feed(text)
        if stopped:
            finish = "stop"
        elif finish:
            text += self._stops.flush()
        return Delta(ids, text, gateway_logprobs(batch.logprobs), finish, self._count,
                     self.index)


class Choices:
    """The text state of a request's choices and which have finished, kept across the workers
    that serve it (a moved stream feeds the same detokenizers and stop strings)."""

    def __init__(self, tokenizer: Tokenizer, prepared: PreparedRequest) -> None:
        self.n = prepared.params.n
        self.states = [ChoiceText(tokenizer, prepared, i) for i in range(self.n)]
        self.done: set[int] = set()
        self.cached_tokens = 0          # of the prompt, on the worker that computed it
        # the prompt's logprobs, once the worker that computed the prompt sent them
        self.prompt_logprobs: tuple[TokenLogprob, ...] | None = None
        self._given_prompt_logprobs: set[int] = set()

    def first_of_choice(self, delta: Delta) -> Delta:
        """`delta` with the prompt's logprobs on when it is its choice's first to have them."""
        if self.prompt_logprobs is None or delta.index in self._given_prompt_logprobs:
            return delta
        self._given_prompt_logprobs.add(delta.index)
        return replace(delta, prompt_logprobs=self.prompt_logprobs)

    @property
    def started(self) -> bool:
        """Tokens went out: the request can no longer simply run again."""
        return any(s.token_ids for s in self.states)

    def resume_token_ids(self) -> tuple[int, ...]:
        """What a moved stream goes on after (n = 1: requests of n > 1 are not moved)."""
        return tuple(self.states[0].token_ids) if self.n == 1 else ()
