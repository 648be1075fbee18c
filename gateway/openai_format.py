"""OpenAI response shapes built from pipeline Deltas: streaming chunks, full responses, usage and
both logprob formats (completions: tokens / token_logprobs / top_logprobs / text_offset; chat:
content: [{token, logprob, bytes, top_logprobs}]).

One formatter answers one HTTP request, which may hold several prompts (a list of prompts on
/v1/completions) of n choices each: choice `index` = prompt number x n + the Delta's index, as
OpenAI and vLLM number them. `usage` counts every prompt once and every choice's tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

from gateway.choice_text import Delta, TokenLogprob
from gateway.params import PreparedRequest
from gateway.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # JSON has no -inf


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


@dataclass
class _Choice:
    """What the formatter keeps per choice."""

    index: int
    echo: str = ""                  # prompt text still to put in front (completions' echo)
    offset: int = 0                 # completions' text_offset so far
    used: int = 0                   # completion tokens
    finish: str | None = None
    text: list[str] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    tools: object | None = None     # the tool-call output of a chat choice (gateway.tools)
    prompt: int = 0                 # the prompt it belongs to
    token_ids: list[int] = field(default_factory=list)
    sent_prompt_ids: bool = False   # streaming with return_token_ids: its first chunk went out
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None   # of its prompt, once they came
    echo_logprobs: bool = False     # completions' echo with logprobs: the prompt's go first


class ToolOutput:
    """A chat choice's output read for tool calls (gateway.tools): streamed as content and call
    deltas, or parsed whole into the message; decides finish_reason ("tool_calls")."""

    def __init__(self, plan) -> None:
        self.plan = plan
        self.parser = plan.output_parser()
        self.streamer = None
        self.num_calls = 0

    def feed(self, text: str, final: bool) -> list[dict]:
        if self.streamer is None:
            self.streamer = self.parser.streamer()
        pieces = self.streamer.feed(text) if text else []
        if final:
            pieces += self.streamer.finish()
        self.num_calls = len(self.streamer.tool_calls)
        return pieces

    def message(self, text: str) -> dict:
        parsed = self.parser.parse(text)
        self.num_calls = len(parsed.tool_calls)
        return parsed.to_message()

    def finish_reason(self, finish: str | None) -> str | None:
        return self.plan.finish_reason(finish, self.num_calls)


class OpenAIFormatter:
    """Builds one HTTP request's response objects. Feed it every Delta, in order per choice,
    with the number of the prompt it belongs to."""

    def __init__(self, prepared: PreparedRequest | Sequence[PreparedRequest],
                 tokenizer: Tokenizer, include_usage: bool = False,
                 echo: Sequence[str] = (), tool_output=None, token_ids: bool = False,
                 continuous_usage: bool = False) -> None:
        """`echo`: per prompt, the text put in front of each of its choices (completions'
        echo); `tool_output`: a factory of a choice's tool-call handling (chat with tools);
        `token_ids`: vLLM's return_token_ids (the prompt's ids and each choice's, streamed as
        they come); `continuous_usage`: every chunk carries its choice's usage so far."""
        self.requests = [prepared] if isinstance(prepared, PreparedRequest) else list(prepared)
        self.prepared = self.requests[0]
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        self.token_ids = token_ids
        self.continuous_usage = continuous_usage
        self._cached: dict[int, int] = {}       # prompt -> its tokens found cached
        self._echo_text = list(echo)
        self.chat = self.prepared.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + self.prepared.public_id
        self.created = int(time.time())
        self.n = self.prepared.params.n
        self._choices: dict[int, _Choice] = {}
        for r in range(len(self.requests)):
            for j in range(self.n):
                i = r * self.n + j
                self._choices[i] = _Choice(
                    i, echo[r] if echo else "", tools=tool_output() if tool_output else None,
                    prompt=r, echo_logprobs=bool(echo) and not self.chat
                    and self.prepared.params.logprobs)

    # ------------------------------------------------------------------ pieces
    def usage(self) -> dict:
        """The request's usage; prompt_tokens_details.cached_tokens: its prompts' tokens the
        workers found cached (prefix cache or offload tiers), as the final responses said."""
        prompt = sum(r.num_prompt_tokens for r in self.requests)
        done = sum(c.used for c in self._choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": done,
                "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": sum(self._cached.values())}}

    def _choice_usage(self, choice: _Choice) -> dict:
        """A chunk's usage with continuous_usage_stats: its prompt's and its choice's so far."""
        prompt = self.requests[choice.prompt].num_prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": choice.used,
                "total_tokens": prompt + choice.used}

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created,
                "model": self.prepared.model, "choices": choices}

    def _chat_logprob(self, lp: TokenLogprob) -> dict:
        tok = self.tokenizer
        top_n = self.prepared.params.top_logprobs
        return {"token": tok.token_text(lp.token_id), "logprob": _finite(lp.logprob),
                "bytes": tok.token_bytes(lp.token_id),
                "top_logprobs": [{"token": tok.token_text(t), "logprob": _finite(v),
                                  "bytes": tok.token_bytes(t)} for t, v in lp.top[:top_n]]}

    def _completion_logprobs(self, choice: _Choice, delta: Delta) -> dict:
        tok = self.tokenizer
        top_n = self.prepared.params.top_logprobs
        tokens, offsets, tops, values = [], [], [], []
        if choice.echo_logprobs and choice.prompt_logprobs is not None:
            # echo: the prompt's tokens first, the first without a logprob (nothing precedes
            # it), offsets from the start of the echoed text
            choice.echo_logprobs = False
            first = self.requests[choice.prompt].prompt_token_ids[0]
            tokens.append(tok.token_text(first))
            offsets.append(0)
            values.append(None)
            tops.append(None)
            start = len(tokens[0])
            for lp in choice.prompt_logprobs:
                text = tok.token_text(lp.token_id)
                tokens.append(text)
                offsets.append(start)
                start += len(text)
                values.append(_finite(lp.logprob))
                tops.append(self._top(lp, text, top_n))
            choice.offset = len(self._echoed(choice))
        start, end = choice.offset, choice.offset + len(delta.text)
        for lp in delta.logprobs:
            text = tok.token_text(lp.token_id)
            tokens.append(text)
            offsets.append(min(start, end))
            start += len(text)
            values.append(_finite(lp.logprob))
            tops.append(self._top(lp, text, top_n))
        choice.offset += len(delta.text)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def _top(self, lp: TokenLogprob, text: str, top_n: int) -> dict:
        top = {self.tokenizer.token_text(t): _finite(v) for t, v in lp.top[:top_n]}
        top.setdefault(text, _finite(lp.logprob))
        return top

    def _echoed(self, choice: _Choice) -> str:
        return self._echo_text[choice.prompt] if self._echo_text else ""

    def _prompt_logprobs(self, choice: _Choice) -> list | None:
        """vLLM's prompt_logprobs: None for the first prompt token, then per token a dict of
        token id -> {logprob, rank, decoded_token}: the prompt's own token, then the top
        alternatives (None when not asked for)."""
        k = self.prepared.params.prompt_logprobs
        if k is None or choice.prompt_logprobs is None:
            return None
        tok = self.tokenizer
        out: list = [None]
        for lp in choice.prompt_logprobs:
            entry = {str(lp.token_id): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                        "decoded_token": tok.token_text(lp.token_id)}}
            for rank, (t, v) in enumerate(lp.top[:k], start=1):
                entry.setdefault(str(t), {"logprob": _finite(v), "rank": rank,
                                          "decoded_token": tok.token_text(t)})
            out.append(entry)
        return out

    def _logprobs(self, choice: _Choice, delta: Delta) -> dict | None:
        if not self.prepared.params.logprobs:
            return None
        if self.chat:
            return {"content": [self._chat_logprob(lp) for lp in delta.logprobs]}
        return self._completion_logprobs(choice, delta)

    def _take(self, delta: Delta, prompt: int) -> tuple[_Choice, str]:
        """The choice of a Delta, updated; the Delta's text with any echo in front."""
        choice = self._choices[prompt * self.n + delta.index]
        choice.used = delta.completion_tokens
        choice.token_ids += delta.token_ids
        if delta.cached_tokens is not None:
            self._cached[prompt] = delta.cached_tokens
        if delta.prompt_logprobs is not None:
            choice.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason:
            choice.finish = delta.finish_reason
        text, choice.echo = choice.echo + delta.text, ""
        return choice, text

    # ------------------------------------------------------------------ streaming
    def _chunk(self, choice: dict, of: _Choice | None = None) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = self._envelope(obj, [choice])
        if self.include_usage:
            out["usage"] = (self._choice_usage(of) if self.continuous_usage and of is not None
                            else None)
        return out

    def _prompt_ids(self, choice: _Choice) -> list[int]:
        return list(self.requests[choice.prompt].prompt_token_ids)

    def role_chunks(self) -> list[dict]:
        """Chat's first chunks: the assistant role with empty content, one per choice (with
        return_token_ids each carries the prompt's ids)."""
        out = []
        for i, c in self._choices.items():
            chunk = self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}, c)
            if self.token_ids:
                chunk["prompt_token_ids"] = self._prompt_ids(c)
                c.sent_prompt_ids = True
            out.append(chunk)
        return out

    def role_chunk(self) -> dict:
        return self.role_chunks()[0]

    def delta_chunks(self, delta: Delta, prompt: int = 0) -> list[dict]:
        """The chunks for one Delta (none when it adds neither text nor logprobs nor a finish)."""
        choice, text = self._take(delta, prompt)
        has_logprobs = self.prepared.params.logprobs and delta.logprobs
        ids = self.token_ids and bool(delta.token_ids)     # every token id reaches the client
        if not (text or has_logprobs or delta.finish_reason or ids):
            return []
        logprobs = self._logprobs(choice, delta) if has_logprobs or text else None
        if not self.chat:
            body = {"index": choice.index, "text": text, "logprobs": logprobs,
                    "finish_reason": delta.finish_reason}
            if self.token_ids:
                body["token_ids"] = list(delta.token_ids)
                if not choice.sent_prompt_ids:
                    body["prompt_token_ids"] = self._prompt_ids(choice)
                    choice.sent_prompt_ids = True
            return [self._chunk(body, choice)]
        bodies = []
        pieces = (([{"content": text}] if text else []) if choice.tools is None
                  else choice.tools.feed(text, final=bool(delta.finish_reason)))
        for k, piece in enumerate(pieces or ([{"content": ""}] if has_logprobs or ids else [])):
            body = {"index": choice.index, "delta": piece,
                    "logprobs": logprobs if k == 0 else None, "finish_reason": None}
            if self.token_ids:
                body["token_ids"] = list(delta.token_ids) if k == 0 else []
            bodies.append(body)
        if delta.finish_reason:
            # as vLLM: the finish rides on the chunk of the last text; an empty delta
            # carries it only when the last step added nothing to show
            if not bodies:
                bodies.append({"index": choice.index, "delta": {}, "logprobs": None})
                if self.token_ids:
                    bodies[-1]["token_ids"] = list(delta.token_ids)
            bodies[-1]["finish_reason"] = self._finish(choice)
        return [self._chunk(body, choice) for body in bodies]

    def finished(self) -> bool:
        """Every choice of every prompt has ended."""
        return all(c.finish for c in self._choices.values())

    def _finish(self, choice: _Choice) -> str | None:
        if choice.tools is not None:
            return choice.tools.finish_reason(choice.finish)
        return choice.finish

    def usage_chunk(self, completion_tokens: int | None = None) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = self._envelope(obj, [])
        out["usage"] = self.usage()
        if completion_tokens is not None and len(self._choices) == 1:
            out["usage"]["completion_tokens"] = completion_tokens
            out["usage"]["total_tokens"] = out["usage"]["prompt_tokens"] + completion_tokens
        return out

    # ------------------------------------------------------------------ full response
    def response(self, deltas: Sequence[Delta | tuple[int, Delta]]) -> dict:
        """The non-streaming response for all Deltas of the request (Deltas, or (prompt
        number, Delta) pairs for several prompts)."""
        for item in deltas:
            prompt, delta = item if isinstance(item, tuple) else (0, item)
            choice, text = self._take(delta, prompt)
            choice.text.append(text)
            if self.prepared.params.logprobs:
                choice.logprobs.append(self._logprobs(choice, delta))
        choices = []
        for choice in self._choices.values():
            text = "".join(choice.text) + choice.echo
            logprobs = self._merged_logprobs(choice)
            if self.chat:
                message = {"role": "assistant", "content": text}
                if choice.tools is not None:
                    message = choice.tools.message(text)
                body = {"index": choice.index, "message": message,
                        "logprobs": logprobs, "finish_reason": self._finish(choice)}
            else:
                body = {"index": choice.index, "text": text, "logprobs": logprobs,
                        "finish_reason": choice.finish,
                        "prompt_logprobs": self._prompt_logprobs(choice)}
                if self.token_ids:
                    body["prompt_token_ids"] = self._prompt_ids(choice)
            if self.token_ids:
                body["token_ids"] = list(choice.token_ids)
            choices.append(body)
        out = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        if self.chat:
            out["prompt_logprobs"] = self._prompt_logprobs(self._choices[0])
        if self.token_ids and self.chat:
            out["prompt_token_ids"] = list(self.prepared.prompt_token_ids)
        out["usage"] = self.usage()
        return out

    def _merged_logprobs(self, choice: _Choice) -> dict | None:
        if not self.prepared.params.logprobs:
            return None
        merged: dict = {}
        for part in choice.logprobs:
            for key, values in part.items():
                merged.setdefault(key, []).extend(values)
        if not merged:
            return {"content": []} if self.chat else {
                "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        return merged
