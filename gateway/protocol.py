"""Request models of the OpenAI-compatible REST API (pydantic v2) and their translation into the
shared `Prompt` + `GenerationParams` (see params.py). Unknown fields are refused
(extra="forbid"), and so are values of another JSON type (strict: no true for a number, no "1"
for an integer; 2.0 is the integer 2, as JSON Schema reads it).

Beyond OpenAI's fields, vLLM's sampling extensions are accepted (top_k, min_p,
repetition_penalty, min_tokens, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, ignore_eos, structured_outputs and its older guided_* spellings), so
clients written for vLLM work unchanged. Accepted but limited: best_of (only = n),
suffix (only none), response_format's json_schema.strict (only true: the schema is always
enforced); `user` is an end-user id for the caller's
records and changes nothing. Range checks shared with the gRPC front door live in params.py;
the OpenAPI schema states them (and the rules across fields that as_template_dict, params.py and
gateway/tools/ apply) so that it describes exactly the requests that are valid, bar what it cannot
know (the vocabulary, the context left, best_of = n).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator
from pydantic_core import PydanticCustomError

from gateway.chat_template import CHAT_ROLES
from gateway.errors import GatewayError, bad_request
from gateway.params import (MAX_CACHE_SALT, MAX_CHOICES, MAX_LOGIT_BIAS, MAX_N,
                            MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_STRUCTURED_CHARS,
                            MAX_TOP_LOGPROBS, SEED_LIMIT, GenerationParams, Prompt, Structured)
from gateway.timing import NVEXT_FIELDS
from gateway.tools.validation import check_tools
from gateway.wire import bad_text

# any other role goes to the chat template as it is (vLLM's custom roles), if it is a name
CUSTOM_ROLE = r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"


def _whole(value: Any) -> Any:
    """JSON (and JSON Schema) reads 2.0 as the integer 2: a number spelled so is taken."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer, or a float with no fraction; never a bool or a numeric string.
Integer = Annotated[StrictInt, BeforeValidator(_whole)]
TokenId = Integer


class _Strict(BaseModel):
    """Unknown fields refused; values of the declared JSON types only (strict: no bool for a
    number, no "1" for an integer, no 0 for a bool)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class RequestBody(_Strict):
    """A whole request body. Before any field is read, every string in it (object keys too)
    must be valid Unicode: the error names the first one that is not (see wire.bad_text)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        bad = bad_text(data)
        if bad is not None:
            raise PydanticCustomError("invalid_unicode", "{message}",
                                      {"message": bad.message, "param": bad.param})
        return data


# The OpenAPI schema (/openapi.json) states the bounds that params.py and gateway/tools/ check, so
# clients and schema-driven fuzzers see what is valid. They are documented here and checked
# there (with the messages both front doors share): pydantic does not enforce them.

def _bounded(default: Any = None, **bounds: Any) -> Any:
    """A field whose schema carries `bounds` (JSON Schema keywords) beside its type."""
    return Field(default, json_schema_extra=bounds)


class LoadLoRARequest(_Strict):
    """POST /v1/load_lora_adapter (vLLM's fields)."""

    lora_name: str = _bounded(..., minLength=1, maxLength=256)
    lora_path: str = _bounded(..., minLength=1, maxLength=4096)


class UnloadLoRARequest(_Strict):
    """POST /v1/unload_lora_adapter (vLLM's; lora_int_id is accepted and not used)."""

    lora_name: str = _bounded(..., minLength=1, maxLength=256)
    lora_int_id: int | None = None


def _shaped(default: Any = None, **schema: Any) -> Any:
    """A field whose schema is `schema`: for unions whose parts have bounds of their own."""
    def put(field_schema: dict) -> None:
        field_schema.clear()
        field_schema.update(schema)
    return Field(default, json_schema_extra=put)


_NULL = {"type": "null"}
_TEXT = {"type": "string", "minLength": 1}


def _ids(**bounds: Any) -> dict:
    """An array of token ids (each also below the vocabulary size, which the schema cannot
    know)."""
    return {"type": "array", "items": {"type": "integer", "minimum": 0}, **bounds}


