"""Request models of the OpenAI-compatible REST API (pydantic v2) and their translation into the
shared `Prompt` + `RawParams` (see params.py). Unknown fields are refused (extra="forbid").

Accepted but limited, as the OpenAI fields go: n (only 1), echo (only false), presence_penalty
and frequency_penalty (only 0), `user` (ignored). Anything else in the range checks is shared with
the gRPC front door and lives in params.py.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, StrictInt

from gateway.errors import GatewayError, bad_request
from gateway.params import MAX_TOP_LOGPROBS, Prompt, RawParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def as_template_dict(self) -> dict:
        """{"role", "content": str} (text parts joined by newlines), plus name when given."""
        if isinstance(self.content, list):
            content = "\n".join(part.text for part in self.content)
        else:
            content = self.content or ""
        out = {"role": self.role, "content": content}
        if self.name is not None:
            out["name"] = self.name
        return out


class _CommonRequest(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    ignore_eos: bool = False
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _check_unsupported(self) -> None:
        if self.n is not None and self.n != 1:
            raise bad_request(f"only n=1 is supported, got n={self.n}", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise bad_request(f"{name} is not supported; only 0 is accepted, got {value}",
                                  name)

    def _stop(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def _raw(self, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> RawParams:
        return RawParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                         top_k=self.top_k, seed=self.seed, stop=self._stop(),
                         ignore_eos=self.ignore_eos, logprobs=logprobs,
                         top_logprobs=top_logprobs, cache_salt=self.cache_salt)


class CompletionRequest(_CommonRequest):
    """POST /v1/completions. `logprobs` is the number of top alternatives (0..20) per token."""

    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    logprobs: int | None = None
    echo: bool | None = False

    def to_shared(self) -> tuple[Prompt, RawParams]:
        """The shared prompt and raw parameters; raises GatewayError (400) on what only the
        completions API can get wrong (batch prompts, n, echo, penalties)."""
        self._check_unsupported()
        if self.echo:
            raise bad_request("echo is not supported; only echo=false is accepted", "echo")
        if isinstance(self.prompt, str):
            prompt = Prompt(text=self.prompt)
        elif self.prompt and not isinstance(self.prompt[0], int):
            raise bad_request("batched prompts (a list of strings or of token lists) are not "
                              "supported; send one prompt per request", "prompt")
        else:
            prompt = Prompt(token_ids=tuple(self.prompt))
        lp = self.logprobs
        if lp is not None and not 0 <= lp <= MAX_TOP_LOGPROBS:
            raise bad_request(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {lp}",
                              "logprobs")
        return prompt, self._raw(self.max_tokens, lp is not None, lp or 0)


class ChatCompletionRequest(_CommonRequest):
    """POST /v1/chat/completions. `logprobs` is a flag; `top_logprobs` the alternatives (0..20)."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None

    def to_shared(self) -> tuple[Prompt, RawParams]:
        self._check_unsupported()
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        prompt = Prompt(messages=tuple(m.as_template_dict() for m in self.messages))
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        param = "max_completion_tokens" if self.max_completion_tokens is not None else None
        if max_tokens is not None and max_tokens < 1:
            raise bad_request(f"{param or 'max_tokens'} must be at least 1, got {max_tokens}",
                              param or "max_tokens")
        return prompt, self._raw(max_tokens, bool(self.logprobs), self.top_logprobs or 0)


def _loc(err: dict) -> list[str]:
    return [str(p) for p in err.get("loc", ()) if p != "body"]


def _union_failure(errors: list[dict]) -> tuple[list[str], str] | None:
    """When every error sits under one field (the branches of a union), that field and a summary
    of what each branch expected."""
    locs = [_loc(e) for e in errors]
    common = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(common), len(loc)) and common[n] == loc[n]:
            n += 1
        common = common[:n]
    if len(errors) < 2 or not common:
        return None
    parts = [f"{'.'.join(loc[len(common):])}: {e.get('msg')}" for loc, e in zip(locs, errors)]
    return common, "; ".join(parts[:4])


def validation_error(errors: list[dict]) -> GatewayError:
    """A GatewayError (400) from pydantic / FastAPI validation errors, naming the field."""
    if not errors:
        return bad_request("invalid request")
    err = errors[0]
    loc = _loc(err)
    param = ".".join(loc) or None
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return bad_request(f"the request body is not valid JSON: {detail}".rstrip(": "))
    if not loc:
        return bad_request("the request body must be a JSON object")
    if kind == "extra_forbidden":
        return bad_request(f"unrecognized request argument: {param}", param)
    if kind == "missing":
        return bad_request(f"missing required argument: {param}", param)
    union = _union_failure(errors)
    if union is not None:
        param = ".".join(union[0])
        return bad_request(f"invalid value for {param}: none of its accepted forms matches "
                           f"({union[1]})", param)
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    return bad_request(f"invalid value for {param}: {msg}", param)
