"""Shared request validation: both front doors (REST and gRPC) turn their input into `RawParams`
and a `Prompt`, and `RequestPreparer.prepare` turns those into one `PreparedRequest`. All range
checks, defaults and error messages live here, so the two front doors cannot drift.
"""

from __future__ import annotations

import math
import secrets
import uuid
from dataclasses import dataclass
from typing import Literal, Sequence

from gateway.errors import GatewayError, bad_request
from gateway.tokenizer import ChatTemplateError, Tokenizer
from proto import pdserve_pb2

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
DEFAULT_COMPLETION_MAX_TOKENS = 16
SEED_LIMIT = 2 ** 64
MAX_CACHE_SALT = 256


@dataclass(frozen=True)
class Prompt:
    """Exactly one of text, token_ids, messages. `messages` are {"role", "content": str} dicts."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.text, self.token_ids, self.messages))
        if given != 1:
            raise ValueError("a Prompt holds exactly one of text, token_ids, messages")

    @property
    def kind(self) -> Literal["completion", "chat"]:
        return "chat" if self.messages is not None else "completion"


@dataclass(frozen=True)
class RawParams:
    """Sampling fields as the client sent them; None means "not given"."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    cache_salt: str | None = None


@dataclass(frozen=True)
class GenerationParams:
    """Validated, fully resolved sampling parameters (every field set; seed always chosen)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int          # 0 means off
    seed: int
    stop: tuple[str, ...]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int

    def to_proto(self) -> pdserve_pb2.SamplingParams:
        return pdserve_pb2.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            max_tokens=self.max_tokens, ignore_eos=self.ignore_eos, stop=list(self.stop),
            logprobs=self.logprobs, top_logprobs=self.top_logprobs)


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for the pipeline: what the workers need, nothing to re-check."""

    request_id: str
    model: str
    kind: Literal["completion", "chat"]
    prompt_token_ids: tuple[int, ...]
    params: GenerationParams
    cache_salt: str = ""       # requests share cached KV only with the same salt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("the served model name must not be empty")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")


def _check_finite(value: float, param: str) -> None:
    if not math.isfinite(value):
        raise bad_request(f"{param} must be a finite number, got {value}", param)


def _check_sampling(raw: RawParams) -> None:
    if raw.temperature is not None:
        _check_finite(raw.temperature, "temperature")
        if not 0.0 <= raw.temperature <= 2.0:
            raise bad_request(f"temperature must be between 0 and 2, got {raw.temperature}",
                              "temperature")
    if raw.top_p is not None:
        _check_finite(raw.top_p, "top_p")
        if not 0.0 < raw.top_p <= 1.0:
            raise bad_request(f"top_p must be in (0, 1], got {raw.top_p}", "top_p")
    if raw.top_k is not None and raw.top_k < -1:
        raise bad_request(f"top_k must be -1 or 0 (off) or a positive number, got {raw.top_k}",
                          "top_k")
    if raw.seed is not None and not 0 <= raw.seed < SEED_LIMIT:
        raise bad_request(f"seed must be in [0, 2^64), got {raw.seed}", "seed")
    if raw.max_tokens is not None and raw.max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {raw.max_tokens}", "max_tokens")
    if not 0 <= raw.top_logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, "
                          f"got {raw.top_logprobs}", "top_logprobs")
    if len(raw.stop) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are supported, "
                          f"got {len(raw.stop)}", "stop")
    if any(not s for s in raw.stop):
        raise bad_request("stop strings must not be empty", "stop")


class RequestPreparer:
    """Validates and tokenizes requests for one served model.

    Contract: `prepare` either returns a PreparedRequest whose prompt fits the context together
    with max_tokens and whose token ids are all in the vocabulary, or raises GatewayError with
    status 400 (bad input) or 404 (unknown model). It never contacts a worker.
    """

    def __init__(self, tokenizer: Tokenizer, served: ServedModel) -> None:
        self.tokenizer = tokenizer
        self.served = served

    def check_model(self, model: str | None) -> None:
        if model and model != self.served.name:
            raise GatewayError(f"The model `{model}` does not exist. This server serves "
                               f"`{self.served.name}`.", status=404, param="model",
                               code="model_not_found")

    def prompt_ids(self, prompt: Prompt) -> tuple[int, ...]:
        if prompt.messages is not None:
            if not prompt.messages:
                raise bad_request("messages must not be empty", "messages")
            try:
                return tuple(self.tokenizer.encode_chat(list(prompt.messages)))
            except ChatTemplateError as exc:
                raise bad_request(str(exc), "messages") from exc
        if prompt.text is not None:
            if not prompt.text:
                raise bad_request("prompt must not be empty", "prompt")
            return tuple(self.tokenizer.encode(prompt.text))
        return self._checked_ids(prompt.token_ids)

    def _checked_ids(self, ids: Sequence[int]) -> tuple[int, ...]:
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        vocab = self.tokenizer.vocab_size
        for pos, tok in enumerate(ids):
            if not 0 <= tok < vocab:
                raise bad_request(f"prompt token id {tok} at position {pos} is out of the "
                                  f"vocabulary range [0, {vocab})", "prompt")
        return tuple(ids)

    def _max_tokens(self, raw: RawParams, kind: str, num_prompt: int) -> int:
        limit = self.served.max_model_len
        where = "messages" if kind == "chat" else "prompt"
        if num_prompt >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens, and your "
                              f"{where} has {num_prompt} tokens, which leaves no room for the "
                              f"completion. Please shorten the {where}.", where)
        if raw.max_tokens is None:
            return DEFAULT_COMPLETION_MAX_TOKENS if kind == "completion" else limit - num_prompt
        if num_prompt + raw.max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, "
                              f"you requested {num_prompt + raw.max_tokens} tokens ({num_prompt} "
                              f"in the {where}, {raw.max_tokens} in the completion). Please "
                              f"reduce the length of the {where} or the completion.",
                              "max_tokens")
        return raw.max_tokens

    def prepare(self, prompt: Prompt, raw: RawParams, model: str | None = None,
                request_id: str | None = None) -> PreparedRequest:
        self.check_model(model)
        _check_sampling(raw)
        ids = self.prompt_ids(prompt)
        params = GenerationParams(
            max_tokens=self._max_tokens(raw, prompt.kind, len(ids)),
            temperature=1.0 if raw.temperature is None else float(raw.temperature),
            top_p=1.0 if raw.top_p is None else float(raw.top_p),
            top_k=max(raw.top_k or 0, 0),
            seed=secrets.randbits(63) if raw.seed is None else raw.seed,
            stop=tuple(raw.stop), ignore_eos=raw.ignore_eos,
            logprobs=raw.logprobs or raw.top_logprobs > 0, top_logprobs=raw.top_logprobs)
        salt = raw.cache_salt or ""
        if len(salt) > MAX_CACHE_SALT:
            raise bad_request(f"cache_salt must be at most {MAX_CACHE_SALT} characters, got "
                              f"{len(salt)}", "cache_salt")
        return PreparedRequest(request_id=request_id or uuid.uuid4().hex, model=self.served.name,
                               kind=prompt.kind, prompt_token_ids=ids, params=params,
                               cache_salt=salt)