def _requires(when: dict, then: dict, given: bool = True) -> dict:
    """A rule across fields: an object with the properties WHEN must have THEN as well (and,
    `given`, have them set: an unset field has its default)."""
    return {"if": {"properties": when, "required": list(when)},
            "then": {"properties": then, "required": list(then) if given else []}}


_NOT_NULL = {"not": {"type": "null"}}
# what as_template_dict checks: content unless an assistant's tool calls stand for it, a tool
# message's tool_call_id, tool_calls only on assistant messages
_MESSAGE_RULES = {"allOf": [
    {"if": {"not": {"properties": {"role": {"const": "assistant"},
                                   "tool_calls": {"type": "array", "minItems": 1}},
                    "required": ["role", "tool_calls"]}},
     "then": {"properties": {"content": _NOT_NULL}, "required": ["content"]}},
    _requires({"role": {"const": "tool"}}, {"tool_call_id": {"type": "string", "minLength": 1}}),
    {"if": {"properties": {"role": {"not": {"const": "assistant"}}}},
     "then": {"properties": {"tool_calls": {"type": "null"}}}}]}
_STREAM_OPTIONS_RULE = _requires({"stream_options": _NOT_NULL}, {"stream": {"const": True}})
_TRUNCATION_RULE = _requires({"truncation_side": _NOT_NULL},
                             {"truncate_prompt_tokens": _NOT_NULL})

_TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"},
                                               "text": {"type": "string"}},
              "required": ["type", "text"], "additionalProperties": False}
_TOOL = {"type": "object", "required": ["function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1}, "parameters": {"type": "object"}}}}}
_CALLED = {"name": {"type": "string", "minLength": 1},
           "arguments": {"type": ["string", "object"]}}     # JSON text, or the object itself
_TOOL_CALL = {"type": "object", "properties": {
    "id": {"type": ["string", "null"]}, "type": {"const": "function"}}, "anyOf": [
    {"required": ["function"],
     "properties": {"function": {"type": "object", "required": ["name"], "properties": _CALLED}}},
    {"required": ["name"], "not": {"required": ["function"]}, "properties": _CALLED}]}
_TOOL_CHOICE = {"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string", "minLength": 1}}}}},
    _NULL]}


