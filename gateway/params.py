"""Shared request validation: both front doors (REST and gRPC) turn their input into a
`GenerationParams` (`from_client`: each field checked once, at the edge) and a `Prompt`, and
`RequestPreparer.prepare` turns those into one `PreparedRequest` (the checks that need the
model). All range checks, defaults and error messages live here, so the two front doors cannot
drift.
"""

from __future__ import annotations

import json
import math
import secrets
import uuid
from dataclasses import dataclass, replace
from typing import Any, Iterable, Literal, Sequence

import engine.sampling_limits as limits
from gateway.errors import GatewayError, bad_request
from gateway.chat_template import ChatTemplateError
from gateway.tokenizer import Tokenizer
from gateway.wire import check_ints
from proto import pdserve_pb2

MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = limits.MAX_TOP_LOGPROBS
DEFAULT_COMPLETION_MAX_TOKENS = 16
SEED_LIMIT = 2 ** 64
MAX_CACHE_SALT = 256
MAX_REQUEST_ID = 256


@dataclass(frozen=True)
class Prompt:
    """Exactly one of text, token_ids, messages. `messages` are {"role", "content": str} dicts."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[dict, ...] | None = None
    tools: tuple[dict, ...] | None = None      # chat: rendered with the messages
    tool_parser: str = ""                      # the text form of calls (the default rendering)

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.text, self.token_ids, self.messages))
        if given != 1:
            raise ValueError("a Prompt holds exactly one of text, token_ids, messages")

    @property
    def kind(self) -> Literal["completion", "chat"]:
        return "chat" if self.messages is not None else "completion"


STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_N = limits.MAX_CHOICES
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_STRUCTURED_CHARS = 64 * 1024     # a JSON schema, regex or grammar (its compile is the cost)
MAX_CHOICES = 1024


@dataclass(frozen=True)
class Structured:
    """A constraint on the output: `kind` one of STRUCTURED_KINDS; `value` the JSON schema (as
    JSON text), the regex, the EBNF grammar, or for "choice" the strings. The decode and
    prefill workers compile it (xgrammar); one they cannot compile fails the request with 400."""

    kind: str
    value: str | tuple[str, ...] = ""
    compact: bool = False      # JSON kinds: one line (disable_any_whitespace)

    def to_proto(self) -> pdserve_pb2.StructuredOutput:
        if self.kind == "json_object":
            return pdserve_pb2.StructuredOutput(json_object=True, compact_json=self.compact)
        if self.kind == "choice":
            return pdserve_pb2.StructuredOutput(
                choice=pdserve_pb2.ChoiceList(choices=list(self.value)))
        return pdserve_pb2.StructuredOutput(**{self.kind: self.value},
                                            compact_json=self.compact)


@dataclass(frozen=True)
class GenerationParams:
    """A request's generation parameters: the one type from the gateway's edge to the workers.

    Made by `from_client` (both front doors), which checks every field against what it may be
    on its own and fills in the defaults; `RequestPreparer.prepare` checks what needs the model
    (token ids within the vocabulary, prompt + max_tokens within the context), bounds
    max_tokens and chooses a seed when the client gave none (one per prompt of a batch), so the
    params of a PreparedRequest have every field set. `to_proto` is the one conversion to the
    wire.
    """

    max_tokens: int | None = None      # None: not given (prepare bounds it by the context)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0          # 0 means off
    seed: int | None = None            # None: not given (prepare chooses one)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    echo: bool = False
    structured: Structured | None = None
    # the prompt's logprobs with this many top alternatives (None: not asked for); completions'
    # echo with logprobs computes them too (prompt_logprobs_computed)
    prompt_logprobs: int | None = None
    # beam search (engine/beam_search.py): n is the width
    beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # (parameter, the request field it came from) where the two names differ:
    # max_completion_tokens, a completion's logprobs (its top_logprobs)
    aliases: tuple[tuple[str, str], ...] = ()

    def param(self, name: str) -> str:
        """The request field the parameter `name` came from (for error messages)."""
        return dict(self.aliases).get(name, name)

    @classmethod
    def from_client(cls, logit_bias: Iterable[tuple[Any, float]] = (),
                    **given: Any) -> "GenerationParams":
        """The parameters as a client gave them (a None value: not given, the default);
        GatewayError 400 naming the field for a value out of its range. `logit_bias`: (token
        id as the client wrote it, bias) pairs; a later pair for the same id wins."""
        params = cls(**{k: v for k, v in given.items() if v is not None})
        params._check()
        bias = _logit_bias(logit_bias)
        return replace(params, top_k=max(params.top_k, 0), logit_bias=bias,
                       logprobs=params.logprobs or params.top_logprobs > 0,
                       temperature=float(params.temperature), top_p=float(params.top_p),
                       min_p=float(params.min_p),
                       presence_penalty=float(params.presence_penalty),
                       frequency_penalty=float(params.frequency_penalty),
                       repetition_penalty=float(params.repetition_penalty))

    def _check(self) -> None:
        _check_finite(self.temperature, "temperature")
        if self.temperature not in limits.TEMPERATURE:
            raise bad_request(f"temperature must be between {limits.TEMPERATURE.lo:g} and "
                              f"{limits.TEMPERATURE.hi:g}, got {self.temperature}", "temperature")
        _check_finite(self.top_p, "top_p")
        if self.top_p not in limits.TOP_P:
            raise bad_request(f"top_p must be in {limits.TOP_P}, got {self.top_p}", "top_p")
        if self.top_k < -1:
            raise bad_request(f"top_k must be -1 or 0 (off) or a positive number, got "
                              f"{self.top_k}", "top_k")
        if self.seed is not None and not 0 <= self.seed < SEED_LIMIT:
            raise bad_request(f"seed must be in [0, 2^64), got {self.seed}", "seed")
        if self.max_tokens is not None and self.max_tokens < 1:
            param = self.param("max_tokens")
            raise bad_request(f"{param} must be at least 1, got {self.max_tokens}", param)
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            param = self.param("top_logprobs")
            raise bad_request(f"{param} must be between 0 and {MAX_TOP_LOGPROBS}, "
                              f"got {self.top_logprobs}", param)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are supported, "
                              f"got {len(self.stop)}", "stop")
        if any(not s for s in self.stop):
            raise bad_request("stop strings must not be empty", "stop")
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be between 1 and {MAX_N}, got {self.n}", "n")
        self._check_penalties()
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad_request(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are supported, got "
                              f"{len(self.stop_token_ids)}", "stop_token_ids")
        if self.prompt_logprobs is not None and \
                not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"prompt_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, "
                              f"got {self.prompt_logprobs}", "prompt_logprobs")
        if self.structured is not None:
            _check_structured(self.structured)
        if self.beam_search:
            self._check_beam()
        check_ints(self, dict(self.aliases))

    def _check_beam(self) -> None:
        """Beam search ranks the model's raw logprobs, deterministically (engine/beam_search.py):
        what would change them, draw from them or cut the beams' text is refused by name."""
        neutral = {"temperature": 0, "top_p": 1, "min_p": 0, "presence_penalty": 0,
                   "frequency_penalty": 0, "repetition_penalty": 1, "min_tokens": 0}
        for name, value in neutral.items():
            if getattr(self, name) != value:
                raise bad_request(f"{name} does not apply to beam search (it ranks the model's "
                                  "raw logprobs, deterministically); leave it unset", name)
        if self.top_k not in (0, -1):
            raise bad_request("top_k does not apply to beam search; leave it unset", "top_k")
        if self.seed is not None:
            raise bad_request("seed does not apply to beam search (it draws nothing: the same "
                              "request always gives the same beams); leave it unset", "seed")
        for name in ("logit_bias", "stop", "stop_token_ids", "structured"):
            if getattr(self, name):
                raise bad_request(f"{name} is not supported with beam search",
                                  "response_format" if name == "structured" else name)
        if self.logprobs:
            param = self.param("top_logprobs") if self.top_logprobs else "logprobs"
            raise bad_request("logprobs are not supported with beam search", param)
        _check_finite(self.length_penalty, "length_penalty")
        if self.early_stopping not in (False, True, "never"):
            raise bad_request(f"early_stopping must be true, false or \"never\", got "
                              f"{self.early_stopping!r}", "early_stopping")

    def _check_penalties(self) -> None:
        _check_range(self.min_p, limits.MIN_P, "min_p")
        _check_range(self.presence_penalty, limits.PRESENCE_PENALTY, "presence_penalty")
        _check_range(self.frequency_penalty, limits.FREQUENCY_PENALTY, "frequency_penalty")
        _check_range(self.repetition_penalty, limits.REPETITION_PENALTY, "repetition_penalty")
        if self.min_tokens < 0:
            raise bad_request(f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")

    @property
    def prompt_logprobs_computed(self) -> int | None:
        """The top alternatives the worker scores per prompt token (None: no prompt logprobs):
        what prompt_logprobs asks for, or completions' echo with logprobs (the echoed prompt's
        entries, as vLLM gives them)."""
        wanted = [k for k in (self.prompt_logprobs,
                              self.top_logprobs if self.echo and self.logprobs else None)
                  if k is not None]
        return max(wanted) if wanted else None

    def to_proto(self) -> pdserve_pb2.SamplingParams:
        """The wire form (params of a PreparedRequest: max_tokens and seed are set)."""
        msg = pdserve_pb2.SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            max_tokens=self.max_tokens, ignore_eos=self.ignore_eos, stop=list(self.stop),
            logprobs=self.logprobs, top_logprobs=self.top_logprobs, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=dict(self.logit_bias),
            min_tokens=self.min_tokens, stop_token_ids=list(self.stop_token_ids),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, n=self.n)
        if self.prompt_logprobs_computed is not None:
            msg.prompt_logprobs = self.prompt_logprobs_computed
        if self.beam_search:
            msg.beam_width = self.n
            msg.length_penalty = self.length_penalty
            msg.early_stopping = str(self.early_stopping).lower()
        if self.structured is not None:
            msg.structured.CopyFrom(self.structured.to_proto())
        return msg


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for the pipeline: what the workers need, nothing to re-check."""

    request_id: str            # made by the gateway: the id workers know the request by
    model: str
    kind: Literal["completion", "chat"]
    prompt_token_ids: tuple[int, ...]
    params: GenerationParams
    cache_salt: str = ""       # requests share cached KV only with the same salt
    client_request_id: str = ""  # the client's own id, if it gave one: metadata only
    lora_name: str = ""        # the LoRA adapter the request's `model` named ("": the base)

    @property
    def public_id(self) -> str:
        """The id the client sees: its own, else the gateway's."""
        return self.client_request_id or self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int
    # the output bound of a request without max_tokens (0: the rest of the context), per
    # deployment (`pdserve gateway --max-tokens-default`)
    max_tokens_default: int = 0
    tool_call_parser: str = ""       # `--tool-call-parser`: "" (tools refused), hermes, llama3_json

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("the served model name must not be empty")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_tokens_default < 0:
            raise ValueError(f"max_tokens_default must be >= 0, got {self.max_tokens_default}")


