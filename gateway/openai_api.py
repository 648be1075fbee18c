"""The OpenAI-compatible REST API (FastAPI).

    POST /v1/completions        text or token-id prompt
    POST /v1/chat/completions   messages rendered with the model's chat template
    POST /invocations           SageMaker's route: either of the two, told apart by the body
    GET  /ping                  SageMaker's health check: 200 while the app is up
    GET  /v1/models             the served model
    GET  /health                200 while the app is up, with worker counts (liveness)
    GET  /ready                 200 with a worker of each role and not draining, else 503
    GET  /metrics               Prometheus text: TTFT, inter-token and end-to-end latency, ...

Errors are OpenAI error bodies (see errors.GatewayError). A streaming request is primed: the
first Delta is awaited before the 200 is sent, so "no worker" and prefill failures still get a
proper status; errors after that become an SSE error event followed by `data: [DONE]`.
A client that disconnects aborts its request on the workers (streaming or not).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import AsyncGenerator, AsyncIterator, Awaitable, TypeVar

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.choice_text import Delta
from gateway.errors import GatewayError, bad_request
from gateway.limits import InFlight, Slots
from gateway.openai_format import OpenAIFormatter, ToolOutput
from gateway.params import PreparedRequest, RequestPreparer
from gateway.pipeline import Pipeline
from gateway.protocol import (ChatCompletionRequest, CompletionRequest, LoadLoRARequest,
                              UnloadLoRARequest, validation_error)
from gateway.router import Router
from gateway.timing import RequestTrace
from gateway.utility_api import add_utility_routes

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_BATCH_PROMPTS = 64     # prompts of one /v1/completions request


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was complete."""


def _error_response(err: GatewayError, trace: RequestTrace | None = None) -> JSONResponse:
    if trace is not None:
        trace.error = err.message
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers())


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode("utf-8")


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _race_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientDisconnected()
    return task.result()


