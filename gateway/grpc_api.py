"""The public gRPC API: `pdserve.v1.Generation/Generate` (server streaming) and grpc.health.v1.

Validation is the REST API's (params.GenerationParams.from_client, RequestPreparer), mapped
to status codes: INVALID_ARGUMENT for bad input (same messages; a message the proto parser
refuses, e.g. a string that is not UTF-8, too), NOT_FOUND for an unknown model, UNAVAILABLE
when no worker is registered or one is unreachable.

Proto3 scalars cannot be "unset", so in SamplingParams: temperature 0 means greedy (the default
of an empty message), top_p 0 means 1 (off), top_k 0 means off; max_tokens must be set (>= 1);
seed is optional (a random one is chosen when absent); repetition_penalty and
skip_special_tokens are optional (1 and true when absent); n 0 means 1. With n > 1 each
response carries its choice's `index`; the usage is on the last one (with its cached_tokens),
and with continuous_usage on every one (its choice's so far). truncate_prompt_tokens /
truncation_side cut the prompt as on REST; return_prompt_token_ids puts the prompt's ids on each
choice's first response.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.sampling_limits import EARLY_STOPPING
from gateway.choice_text import Delta
from gateway.errors import GatewayError, bad_request
from gateway.limits import InFlight
from gateway.params import (GenerationParams, PreparedRequest, Prompt, RequestPreparer,
                            Structured)
from gateway.pipeline import Pipeline
from gateway.timing import RequestTrace
from gateway.wire import Undecodable, parse_lenient
from proto import pdserve_pb2, pdserve_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Generation"


def request_to_shared(request: pdserve_pb2.GenerateRequest
                      ) -> tuple[Prompt, GenerationParams]:
    """The shared prompt and the checked parameters of a GenerateRequest (see the module
    docstring); GatewayError 400 naming the field."""
    which = request.WhichOneof("prompt")
    if which == "text":
        prompt = Prompt(text=request.text)
    elif which == "token_ids":
        prompt = Prompt(token_ids=tuple(request.token_ids.ids))
    elif which == "chat":
        prompt = Prompt(messages=tuple({"role": m.role, "content": m.content}
                                       for m in request.chat.messages))
    else:
        raise bad_request("prompt must not be empty", "prompt")
    p = request.params
    params = GenerationParams.from_client(
        max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p or None,
        top_k=p.top_k, seed=p.seed if p.HasField("seed") else None, stop=tuple(p.stop),
        ignore_eos=p.ignore_eos, logprobs=p.logprobs, top_logprobs=p.top_logprobs,
        n=_beam_n(p), min_p=p.min_p, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else None,
        logit_bias=sorted(p.logit_bias.items()), min_tokens=p.min_tokens,
        stop_token_ids=tuple(p.stop_token_ids),
        include_stop_str_in_output=p.include_stop_str_in_output,
        skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else None,
        echo=request.echo, structured=_structured(p),
        prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None,
        beam_search=p.beam_width > 0,
        length_penalty=p.length_penalty if p.HasField("length_penalty") else None,
        early_stopping=_early_stopping(p.early_stopping) if p.beam_width else None)
    if not p.beam_width and (p.HasField("length_penalty") or p.early_stopping):
        raise bad_request("length_penalty and early_stopping apply to beam search: set "
                          "beam_width", "length_penalty")
    return prompt, params


def _beam_n(p: pdserve_pb2.SamplingParams) -> int | None:
    """n, which a beam search's width sets (n 0 or equal to it)."""
    if p.beam_width and p.n and p.n != p.beam_width:
        raise bad_request(f"n is a beam search's width: give n={p.beam_width} or leave it 0, "
                          f"got n={p.n}", "n")
    return p.beam_width or p.n or None


def _early_stopping(text: str) -> bool | str:
    if text not in EARLY_STOPPING:
        raise bad_request(f"early_stopping must be true, false or never, got {text!r}",
                          "early_stopping")
    return EARLY_STOPPING[text]


def _structured(p: pdserve_pb2.SamplingParams) -> Structured | None:
    if not p.HasField("structured"):
        return None
    which = p.structured.WhichOneof("kind")
    if which is None:
        return None
    compact = p.structured.compact_json
    if which == "json_object":
        return Structured("json_object", compact=compact)
    if which == "choice":
        return Structured("choice", tuple(p.structured.choice.choices))
    return Structured(which, getattr(p.structured, which),
                      compact=compact and which == "json_schema")


