"""The request body bound: bodies over --max-request-bytes get a 413 in OpenAI's error body
before they are parsed, with or without a Content-Length, and the app keeps serving."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from gateway.limits import BodyLimit
from gateway.openai_api import create_app
from gateway.pipeline import Pipeline
from gateway.router import Router
from tests.test_gateway_validation import MODEL, preparer  # noqa: F401

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def client(preparer):  # noqa: F811
    router = Router("redis://127.0.0.1:1/0")
    app = BodyLimit(create_app(preparer, Pipeline(router, preparer.tokenizer), router), LIMIT)
    with TestClient(app) as c:
        yield c


def _big(n: int) -> bytes:
    return b'{"model": "%s", "prompt": "%s"}' % (MODEL.encode(), b"x" * n)


def test_a_declared_length_over_the_bound_is_413_at_once(client):
    t0 = time.perf_counter()
    r = client.post("/v1/completions", content=_big(4 * LIMIT),
                    headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert time.perf_counter() - t0 < 5


def test_a_chunked_body_over_the_bound_is_413(client):
    body = _big(4 * LIMIT)
    chunks = (body[i:i + 8192] for i in range(0, len(body), 8192))
    r = client.post("/v1/completions", content=chunks,
                    headers={"content-type": "application/json"})
    assert r.status_code == 413 and str(LIMIT) in r.json()["error"]["message"]


def test_bodies_within_the_bound_are_served_chunked_or_not(client):
    small = b'{"model": "%s", "prompt": ""}' % MODEL.encode()
    for content in (small, iter([small[:10], small[10:]])):
        r = client.post("/v1/completions", content=content,
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert client.get("/health").status_code == 200