def _check_finite(value: float, param: str) -> None:
    if not math.isfinite(value):
        raise bad_request(f"{param} must be a finite number, got {value}", param)


def _check_range(value: float | None, allowed: limits.Range, param: str) -> None:
    if value is None:
        return
    _check_finite(value, param)
    if value not in allowed:
        raise bad_request(f"{param} must be in {allowed}, got {value}", param)


def _logit_bias(bias: Iterable[tuple[Any, float]]) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, as sorted (id, bias) pairs (the
    ids are held to the vocabulary by RequestPreparer)."""
    pairs = list(bias)
    if len(pairs) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got "
                          f"{len(pairs)}", "logit_bias")
    out: dict[int, float] = {}
    for key, value in pairs:
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}",
                              "logit_bias") from None
        _check_finite(float(value), "logit_bias")
        if value not in limits.LOGIT_BIAS:
            raise bad_request(f"logit_bias values must be in {limits.LOGIT_BIAS}, got {value} "
                              f"for "
                              f"token {tok}", "logit_bias")
        out[tok] = float(value)
    return tuple(sorted(out.items()))


def _check_structured(st: Structured) -> None:
    param = "structured_outputs"
    size = sum(len(c) for c in st.value) if isinstance(st.value, tuple) else len(st.value)
    if size > MAX_STRUCTURED_CHARS:
        raise bad_request(f"the output constraint is {size} characters long; at most "
                          f"{MAX_STRUCTURED_CHARS} are accepted", param)
    if st.kind == "choice" and len(st.value) > MAX_CHOICES:
        raise bad_request(f"at most {MAX_CHOICES} choices are accepted, got {len(st.value)}",
                          param)
    if st.kind not in STRUCTURED_KINDS:
        raise bad_request(f"unknown structured output kind {st.kind!r}; one of "
                          f"{', '.join(STRUCTURED_KINDS)}", param)
    if st.kind == "choice":
        if not st.value or any(not isinstance(c, str) or not c for c in st.value):
            raise bad_request("structured_outputs.choice must be a non-empty list of non-empty "
                              "strings", param)
    elif st.kind == "json_schema":
        try:
            schema = json.loads(st.value)
        except ValueError as exc:
            raise bad_request(f"the JSON schema is not valid JSON: {exc}", param) from None
        if not isinstance(schema, (dict, bool)):
            raise bad_request("a JSON schema must be a JSON object", param)
    elif st.kind in ("regex", "grammar") and not st.value:
        raise bad_request(f"structured_outputs.{st.kind} must not be empty", param)


class RequestPreparer:
    """Validates and tokenizes requests for one served model.

    Contract: `prepare` either returns a PreparedRequest whose prompt fits the context together
    with max_tokens and whose token ids are all in the vocabulary, or raises GatewayError with
    status 400 (bad input) or 404 (unknown model). It never contacts a worker.
    """

    def __init__(self, tokenizer: Tokenizer, served: ServedModel) -> None:
        self.tokenizer = tokenizer
        self.served = served
        self.adapters = lambda: set()    # the LoRA adapters workers serve (the router's)

    def check_model(self, model: str | None) -> str:
        """The LoRA adapter `model` names ("" for the base model); 404 for another name."""
        if not model or model == self.served.name:
            return ""
        if model in self.adapters():
            return model
        raise GatewayError(f"The model `{model}` does not exist. This server serves "
                           f"`{self.served.name}`" + (f" and its LoRA adapters "
                                                      f"{sorted(self.adapters())}"
                                                      if self.adapters() else "") + ".",
                           status=404, param="model", code="model_not_found")

    def prompt_ids(self, prompt: Prompt) -> tuple[int, ...]:
        if prompt.messages is not None:
            if not prompt.messages:
                raise bad_request("messages must not be empty", "messages")
            try:
                return tuple(self.tokenizer.encode_chat(
                    list(prompt.messages), tools=list(prompt.tools) if prompt.tools else None,
                    tool_parser=prompt.tool_parser or None))
            except ChatTemplateError as exc:
                raise bad_request(str(exc), exc.param) from exc
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

    def _check_vocab(self, ids: Iterable[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        for tok in ids:
            if not 0 <= tok < vocab:
                raise bad_request(f"{param}: token id {tok} is out of the vocabulary range "
                                  f"[0, {vocab})", param)

    @staticmethod
    def _check_truncation_side(keep: int | None, side: str | None) -> None:
        """`side` is "left", "right" or None, and given only with `keep` (without it, it would
        change nothing)."""
        if side not in (None, "left", "right"):
            raise bad_request(f"truncation_side must be 'left' or 'right', got {side!r}",
                              "truncation_side")
        if side is not None and keep is None:
            raise bad_request("truncation_side applies to truncate_prompt_tokens, which is not "
                              "given: set truncate_prompt_tokens too, or leave truncation_side "
                              "out", "truncation_side")

    def truncated(self, ids: tuple[int, ...], keep: int | None, side: str | None
                  ) -> tuple[int, ...]:
        """IDS cut to KEEP tokens on SIDE (checked by _check_truncation_side)."""
        if keep is None:
            return ids
        limit = self.served.max_model_len
        if keep < -1:
            raise bad_request(f"truncate_prompt_tokens must be -1 (the context length less "
                              f"one) or at least 1, got {keep}", "truncate_prompt_tokens")
        if keep == 0:
            raise bad_request("truncate_prompt_tokens 0 leaves an empty prompt",
                              "truncate_prompt_tokens")
        if keep > limit:
            raise bad_request(f"truncate_prompt_tokens={keep} cannot be greater than the "
                              f"model's context length, {limit} tokens", "truncate_prompt_tokens")
        keep = limit - 1 if keep == -1 else keep
        if len(ids) <= keep:
            return ids
        return ids[:keep] if side == "right" else ids[-keep:]

    def _max_tokens(self, params: GenerationParams, kind: str, num_prompt: int) -> int:
        limit = self.served.max_model_len
        where = "messages" if kind == "chat" else "prompt"
        if num_prompt >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens, and your "
                              f"{where} has {num_prompt} tokens, which leaves no room for the "
                              f"completion. Please shorten the {where}.", where)
        rest = limit - num_prompt
        if params.max_tokens is None:
            if kind == "completion":
                return min(DEFAULT_COMPLETION_MAX_TOKENS, rest)
            return min(self.served.max_tokens_default or rest, rest)
        if num_prompt + params.max_tokens > limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, "
                              f"you requested {num_prompt + params.max_tokens} tokens "
                              f"({num_prompt} in the {where}, {params.max_tokens} in the "
                              f"completion). Please reduce the length of the {where} or the "
                              f"completion.", params.param("max_tokens"))
        return params.max_tokens

    def prepare(self, prompt: Prompt, params: GenerationParams, model: str | None = None,
                request_id: str | None = None, client_request_id: str = "",
                cache_salt: str | None = None, truncate_prompt_tokens: int | None = None,
                truncation_side: str | None = None) -> PreparedRequest:
        """`params` as a front door made them (`GenerationParams.from_client`); `request_id`:
        the gateway's id for the request (default: a fresh one); a client's own id is only
        `client_request_id`, so two clients can never collide on a worker.
        `truncate_prompt_tokens` (vLLM's): keep that many prompt tokens (-1: the context
        length less one), the last ones (`truncation_side` "left", the default) or the first
        ("right"); chat prompts are cut after the template. `truncation_side` without
        `truncate_prompt_tokens` is refused (it would change nothing)."""
        lora = self.check_model(model)
        if len(client_request_id) > MAX_REQUEST_ID:
            raise bad_request(f"request_id must be at most {MAX_REQUEST_ID} characters",
                              "request_id")
        self._check_truncation_side(truncate_prompt_tokens, truncation_side)
        ids = self.truncated(self.prompt_ids(prompt), truncate_prompt_tokens, truncation_side)
        max_tokens = self._max_tokens(params, prompt.kind, len(ids))
        if params.min_tokens > max_tokens:
            raise bad_request(f"min_tokens ({params.min_tokens}) must not exceed the output's "
                              f"bound ({params.param('max_tokens')} = {max_tokens})",
                              "min_tokens")
        self._check_vocab((tok for tok, _ in params.logit_bias), "logit_bias")
        self._check_vocab(params.stop_token_ids, "stop_token_ids")
        seed = secrets.randbits(63) if params.seed is None else params.seed
        salt = cache_salt or ""
        if len(salt) > MAX_CACHE_SALT:
            raise bad_request(f"cache_salt must be at most {MAX_CACHE_SALT} characters, got "
                              f"{len(salt)}", "cache_salt")
        return PreparedRequest(request_id=request_id or uuid.uuid4().hex,
                               model=lora or self.served.name,
                               kind=prompt.kind, prompt_token_ids=ids,
                               params=replace(params, max_tokens=max_tokens, seed=seed),
                               cache_salt=salt, client_request_id=client_request_id,
                               lora_name=lora)