class StreamOptions(_Strict):
    """`continuous_usage_stats` (every chunk carries its usage) needs `include_usage` too:
    vLLM ignores it alone, pdserve refuses it."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_requires(
        {"continuous_usage_stats": {"const": True}}, {"include_usage": {"const": True}}))

    include_usage: bool = False
    continuous_usage_stats: bool = False

    def check(self) -> None:
        if self.continuous_usage_stats and not self.include_usage:
            param = "stream_options.continuous_usage_stats"
            raise bad_request(f"{param} needs stream_options.include_usage (vLLM ignores it "
                              "alone): set include_usage true too, or leave "
                              "continuous_usage_stats out", param)


class NvExt(_Strict):
    """NVIDIA Dynamo's request extension: `extra_fields` names what the response's own `nvext`
    object carries (NVEXT_FIELDS: the request's timing block, the workers that served it)."""

    extra_fields: list[str] | None = _shaped(anyOf=[
        {"type": "array", "items": {"enum": list(NVEXT_FIELDS)}}, _NULL])

    def fields(self) -> tuple[str, ...]:
        for i, name in enumerate(self.extra_fields or ()):
            if name not in NVEXT_FIELDS:
                raise bad_request(f"nvext.extra_fields[{i}] is {name!r}: this server returns "
                                  f"only {', '.join(NVEXT_FIELDS)}", "nvext.extra_fields")
        return tuple(self.extra_fields or ())


class ChatMessage(_Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_MESSAGE_RULES)

    role: str = _bounded(..., pattern=CUSTOM_ROLE, examples=list(CHAT_ROLES))
    content: Union[str, list[dict], None] = _shaped(anyOf=[
        {"type": "string"}, {"type": "array", "items": _TEXT_PART}, _NULL])
    name: str | None = None
    tool_calls: list[dict] | None = _shaped(anyOf=[    # assistant
        {"type": "array", "items": _TOOL_CALL}, _NULL])
    tool_call_id: str | None = None            # tool

    def as_template_dict(self, index: int) -> dict:
        """{"role", "content": str} (text parts joined by newlines), plus name / tool fields
        when given; raises GatewayError (400) naming the field for what the model cannot take."""
        where = f"messages[{index}]"
        if self.role not in CHAT_ROLES and not re.fullmatch(CUSTOM_ROLE, self.role):
            raise bad_request(f"role {self.role!r} in {where} is not a name: one of "
                              f"{', '.join(CHAT_ROLES)}, or a custom role of letters, digits, "
                              f"'_', '-' and '.' (up to 64, a letter first) that the model's "
                              f"chat template renders", f"{where}.role")
        if isinstance(self.content, list):
            texts = []
            for j, part in enumerate(self.content):
                kind = part.get("type")
                if kind != "text":
                    raise bad_request(f"content part type {kind!r} is not supported: this model "
                                      "takes text only", f"{where}.content[{j}].type")
                if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                    raise bad_request("a text content part is {\"type\": \"text\", \"text\": "
                                      "string}", f"{where}.content[{j}]")
                texts.append(part["text"])
            content = "\n".join(texts)
        else:
            content = self.content or ""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise bad_request(f"{where} has no content", f"{where}.content")
        if self.tool_calls is not None and self.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", f"{where}.tool_calls")
        for j, call in enumerate(self.tool_calls or ()):
            _check_tool_call(call, f"{where}.tool_calls[{j}]")
        if self.role == "tool" and not self.tool_call_id:
            raise bad_request("a tool message needs tool_call_id", f"{where}.tool_call_id")
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _check_tool_call(call: dict, where: str) -> None:
    """An assistant's earlier tool call: {"id", "type": "function", "function": {"name",
    "arguments"}} (or the function's fields at its top): a name, and arguments as JSON text or
    an object."""
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request("a tool call is {\"type\": \"function\", \"function\": {\"name\": "
                          "string, \"arguments\": string}}", where)
    if not isinstance(fn.get("arguments", ""), (str, dict)):
        raise bad_request("a tool call's arguments are JSON text (or an object)",
                          f"{where}.function.arguments")
    if call.get("type", "function") != "function":
        raise bad_request(f"unsupported tool call type {call.get('type')!r}; only \"function\"",
                          f"{where}.type")
    if not isinstance(call.get("id"), (str, type(None))):
        raise bad_request("a tool call's id is a string", f"{where}.id")


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: Union[dict, str, None] = None
    regex: str | None = _bounded(minLength=1, maxLength=MAX_STRUCTURED_CHARS, format="regex")
    choice: list[str] | None = _shaped(anyOf=[
        {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_CHOICES}, _NULL])
    grammar: str | None = _bounded(minLength=1, maxLength=MAX_STRUCTURED_CHARS)
    json_object: bool | None = None
    # vLLM's: JSON on one line, no whitespace but ", " and ": " (default: the model's, bounded)
    disable_any_whitespace: bool = False

    model_config = ConfigDict(extra="forbid", populate_by_name=True,
                              alias_generator=lambda name: "json" if name == "json_" else name,
                              json_schema_extra={"oneOf": [    # exactly one of them set
                                  {"properties": {k: _NOT_NULL}, "required": [k]}
                                  for k in ("json", "regex", "choice", "grammar")] + [
                                  {"properties": {"json_object": {"const": True}},
                                   "required": ["json_object"]},
                                  # or only the option, for response_format's JSON
                                  {"required": ["disable_any_whitespace"],
                                   "properties": {"disable_any_whitespace": {"const": True}},
                                   "not": {"anyOf": [{"required": [k]} for k in (
                                       "json", "regex", "choice", "grammar", "json_object")]}}]})

    def to_structured(self) -> Structured | None:
        """The constraint; None when only disable_any_whitespace is set (it then applies to
        response_format's or guided_json's JSON)."""
        given = {k: v for k, v in (("json_schema", self.json_), ("regex", self.regex),
                                   ("choice", self.choice), ("grammar", self.grammar),
                                   ("json_object", self.json_object or None)) if v is not None}
        if not given and self.disable_any_whitespace:
            return None
        if len(given) != 1:
            raise bad_request("structured_outputs takes exactly one of json, regex, choice, "
                              f"grammar, json_object; got {len(given)}", "structured_outputs")
        kind, value = next(iter(given.items()))
        if kind == "json_schema":
            return Structured(kind, value if isinstance(value, str)
                              else json.dumps(value, ensure_ascii=False))
        if kind == "choice":
            return Structured(kind, tuple(value))
        return Structured(kind, "" if kind == "json_object" else value)


class JsonSchemaFormat(_Strict):
    """OpenAI's json_schema response format. The schema is always enforced (a token mask), so
    `strict` may be true or absent; false, which would let the output stray from it, is
    refused."""

    name: str | None = None
    description: str | None = None
    schema_: dict | None = None
    strict: bool | None = _shaped(anyOf=[{"const": True}, _NULL])

    model_config = ConfigDict(extra="forbid", populate_by_name=True,
                              alias_generator=lambda name: "schema" if name == "schema_" else name)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def to_structured(self) -> Structured | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Structured("json_object")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema",
                              "response_format.json_schema")
        if self.json_schema.strict is False:
            raise bad_request("response_format.json_schema.strict false is not supported: "
                              "pdserve always enforces the schema; send strict true or omit it",
                              "response_format.json_schema.strict")
        return Structured("json_schema", json.dumps(self.json_schema.schema_, ensure_ascii=False))


