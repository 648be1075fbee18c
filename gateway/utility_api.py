"""Small endpoints that vLLM users script against, beside the OpenAI API (same shapes as vLLM's):

    POST /tokenize     a prompt, or messages rendered with the chat template -> token ids
    POST /detokenize   token ids -> text
    GET  /version      pdserve's package version

Errors are OpenAI error bodies (errors.GatewayError) naming the field: 400 for bad input, 404 for
an unknown model. Unknown fields are refused, as in protocol.py. Nothing here reaches a worker.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any, TypeVar

from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, ValidationError

from gateway.chat_template import ChatTemplateError
from gateway.errors import GatewayError, bad_request
from gateway.params import RequestPreparer
from gateway.protocol import ChatMessage, RequestBody, TokenId, validation_error

FALLBACK_VERSION = "0.1.0"

M = TypeVar("M", bound=BaseModel)


class _TokenizeBase(RequestBody):
    model: str | None = None
    return_token_strs: bool = False


class TokenizeCompletionRequest(_TokenizeBase):
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_TokenizeBase):
    messages: list[ChatMessage] = Field(json_schema_extra={"minItems": 1})
    add_generation_prompt: bool = True
    add_special_tokens: bool = False      # the chat template already holds them


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId] = Field(json_schema_extra={"items": {"type": "integer",
                                                               "minimum": 0}})


def package_version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        return FALLBACK_VERSION


def _parse(model: type[M], body: dict[str, Any]) -> M:
    """The body as MODEL; GatewayError (400 naming the field) as the app's validation handler
    would give."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


def _inline(schema: Any, defs: dict) -> Any:
    """SCHEMA with its `#/$defs/NAME` references replaced by the definitions themselves."""
    if isinstance(schema, list):
        return [_inline(s, defs) for s in schema]
    if not isinstance(schema, dict):
        return schema
    ref = schema.get("$ref", "")
    if ref.startswith("#/$defs/"):
        return _inline(defs[ref.removeprefix("#/$defs/")], defs)
    return {k: _inline(v, defs) for k, v in schema.items() if k != "$defs"}


def _documented_body(*models: type[BaseModel]) -> dict:
    """`openapi_extra` stating that a route's body is one of MODELS: the route takes a plain dict
    and picks the model itself (so its errors name the field), and FastAPI would describe that
    as any object."""
    schemas = [m.model_json_schema() for m in models]
    one = [_inline(s, s.get("$defs", {})) for s in schemas]
    body = one[0] if len(one) == 1 else {"anyOf": one}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}}


def _error(err: GatewayError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


class UtilityServer:
    """The endpoints' logic, independent of FastAPI routing; each raises GatewayError."""

    def __init__(self, preparer: RequestPreparer) -> None:
        self.preparer = preparer
        self.tokenizer = preparer.tokenizer

    def tokenize(self, body: dict[str, Any]) -> dict:
        """vLLM's /tokenize: `prompt` (a completion's text) or `messages` (a chat)."""
        if "messages" in body and "prompt" in body:
            raise bad_request("give either prompt or messages, not both", "messages")
        if "messages" in body:
            chat = _parse(TokenizeChatRequest, body)
            self.preparer.check_model(chat.model)
            ids = self._chat_ids(chat)
            want_strs = chat.return_token_strs
        else:
            req = _parse(TokenizeCompletionRequest, body)
            self.preparer.check_model(req.model)
            ids = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            want_strs = req.return_token_strs
        return {"count": len(ids), "max_model_len": self.preparer.served.max_model_len,
                "tokens": ids,
                "token_strs": [self.tokenizer.token_text(t) for t in ids] if want_strs else None}

    def _chat_ids(self, chat: TokenizeChatRequest) -> list[int]:
        if not chat.messages:
            raise bad_request("messages must not be empty", "messages")
        messages = [m.as_template_dict(i) for i, m in enumerate(chat.messages)]
        try:
            text = self.tokenizer.render_chat(messages,
                                              add_generation_prompt=chat.add_generation_prompt)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), exc.param) from exc
        return self.tokenizer.encode(text, add_special_tokens=chat.add_special_tokens)

    def detokenize(self, body: dict[str, Any]) -> dict:
        """vLLM's /detokenize: the text of the ids, special tokens included."""
        req = _parse(DetokenizeRequest, body)
        self.preparer.check_model(req.model)
        vocab = self.tokenizer.vocab_size
        for pos, tok in enumerate(req.tokens):
            if not 0 <= tok < vocab:
                raise bad_request(f"token id {tok} at position {pos} is out of the vocabulary "
                                  f"range [0, {vocab})", "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens, skip_special_tokens=False)}


def add_utility_routes(app: FastAPI, preparer: RequestPreparer) -> None:
    """Register POST /tokenize, POST /detokenize and GET /version on APP. A body that is not a
    JSON object is refused by the app's validation handler (openai_api.create_app's)."""
    server = UtilityServer(preparer)
    version = package_version()

    @app.post("/tokenize",
              openapi_extra=_documented_body(TokenizeCompletionRequest, TokenizeChatRequest))
    async def tokenize(body: dict = Body(...)):
        try:
            return server.tokenize(body)
        except GatewayError as err:
            return _error(err)

    @app.post("/detokenize", openapi_extra=_documented_body(DetokenizeRequest))
    async def detokenize(body: dict = Body(...)):
        try:
            return server.detokenize(body)
        except GatewayError as err:
            return _error(err)

    @app.get("/version")
    async def get_version():
        return {"version": version}