def _response(prepared: PreparedRequest, delta: Delta, text: str, used: dict[int, int],
              finished: set[int], trace: RequestTrace, request: pdserve_pb2.GenerateRequest
              ) -> pdserve_pb2.GenerateResponse:
    """`used`: completion tokens per choice so far, `finished`: choices done (both updated
    here); the usage (and the timing, when asked for) goes on the last response of the
    request (every choice finished), and on every one with continuous_usage (its choice's)."""
    out = pdserve_pb2.GenerateResponse(
        request_id=prepared.public_id, token_ids=delta.token_ids, text=text,
        finish_reason=delta.finish_reason or "", index=delta.index)
    if request.return_prompt_token_ids and delta.index not in used:
        out.prompt_token_ids.extend(prepared.prompt_token_ids)
    for lp in delta.logprobs:
        out.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                         top=[pdserve_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
    for lp in delta.prompt_logprobs or ():
        out.prompt_logprobs.add(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank or 0,
                                top=[pdserve_pb2.TopLogprob(token_id=t, logprob=v)
                                     for t, v in lp.top])
    used[delta.index] = delta.completion_tokens
    if request.continuous_usage:
        out.usage.prompt_tokens = prepared.num_prompt_tokens
        out.usage.completion_tokens = delta.completion_tokens
    if delta.finish_reason:
        finished.add(delta.index)
        if len(finished) == prepared.params.n:
            out.usage.prompt_tokens = prepared.num_prompt_tokens
            out.usage.completion_tokens = sum(used.values())
            out.usage.cached_tokens = delta.cached_tokens or 0
            if trace.want_timing:
                out.timing.CopyFrom(trace.to_proto())
    return out


class GenerationServicer(pdserve_pb2_grpc.GenerationServicer):
    """Generate: one GenerateResponse per Delta; the last carries finish_reason and usage.
    A cancelled call aborts the request on the workers."""

    def __init__(self, preparer: RequestPreparer, pipeline: Pipeline,
                 admission: InFlight | None = None) -> None:
        self.preparer = preparer
        self.pipeline = pipeline
        self.admission = admission or InFlight(0)

    async def Generate(self, request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request is not a "
                                "GenerateRequest the proto parser accepts (string fields must "
                                f"be UTF-8): {request.reason}")
        tracing = self.pipeline.tracing
        parent = tracing.extract(context.invocation_metadata() or ()) if tracing.enabled else None
        trace = RequestTrace(tracing, parent, want_timing=request.return_timing)
        try:
            async with contextlib.aclosing(self._generate(request, context, trace)) as outs:
                async for out in outs:
                    yield out
        finally:
            trace.end()

    async def LoRA(self, request, context):
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not a LoRARequest: "
                                f"{request.reason}")
        loras = self.pipeline.loras
        served = self.preparer.served.name
        try:
            if not request.name or request.name == served:
                raise GatewayError(f"a LoRA adapter's name must be set and not the base model's "
                                   f"(`{served}`)", param="name")
            if request.path:
                if request.name in loras.names():
                    raise GatewayError(f"The LoRA adapter `{request.name}` is already loaded; "
                                       "unload it first", param="name")
                await loras.load(request.name, request.path)
            else:
                await loras.unload(request.name)
        except GatewayError as err:
            await abort(context, err)
        return pdserve_pb2.LoRAReply(loaded=sorted(loras.names()))

    async def _prepare(self, request, context, trace: RequestTrace
                       ) -> tuple[Prompt, PreparedRequest]:
        try:
            with trace.phase("validate"):
                prompt, params = request_to_shared(request)
            with trace.phase("tokenize"):
                # templating and tokenizing a long prompt takes a while: not on the event loop
                keep = (request.truncate_prompt_tokens
                        if request.HasField("truncate_prompt_tokens") else None)
                prepared = await asyncio.to_thread(
                    self.preparer.prepare, prompt, params, request.model or None,
                    client_request_id=request.request_id, cache_salt=request.cache_salt,
                    truncate_prompt_tokens=keep, truncation_side=request.truncation_side or None)
        except GatewayError as err:
            await abort(context, err, trace)
        trace.describe(prepared)
        return prompt, prepared

    async def _generate(self, request, context, trace: RequestTrace):
        try:
            with trace.phase("admission_wait"):
                slots = self.admission.take()     # before any work: 429s come at once
        except GatewayError as err:
            await abort(context, err, trace)
        try:
            prompt, prepared = await self._prepare(request, context, trace)
            echo = ""
            if prepared.params.echo:
                truncated = request.HasField("truncate_prompt_tokens")
                echo = prompt.text if prompt.text is not None and not truncated else \
                    self.preparer.tokenizer.decode(prepared.prompt_token_ids,
                                                   skip_special_tokens=False)
            echoed: set[int] = set()
            used: dict[int, int] = {}
            finished: set[int] = set()
            async with contextlib.aclosing(self.pipeline.generate(prepared, trace)) as deltas:
                try:
                    async for delta in deltas:
                        text = delta.text
                        if echo and delta.index not in echoed:
                            echoed.add(delta.index)
                            text = echo + text
                        yield _response(prepared, delta, text, used, finished, trace, request)
                except GatewayError as err:
                    log.warning("request %s (client id %r) failed: %s", prepared.request_id,
                                prepared.client_request_id, err)
                    await abort(context, err, trace)
        finally:
            slots.release()


async def abort(context, err: GatewayError, trace: RequestTrace | None = None) -> None:
    """End the call with the error's status; a retry_after goes in the trailing metadata."""
    if trace is not None:
        trace.error = err.message
    if err.retry_after is not None:
        context.set_trailing_metadata((("retry-after", err.headers()["Retry-After"]),))
    await context.abort(err.grpc_code(), err.message)


async def add_services(server: grpc.aio.Server, preparer: RequestPreparer,
                       pipeline: Pipeline, admission: InFlight | None = None
                       ) -> health.aio.HealthServicer:
    """Register Generation and the health service (SERVING for "" and Generation). Generation's
    requests are parsed leniently (wire.parse_lenient): an undecodable one is INVALID_ARGUMENT."""
    servicer = GenerationServicer(preparer, pipeline, admission)
    handlers = {"Generate": grpc.unary_stream_rpc_method_handler(
        servicer.Generate, request_deserializer=parse_lenient(pdserve_pb2.GenerateRequest),
        response_serializer=pdserve_pb2.GenerateResponse.SerializeToString),
        "LoRA": grpc.unary_unary_rpc_method_handler(
            servicer.LoRA, request_deserializer=parse_lenient(pdserve_pb2.LoRARequest),
            response_serializer=pdserve_pb2.LoRAReply.SerializeToString)}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME,
                                                                          handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return health_servicer