class _CommonRequest(RequestBody):
    model: str | None = None
    max_tokens: Integer | None = _bounded(minimum=1)      # and prompt + max_tokens <= the context
    temperature: float | None = _bounded(minimum=0, maximum=2)
    top_p: float | None = _bounded(exclusiveMinimum=0, maximum=1)
    top_k: Integer | None = _bounded(minimum=-1)
    min_p: float | None = _bounded(minimum=0, maximum=1)
    seed: Integer | None = _bounded(minimum=0, exclusiveMaximum=SEED_LIMIT)   # exact as a float
    stop: Union[str, list[str], None] = _shaped(anyOf=[
        _TEXT, {"type": "array", "items": _TEXT, "maxItems": MAX_STOP_STRINGS}, _NULL])
    stop_token_ids: list[TokenId] | None = _shaped(anyOf=[
        _ids(maxItems=MAX_STOP_TOKEN_IDS), _NULL])
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    min_tokens: Integer | None = _bounded(minimum=0)        # and at most max_tokens
    n: Integer | None = _bounded(minimum=1, maximum=MAX_N)
    best_of: Integer | None = _bounded(minimum=1, maximum=MAX_N)    # and equal to n
    use_beam_search: bool = False
    length_penalty: float | None = None        # beam search only
    early_stopping: Union[bool, Literal["never"], None] = None     # beam search only
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = _bounded(maxLength=MAX_CACHE_SALT)
    presence_penalty: float | None = _bounded(minimum=-2, maximum=2)
    frequency_penalty: float | None = _bounded(minimum=-2, maximum=2)
    repetition_penalty: float | None = _bounded(exclusiveMinimum=0, maximum=2)
    logit_bias: dict[str, float] | None = _shaped(anyOf=[
        {"type": "object", "propertyNames": {"pattern": "^[0-9]+$"}, "maxProperties":
         MAX_LOGIT_BIAS, "additionalProperties": {"type": "number", "minimum": -100,
                                                  "maximum": 100}}, _NULL])
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Union[dict, str, None] = None
    guided_regex: str | None = _bounded(minLength=1, maxLength=MAX_STRUCTURED_CHARS, format="regex")
    guided_choice: list[str] | None = _shaped(anyOf=[
        {"type": "array", "items": _TEXT, "minItems": 1, "maxItems": MAX_CHOICES}, _NULL])
    guided_grammar: str | None = _bounded(minLength=1, maxLength=MAX_STRUCTURED_CHARS)
    nvext: NvExt | None = None
    return_token_ids: bool = False
    prompt_logprobs: Integer | None = _bounded(minimum=0, maximum=MAX_TOP_LOGPROBS)
    truncate_prompt_tokens: Integer | None = _bounded(minimum=-1)
    truncation_side: Literal["left", "right"] | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries its choice's usage so far (vLLM: needs include_usage too)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def nvext_fields(self) -> tuple[str, ...]:
        """What the response's nvext object carries (checked: a 400 naming an unknown one)."""
        return self.nvext.fields() if self.nvext is not None else ()

    def _check_common(self) -> None:
        self.nvext_fields()
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")
        if self.stream_options is not None:
            self.stream_options.check()
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise bad_request(f"best_of other than n is not supported, got best_of="
                              f"{self.best_of} with n={self.n or 1}", "best_of")
        if self.use_beam_search:
            self._check_beam()
        else:
            for name in ("length_penalty", "early_stopping"):
                if getattr(self, name) is not None:
                    raise bad_request(f"{name} applies to beam search: set use_beam_search",
                                      name)
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("prompt_logprobs is not available with stream=true (as in vLLM); "
                              "ask without streaming", "prompt_logprobs")

    def _check_beam(self) -> None:
        """What only REST can say of a beam search (GenerationParams checks the rest)."""
        if self.stream:
            raise bad_request("beam search does not stream (as in vLLM): its beams are known "
                              "only at the end; ask without stream", "use_beam_search")
        if self.length_penalty is not None and not math.isfinite(self.length_penalty):
            raise bad_request("length_penalty must be a finite number", "length_penalty")

    def _structured(self) -> Structured | None:
        forms = []
        if self.response_format is not None:
            st = self.response_format.to_structured()
            if st is not None:
                forms.append(("response_format", st))
        so = self.structured_outputs
        if so is not None and so.to_structured() is not None:
            forms.append(("structured_outputs", so.to_structured()))
        guided = {"guided_json": self.guided_json, "guided_regex": self.guided_regex,
                  "guided_choice": self.guided_choice, "guided_grammar": self.guided_grammar}
        for name, value in guided.items():
            if value is None:
                continue
            if name == "guided_json":
                st = Structured("json_schema", value if isinstance(value, str)
                                else json.dumps(value, ensure_ascii=False))
            elif name == "guided_choice":
                st = Structured("choice", tuple(value))
            else:
                st = Structured(name.removeprefix("guided_"), value)
            forms.append((name, st))
        if len(forms) > 1:
            raise bad_request(f"give one output constraint, not {len(forms)} ("
                              f"{', '.join(n for n, _ in forms)})", forms[1][0])
        st = forms[0][1] if forms else None
        if so is not None and so.disable_any_whitespace:
            if st is None or st.kind not in ("json_schema", "json_object"):
                raise bad_request("structured_outputs.disable_any_whitespace applies to JSON "
                                  "outputs (a JSON schema or json_object)",
                                  "structured_outputs.disable_any_whitespace")
            st = dataclasses.replace(st, compact=True)
        return st

    def _stop(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def _params(self, max_tokens: int | None, logprobs: bool, top_logprobs: int,
                aliases: tuple[tuple[str, str], ...] = (), echo: bool = False,
                structured: Structured | None = None) -> GenerationParams:
        """The request's generation parameters, checked (GatewayError 400 naming the field;
        `aliases`: GenerationParams.aliases)."""
        return GenerationParams.from_client(
            beam_search=self.use_beam_search, length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            max_tokens=max_tokens,
            temperature=0 if self.use_beam_search and self.temperature is None
            else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k, seed=self.seed, stop=self._stop(), ignore_eos=self.ignore_eos,
            logprobs=logprobs, top_logprobs=top_logprobs, n=self.n, min_p=self.min_p,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=(self.logit_bias or {}).items(), min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, echo=echo, structured=structured,
            prompt_logprobs=self.prompt_logprobs, aliases=aliases)


class CompletionRequest(_CommonRequest):
    """POST /v1/completions. `logprobs` is the number of top alternatives (0..20) per token.
    `prompt` may be a list of prompts (strings or token lists): one choice per prompt (n each)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": [
        _STREAM_OPTIONS_RULE, _TRUNCATION_RULE]})

    prompt: Union[str, list[TokenId], list[str], list[list[TokenId]]] = _shaped(..., anyOf=[
        _TEXT, _ids(minItems=1), {"type": "array", "items": _TEXT, "minItems": 1},
        {"type": "array", "items": _ids(minItems=1), "minItems": 1}])
    logprobs: Integer | None = _bounded(minimum=0, maximum=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = _bounded(maxLength=0)         # not supported

    def prompts(self) -> list[Prompt]:
        """The prompts of the request, in order (one for a string or a token list)."""
        if isinstance(self.prompt, str):
            return [Prompt(text=self.prompt)]
        if not self.prompt:
            return [Prompt(text="")]          # refused: "prompt must not be empty"
        if isinstance(self.prompt[0], int):
            return [Prompt(token_ids=tuple(self.prompt))]
        return [Prompt(text=p) if isinstance(p, str) else Prompt(token_ids=tuple(p))
                for p in self.prompt]

    def to_shared(self) -> tuple[list[Prompt], GenerationParams]:
        """The shared prompts and the checked parameters; raises GatewayError (400)."""
        self._check_common()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        lp = self.logprobs
        return self.prompts(), self._params(self.max_tokens, lp is not None, lp or 0,
                                            (("top_logprobs", "logprobs"),),
                                            echo=bool(self.echo), structured=self._structured())


class ChatCompletionRequest(_CommonRequest):
    """POST /v1/chat/completions. `logprobs` is a flag; `top_logprobs` the alternatives (0..20)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": [
        _STREAM_OPTIONS_RULE, _TRUNCATION_RULE,
        _requires({"top_logprobs": {"type": "integer", "minimum": 1}},
                  {"logprobs": {"const": True}}),
        _requires({"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}},
                  {"tools": {"type": "array", "minItems": 1}})]})

    messages: list[ChatMessage] = _bounded(..., minItems=1)
    max_completion_tokens: Integer | None = _bounded(minimum=1)
    logprobs: bool | None = False
    top_logprobs: Integer | None = _bounded(minimum=0, maximum=MAX_TOP_LOGPROBS)
    tools: list[dict] | None = _shaped(anyOf=[{"type": "array", "items": _TOOL}, _NULL])
    tool_choice: Union[str, dict, None] = _shaped(**_TOOL_CHOICE)
    parallel_tool_calls: bool | None = None

    def tool_plan(self, parser: str):
        """The request's tool calling, validated (gateway.tools.validation.ToolPlan)."""
        return check_tools(self.tools, self.tool_choice, self.parallel_tool_calls, parser)

    def to_shared(self, plan=None) -> tuple[list[Prompt], GenerationParams]:
        """`plan`: the request's tool_plan (None: no tools)."""
        self._check_common()
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs=true", "top_logprobs")
        tools = tuple(plan.template_tools) if plan is not None and plan.template_tools else None
        prompt = Prompt(messages=tuple(m.as_template_dict(i)
                                       for i, m in enumerate(self.messages)),
                        tools=tools, tool_parser=plan.parser if plan is not None else "")
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        aliases = ((("max_tokens", "max_completion_tokens"),)
                   if self.max_completion_tokens is not None else ())
        structured = self._structured()
        schema = plan.schema() if plan is not None else None
        if schema is not None:             # "required" / a named function: the call parses
            if structured is not None:
                raise bad_request("tool_choice required or a named function already constrains "
                                  "the output; drop response_format / structured_outputs",
                                  "tool_choice")
            structured = Structured("json_schema", json.dumps(schema, ensure_ascii=False))
        return [prompt], self._params(max_tokens, bool(self.logprobs), self.top_logprobs or 0,
                                      aliases, structured=structured)


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
    if kind == "invalid_unicode":
        return bad_request(err["ctx"]["message"], err["ctx"]["param"])
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
