"""The public gRPC front door: same validation as REST (same messages), status codes, health."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fastapi.testclient import TestClient
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.grpc_api import SERVICE_NAME, add_services
from gateway.openai_api import create_app
from gateway.params import RequestPreparer, ServedModel
from gateway.pipeline import Pipeline
from gateway.router import Router
from gateway.tokenizer import Tokenizer
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

MODEL = "smol-test"
NOWHERE = "redis://127.0.0.1:1/0"


@pytest.fixture(scope="module")
def preparer(model_dir):
    return RequestPreparer(Tokenizer(model_dir), ServedModel(MODEL, 64))


async def _generate_errors(preparer, requests: list[pb.GenerateRequest]):
    """Run a real grpc.aio server; return (code, details) of each request, health statuses."""
    router = Router(NOWHERE)
    server = grpc.aio.server()
    await add_services(server, preparer, Pipeline(router, preparer.tokenizer))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            out = []
            for req in requests:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in stub.Generate(req, timeout=10):
                        pass
                out.append((info.value.code(), info.value.details()))
            health = health_pb2_grpc.HealthStub(channel)
            statuses = [(await health.Check(health_pb2.HealthCheckRequest(service=name))).status
                        for name in ("", SERVICE_NAME)]
        return out, statuses
    finally:
        await server.stop(None)
        await router.stop()


def _req(params=None, **kw) -> pb.GenerateRequest:
    kw.setdefault("text", "Hello")
    return pb.GenerateRequest(params=params or pb.SamplingParams(max_tokens=4), **kw)


CASES = [
    # (gRPC request, equivalent REST completion body or None, expected code)
    (_req(text=""), {"prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(params=pb.SamplingParams(max_tokens=4)), {"prompt": ""},
     grpc.StatusCode.INVALID_ARGUMENT),
    (_req(pb.SamplingParams()), {"prompt": "Hello", "max_tokens": 0},
     grpc.StatusCode.INVALID_ARGUMENT),
    (_req(text=None, token_ids=pb.TokenIds(ids=[5, 49152])), {"prompt": [5, 49152]},
     grpc.StatusCode.INVALID_ARGUMENT),
    (_req(pb.SamplingParams(temperature=3.0)), {"prompt": "Hello", "temperature": 3.0},
     grpc.StatusCode.INVALID_ARGUMENT),
    (_req(pb.SamplingParams(max_tokens=4, top_p=1.5)), {"prompt": "Hello", "top_p": 1.5},
     grpc.StatusCode.INVALID_ARGUMENT),
    (_req(pb.SamplingParams(max_tokens=4, top_k=-3)), {"prompt": "Hello", "top_k": -3},
     grpc.StatusCode.INVALID_ARGUMENT),
    (_req(pb.SamplingParams(max_tokens=100)), {"prompt": "Hello", "max_tokens": 100},
     grpc.StatusCode.INVALID_ARGUMENT),
    (_req(pb.SamplingParams(max_tokens=4, logprobs=True, top_logprobs=30)), None,
     grpc.StatusCode.INVALID_ARGUMENT),
    (_req(pb.SamplingParams(max_tokens=4, stop=["a"] * 17)),
     {"prompt": "Hello", "stop": ["a"] * 17},
     grpc.StatusCode.INVALID_ARGUMENT),
    (_req(text=None, chat=pb.ChatMessages()), None, grpc.StatusCode.INVALID_ARGUMENT),
    (_req(model="gpt-4"), {"prompt": "Hello", "model": "gpt-4"}, grpc.StatusCode.NOT_FOUND),
    (_req(), None, grpc.StatusCode.UNAVAILABLE),
    (_req(text=None, chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="Hi")])),
     None, grpc.StatusCode.UNAVAILABLE),
]


def test_generate_validation_matches_rest(preparer):
    results, statuses = asyncio.run(_generate_errors(preparer, [c[0] for c in CASES]))
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 2
    router = Router(NOWHERE)
    with TestClient(create_app(preparer, Pipeline(router, preparer.tokenizer), router)) as rest:
        for (req, body, code), (got_code, details) in zip(CASES, results):
            assert got_code == code, (req, details)
            if body is not None:
                rest_msg = rest.post("/v1/completions", json=body).json()["error"]["message"]
                assert details == rest_msg
    assert "no decode worker is available" in results[-1][1]
    assert "messages must not be empty" in results[-4][1]
