"""The public gRPC API: `pdserve.v1.Generation/Generate` (server streaming) and grpc.health.v1.

Validation is the REST API's (params.RequestPreparer), mapped to status codes: INVALID_ARGUMENT
for bad input (same messages), NOT_FOUND for an unknown model, UNAVAILABLE when no worker is
registered or one is unreachable.

Proto3 scalars cannot be "unset", so in SamplingParams: temperature 0 means greedy (the default
of an empty message), top_p 0 means 1 (off), top_k 0 means off; max_tokens must be set (>= 1);
seed is optional (a random one is chosen when absent).
"""

from __future__ import annotations

import contextlib
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.errors import GatewayError, bad_request
from gateway.params import PreparedRequest, Prompt, RawParams, RequestPreparer
from gateway.pipeline import Delta, Pipeline
from proto import pdserve_pb2, pdserve_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Generation"


def request_to_shared(request: pdserve_pb2.GenerateRequest) -> tuple[Prompt, RawParams]:
    """The shared prompt and raw parameters of a GenerateRequest (see the module docstring)."""
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
    raw = RawParams(max_tokens=p.max_tokens, temperature=p.temperature,
                    top_p=p.top_p or None, top_k=p.top_k,
                    seed=p.seed if p.HasField("seed") else None, stop=tuple(p.stop),
                    ignore_eos=p.ignore_eos, logprobs=p.logprobs, top_logprobs=p.top_logprobs,
                    cache_salt=request.cache_salt or None)
    return prompt, raw


def _response(prepared: PreparedRequest, delta: Delta) -> pdserve_pb2.GenerateResponse:
    out = pdserve_pb2.GenerateResponse(
        request_id=prepared.request_id, token_ids=delta.token_ids, text=delta.text,
        finish_reason=delta.finish_reason or "")
    for lp in delta.logprobs:
        out.logprobs.add(token_id=lp.token_id, logprob=lp.logprob,
                         top=[pdserve_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
    if delta.finish_reason:
        out.usage.prompt_tokens = prepared.num_prompt_tokens
        out.usage.completion_tokens = delta.completion_tokens
    return out


class GenerationServicer(pdserve_pb2_grpc.GenerationServicer):
    """Generate: one GenerateResponse per Delta; the last carries finish_reason and usage.
    A cancelled call aborts the request on the workers."""

    def __init__(self, preparer: RequestPreparer, pipeline: Pipeline) -> None:
        self.preparer = preparer
        self.pipeline = pipeline

    async def Generate(self, request, context):
        try:
            prompt, raw = request_to_shared(request)
            prepared = self.preparer.prepare(prompt, raw, request.model or None,
                                             request.request_id or None)
        except GatewayError as err:
            await context.abort(err.grpc_code(), err.message)
        async with contextlib.aclosing(self.pipeline.generate(prepared)) as deltas:
            try:
                async for delta in deltas:
                    yield _response(prepared, delta)
            except GatewayError as err:
                log.warning("request %s failed: %s", prepared.request_id, err)
                await context.abort(err.grpc_code(), err.message)


async def add_services(server: grpc.aio.Server, preparer: RequestPreparer,
                       pipeline: Pipeline) -> health.aio.HealthServicer:
    """Register Generation and the health service (SERVING for "" and Generation)."""
    pdserve_pb2_grpc.add_GenerationServicer_to_server(
        GenerationServicer(preparer, pipeline), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return health_servicer
