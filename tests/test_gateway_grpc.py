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
from gateway.wire import sampling_int_fields
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

MODEL = "smol-test"
NOWHERE = "redis://127.0.0.1:1/0"


@pytest.fixture(scope="module")
def preparer(model_dir):
    return RequestPreparer(Tokenizer(model_dir), ServedModel(MODEL, 64))


async def _generate_errors(preparer, requests: list[pb.GenerateRequest | bytes]):
    """Run a real grpc.aio server; return (code, details) of each request (a message, or bytes
    sent as they are), health statuses."""
    router = Router(NOWHERE)
    server = grpc.aio.server()
    await add_services(server, preparer, Pipeline(router, preparer.tokenizer))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            raw = channel.unary_stream(f"/{SERVICE_NAME}/Generate")
            out = []
            for req in requests:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    async for _ in (raw if isinstance(req, bytes) else stub.Generate)(
                            req, timeout=10):
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
    # a field that would change nothing is refused by name, as on REST
    (_req(truncation_side="right"), {"prompt": "Hello", "truncation_side": "right"},
     grpc.StatusCode.INVALID_ARGUMENT),
    (_req(pb.SamplingParams(max_tokens=4, beam_width=2, seed=7)),
     {"prompt": "Hello", "use_beam_search": True, "n": 2, "seed": 7},
     grpc.StatusCode.INVALID_ARGUMENT),
    (_req(truncate_prompt_tokens=2, truncation_side="right"), None,
     grpc.StatusCode.UNAVAILABLE),
    (_req(pb.SamplingParams(max_tokens=4, beam_width=2)), None, grpc.StatusCode.UNAVAILABLE),
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
    said = {details for _, details in results}
    assert any(d.startswith("truncation_side applies to truncate_prompt_tokens") for d in said)
    assert any(d.startswith("seed does not apply to beam search") for d in said)


def _undecodable(text: bytes) -> bytes:
    """A GenerateRequest whose prompt text is TEXT's bytes as they are (a client library
    refuses to encode a string that is not UTF-8; the wire does not)."""
    wire = _req(text="PLACEHOLDER").SerializeToString()
    assert wire.count(b"\x12\x0bPLACEHOLDER") == 1 and len(text) <= 127   # field 2, 11 bytes
    return wire.replace(b"\x12\x0bPLACEHOLDER", b"\x12" + bytes([len(text)]) + text)


def test_a_string_that_is_not_utf8_is_invalid_argument_and_serving_goes_on(preparer):
    """The proto parser refuses it (a lone surrogate's bytes, or any non-UTF-8): the servicer
    answers INVALID_ARGUMENT with the reason, not grpc's UNKNOWN; the next request is served
    (UNAVAILABLE: no worker here) and health stays SERVING."""
    bad = [_undecodable(b"\xed\xa0\x80"), _undecodable(b"ok \xff"), b"\xff\xff\xff"]
    results, statuses = asyncio.run(_generate_errors(preparer, [*bad, _req()]))
    for code, details in results[:2]:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, details
        assert "UTF-8" in details and "GenerateRequest" in details
    assert results[2][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert results[3][0] == grpc.StatusCode.UNAVAILABLE, results[3]
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 2


def _at_bounds() -> list[tuple[str, int]]:
    """Every integer field of SamplingParams at its wire type's least and greatest value."""
    return [(name, v) for name, (_, lo, hi) in sampling_int_fields().items() for v in (lo, hi)]


def test_integers_at_their_wire_bounds_are_checked_not_internal_errors(preparer):
    """gRPC integers cannot leave their type (the parser truncates a varint to the field's
    width), so the bounds of each type are the extreme inputs: each is INVALID_ARGUMENT or
    passes validation (UNAVAILABLE: no worker), never UNKNOWN or INTERNAL."""
    def request(name: str, v: int) -> pb.GenerateRequest:
        params = pb.SamplingParams(max_tokens=4)
        field = getattr(params, name)
        if isinstance(field, int):
            setattr(params, name, v)
        else:
            field.append(v)
        return _req(params)
    cases = _at_bounds()
    results, _ = asyncio.run(_generate_errors(preparer, [request(*c) for c in cases]))
    for (name, v), (code, details) in zip(cases, results):
        assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNAVAILABLE), \
            (name, v, code, details)
    got = dict(zip(cases, (c for c, _ in results)))
    assert got[("top_k", 2 ** 31 - 1)] == grpc.StatusCode.UNAVAILABLE      # off past the vocab
    assert got[("top_k", -2 ** 31)] == grpc.StatusCode.INVALID_ARGUMENT