class EventStreamResponse(StreamingResponse):
    """Server-sent events from an async generator of byte chunks.

    The generator runs alongside a watch on the connection; when the client disconnects, it is
    cancelled and closed right away (so its cleanup, e.g. aborting the workers, runs now).
    """

    def __init__(self, events: AsyncGenerator[bytes, None], on_close=None) -> None:
        """on_close() runs once the response is over, however it ended."""
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close

    async def _send_all(self, send) -> None:
        async for chunk in self._events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        stream = watch = None
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            stream = asyncio.ensure_future(self._send_all(send))
            watch = asyncio.ensure_future(_wait_disconnect(receive))
            await asyncio.wait({stream, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            tasks = [t for t in (stream, watch) if t is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._events.aclose()
            if self._on_close is not None:
                self._on_close()
        if stream is None:
            return
        if not stream.cancelled() and isinstance(stream.exception(), Exception):
            if not isinstance(stream.exception(), OSError):  # OSError: the client is gone
                raise stream.exception()


async def _merge(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """(prompt number, Delta) from several prompts' Delta streams as they come; the first error
    of any of them is raised (closing this closes them all)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for delta in only:
                yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    await queue.put((i, delta))
            await queue.put((i, done))
        except Exception as exc:          # noqa: BLE001 - handed to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _prompt_count(body: CompletionRequest | ChatCompletionRequest) -> int:
    """The requests a body makes (a list of prompts: one each), without tokenizing anything;
    GatewayError 400 past MAX_BATCH_PROMPTS."""
    prompt = getattr(body, "prompt", None)
    count = 1
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        count = len(prompt)
    if count > MAX_BATCH_PROMPTS:
        raise bad_request(f"at most {MAX_BATCH_PROMPTS} prompts per request, got {count}",
                          "prompt")
    return count


class OpenAIServer:
    """The endpoints' logic, independent of FastAPI routing."""

    def __init__(self, preparer: RequestPreparer, pipeline: Pipeline,
                 admission: InFlight | None = None) -> None:
        self.preparer = preparer
        self.pipeline = pipeline
        self.admission = admission or InFlight(0)

    def _prepare(self, body: CompletionRequest | ChatCompletionRequest, trace: RequestTrace
                 ) -> tuple[list[PreparedRequest], list[str]]:
        """The prepared requests of a body (one per prompt) and, with echo, each prompt's text."""
        plan = None
        with trace.phase("validate"):
            if isinstance(body, ChatCompletionRequest):
                plan = body.tool_plan(self.preparer.served.tool_call_parser)
                prompts, params = body.to_shared(plan)
            else:
                prompts, params = body.to_shared()
        rid = uuid.uuid4().hex
        with trace.phase("tokenize"):
            prepared = [self.preparer.prepare(p, params, body.model,
                                              rid if len(prompts) == 1 else f"{rid}-{i}",
                                              cache_salt=body.cache_salt,
                                              truncate_prompt_tokens=body.truncate_prompt_tokens,
                                              truncation_side=body.truncation_side)
                        for i, p in enumerate(prompts)]
        for p in prepared:
            trace.describe(p)
        echo = []
        if params.echo:
            tok = self.preparer.tokenizer
            # vLLM's: with return_token_ids the text leaves the prompt out (its ids say it);
            # a truncated prompt echoes what was kept; a prompt is echoed whole, its special
            # tokens too (the logprobs' offsets count them)
            echo = ["" if body.return_token_ids else
                    p.text if p.text is not None and body.truncate_prompt_tokens is None
                    else tok.decode(r.prompt_token_ids, skip_special_tokens=False)
                    for p, r in zip(prompts, prepared)]
        return prepared, echo, plan

    def _trace(self, request: Request, body: CompletionRequest | ChatCompletionRequest
               ) -> RequestTrace:
        tracing = self.pipeline.tracing
        parent = tracing.extract(request.headers.items()) if tracing.enabled else None
        wants = body.nvext is not None and "timing" in (body.nvext.extra_fields or ())
        return RequestTrace(tracing, parent, want_timing=wants)

    async def handle(self, request: Request, body: CompletionRequest | ChatCompletionRequest):
        trace = self._trace(request, body)
        try:
            return await self._handle(request, body, trace)
        finally:
            if not trace.streaming:
                trace.end()

    async def _handle(self, request: Request, body: CompletionRequest | ChatCompletionRequest,
                      trace: RequestTrace):
        try:
            with trace.phase("admission_wait"):
                slots = self.admission.take(_prompt_count(body))   # before any work: 429 at once
        except GatewayError as err:
            return _error_response(err, trace)
        streaming = False
        try:
            try:
                # templating and tokenizing a long prompt takes a while: not on the event loop
                prepared, echo, plan = await asyncio.to_thread(self._prepare, body, trace)
            except GatewayError as err:
                return _error_response(err, trace)
            tools = None
            if plan is not None and plan.mode != "none":
                tools = lambda: ToolOutput(plan)              # noqa: E731 - one per choice
            fmt = OpenAIFormatter(prepared, self.preparer.tokenizer, body.include_usage, echo,
                                  tools, token_ids=body.return_token_ids,
                                  continuous_usage=body.continuous_usage)
            deltas = _merge([self.pipeline.generate(p, trace) for p in prepared])
            nvext = body.nvext_fields()
            try:
                if body.stream:
                    first = await _race_disconnect(request, deltas.__anext__())
                    streaming = trace.streaming = True
                    return EventStreamResponse(
                        self._events(fmt, first, deltas, slots, trace, nvext),
                        on_close=lambda: (slots.release(), trace.end()))
                out = fmt.response(await _race_disconnect(request, _collect(deltas)))
                if nvext:
                    out["nvext"] = trace.nvext(nvext)
                return JSONResponse(out)
            except GatewayError as err:
                await deltas.aclose()
                return _error_response(err, trace)
            except ClientDisconnected:
                await deltas.aclose()
                log.info("client disconnected; request %s aborted", fmt.id)
                trace.error = "the client disconnected"
                return Response(status_code=499)
            except StopAsyncIteration:
                return _error_response(GatewayError("the request produced no output",
                                                    status=500), trace)
        finally:
            if not streaming:
                slots.release()

    async def _events(self, fmt: OpenAIFormatter, first: tuple[int, Delta],
                      deltas: AsyncIterator[tuple[int, Delta]], slots: Slots,
                      trace: RequestTrace, nvext: tuple[str, ...] = ()
                      ) -> AsyncIterator[bytes]:
        """The stream's events; `nvext`: what the last chunk's nvext object carries."""
        try:
            if fmt.chat:
                for chunk in fmt.role_chunks():
                    yield _sse(chunk)
            for chunk in self._chunks(fmt, first, trace, nvext):
                yield _sse(chunk)
            async for item in deltas:
                for chunk in self._chunks(fmt, item, trace, nvext):
                    yield _sse(chunk)
            if fmt.include_usage:
                usage = fmt.usage_chunk()
                if nvext:
                    usage["nvext"] = trace.nvext(nvext)
                yield _sse(usage)
        except GatewayError as err:
            log.warning("request %s failed while streaming: %s", fmt.id, err)
            trace.error = err.message
            yield _sse(err.body())
        finally:
            slots.release()
            await deltas.aclose()
            trace.end()
        yield _sse("[DONE]")

    @staticmethod
    def _chunks(fmt: OpenAIFormatter, item: tuple[int, Delta], trace: RequestTrace,
                nvext: tuple[str, ...]) -> list[dict]:
        """A Delta's chunks; the request's last one (no usage chunk to follow) carries nvext."""
        chunks = fmt.delta_chunks(item[1], item[0])
        if nvext and chunks and not fmt.include_usage and fmt.finished():
            chunks[-1]["nvext"] = trace.nvext(nvext)
        return chunks


async def _collect(deltas: AsyncIterator[tuple[int, Delta]]) -> list[tuple[int, Delta]]:
    async with contextlib.aclosing(deltas):
        return [d async for d in deltas]


def create_app(preparer: RequestPreparer, pipeline: Pipeline, router: Router,
               admission: InFlight | None = None) -> FastAPI:
    """The FastAPI app of the gateway. Validation never reaches a worker."""
    app = FastAPI(title="pdserve gateway", docs_url=None, redoc_url=None)
    server = OpenAIServer(preparer, pipeline, admission)
    served = preparer.served
    started = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        return _error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        code = "not_found" if exc.status_code == 404 else None
        err = GatewayError(str(exc.detail), status=exc.status_code, code=code)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest):
        return await server.handle(request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest):
        return await server.handle(request, body)

    @app.post("/invocations")
    async def invocations(request: Request):
        """SageMaker hosting's one inference route: a body with "messages" is a chat completion
        request, one with "prompt" a completion request; each is answered as on /v1."""
        raw = await request.body()
        try:
            fields = json.loads(raw)
        except ValueError:
            fields = None                 # the model's own parse below names the JSON error
        kind = (ChatCompletionRequest if isinstance(fields, dict) and "messages" in fields else
                CompletionRequest if isinstance(fields, dict) and "prompt" in fields else None)
        if fields is not None and kind is None:
            return _error_response(bad_request(
                'an /invocations body is a chat completion request (with "messages") or a '
                'completion request (with "prompt")'))
        try:
            body = (kind or CompletionRequest).model_validate_json(raw)
        except pydantic.ValidationError as exc:
            return _error_response(validation_error(list(exc.errors())))
        return await server.handle(request, body)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        body, content_type = pipeline.metrics.exposition()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        base = {"id": served.name, "object": "model", "created": started, "owned_by": "pdserve",
                "root": served.name, "parent": None, "max_model_len": served.max_model_len}
        adapters = [dict(base, id=name, root=name, parent=served.name)
                    for name in sorted(pipeline.loras.names())]
        return {"object": "list", "data": [base, *adapters]}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest):
        if body.lora_name == served.name:
            return _error_response(bad_request(f"`{served.name}` is the base model's name",
                                               "lora_name"))
        if body.lora_name in pipeline.loras.names():
            return _error_response(bad_request(f"The LoRA adapter `{body.lora_name}` is "
                                               "already loaded; unload it first", "lora_name"))
        try:
            await pipeline.loras.load(body.lora_name, body.lora_path)
        except GatewayError as exc:
            return _error_response(exc)
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                        media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest):
        try:
            await pipeline.loras.unload(body.lora_name)
        except GatewayError as exc:
            return _error_response(exc)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.",
                        media_type="text/plain")

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": served.name, "workers": router.counts()}

    app.state.draining = False          # set by gateway.server on SIGTERM

    @app.get("/ready")
    async def ready():
        counts = router.counts()
        missing = [r for r in ("prefill", "decode") if not counts.get(r)]
        why = ("draining" if app.state.draining else
               f"no {' and no '.join(missing)} worker registered" if missing else "")
        body = {"status": why or "ready", "model": served.name, "workers": counts}
        return JSONResponse(body, status_code=503 if why else 200)

    add_utility_routes(app, preparer)     # /tokenize, /detokenize, /version
    return app
