"""OpenAI response shapes built from pipeline Deltas: streaming chunks, full responses, usage and
both logprob formats (completions: tokens / token_logprobs / top_logprobs / text_offset; chat:
content: [{token, logprob, bytes, top_logprobs}])."""

from __future__ import annotations

import math
import time

from gateway.params import PreparedRequest
from gateway.pipeline import Delta, TokenLogprob
from gateway.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # JSON has no -inf


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


class OpenAIFormatter:
    """Builds one request's response objects. Keeps the running text offset for completions'
    `text_offset`, so feed it every Delta of the request in order."""

    def __init__(self, prepared: PreparedRequest, tokenizer: Tokenizer,
                 include_usage: bool = False) -> None:
        self.prepared = prepared
        self.tokenizer = tokenizer
        self.include_usage = include_usage
        self.chat = prepared.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + prepared.request_id
        self.created = int(time.time())
        self._offset = 0

    # ------------------------------------------------------------------ pieces
    def usage(self, completion_tokens: int) -> dict:
        prompt = self.prepared.num_prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

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

    def _completion_logprobs(self, delta: Delta) -> dict:
        tok = self.tokenizer
        top_n = self.prepared.params.top_logprobs
        tokens, offsets, tops = [], [], []
        start, end = self._offset, self._offset + len(delta.text)
        for lp in delta.logprobs:
            text = tok.token_text(lp.token_id)
            tokens.append(text)
            offsets.append(min(start, end))
            start += len(text)
            top = {tok.token_text(t): _finite(v) for t, v in lp.top[:top_n]}
            top.setdefault(text, _finite(lp.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in delta.logprobs],
                "top_logprobs": tops, "text_offset": offsets}

    def _logprobs(self, delta: Delta) -> dict | None:
        if not self.prepared.params.logprobs:
            return None
        if self.chat:
            return {"content": [self._chat_logprob(lp) for lp in delta.logprobs]}
        out = self._completion_logprobs(delta)
        self._offset += len(delta.text)
        return out

    # ------------------------------------------------------------------ streaming
    def _chunk(self, choice: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = self._envelope(obj, [choice])
        if self.include_usage:
            out["usage"] = None
        return out

    def role_chunk(self) -> dict:
        """Chat's first chunk: the assistant role with empty content."""
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def delta_chunks(self, delta: Delta) -> list[dict]:
        """The chunks for one Delta (none when it adds neither text nor logprobs nor a finish)."""
        has_logprobs = self.prepared.params.logprobs and delta.logprobs
        if not (delta.text or has_logprobs or delta.finish_reason):
            return []
        logprobs = self._logprobs(delta)
        if not self.chat:
            return [self._chunk({"index": 0, "text": delta.text, "logprobs": logprobs,
                                 "finish_reason": delta.finish_reason})]
        chunks = []
        if delta.text or has_logprobs:
            chunks.append(self._chunk({"index": 0, "delta": {"content": delta.text},
                                       "logprobs": logprobs, "finish_reason": None}))
        if delta.finish_reason:
            chunks.append(self._chunk({"index": 0, "delta": {}, "logprobs": None,
                                       "finish_reason": delta.finish_reason}))
        return chunks

    def usage_chunk(self, completion_tokens: int) -> dict:
        """The last chunk when stream_options.include_usage: no choices, the usage."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = self._envelope(obj, [])
        out["usage"] = self.usage(completion_tokens)
        return out

    # ------------------------------------------------------------------ full response
    def response(self, deltas: list[Delta]) -> dict:
        """The non-streaming response for all Deltas of the request."""
        text = "".join(d.text for d in deltas)
        finish = deltas[-1].finish_reason if deltas else None
        used = deltas[-1].completion_tokens if deltas else 0
        logprobs = self._merged_logprobs(deltas)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs, "finish_reason": finish}
            out = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
            out = self._envelope("text_completion", [choice])
        out["usage"] = self.usage(used)
        return out

    def _merged_logprobs(self, deltas: list[Delta]) -> dict | None:
        if not self.prepared.params.logprobs:
            return None
        parts = [self._logprobs(d) for d in deltas]
        merged: dict = {}
        for part in parts:
            for key, values in part.items():
                merged.setdefault(key, []).extend(values)
        if not merged:
            return {"content": []} if self.chat else {
                "tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        return merged
