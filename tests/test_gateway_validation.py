"""Request validation of the REST front door: every bad input is a 400 (404 for an unknown model)
with an OpenAI error body, and never reaches a worker (there are none here: a valid request gets
503 "no decode worker is available")."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from gateway.openai_api import create_app
from gateway.params import Prompt, RawParams, RequestPreparer, ServedModel
from gateway.pipeline import Pipeline
from gateway.router import Router
from gateway.tokenizer import Tokenizer

MODEL = "smol-test"
MAX_LEN = 64
NOWHERE = "redis://127.0.0.1:1/0"  # never contacted: the router is not started


@pytest.fixture(scope="module")
def preparer(model_dir):
    return RequestPreparer(Tokenizer(model_dir), ServedModel(MODEL, MAX_LEN))


@pytest.fixture(scope="module")
def client(preparer):
    router = Router(NOWHERE)
    app = create_app(preparer, Pipeline(router, preparer.tokenizer), router)
    with TestClient(app) as c:
        yield c


def _completion(**fields):
    return {"model": MODEL, "prompt": "Hello", **fields}


def _chat(**fields):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], **fields}


def _assert_error(resp, status: int, param=None, contains: str = ""):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param
    assert contains in err["message"]
    return err


BAD_COMPLETIONS = [
    (dict(prompt=""), "prompt", "must not be empty"),
    (dict(prompt=[]), "prompt", "must not be empty"),
    (dict(prompt=["a", ""]), "prompt", "must not be empty"),
    (dict(prompt=[[1, 2], [49152]]), "prompt", "token id 49152 at position 0"),
    (dict(prompt=["x"] * 65), "prompt", "at most 64 prompts"),
    (dict(prompt=[1, 49152]), "prompt", "token id 49152 at position 1"),
    (dict(prompt=[-1]), "prompt", "out of the vocabulary range"),
    (dict(max_tokens=0), "max_tokens", "at least 1"),
    (dict(max_tokens=-5), "max_tokens", "at least 1"),
    (dict(temperature=-0.1), "temperature", "between 0 and 2"),
    (dict(temperature=2.5), "temperature", "between 0 and 2"),
    (dict(temperature="hot"), "temperature", ""),
    (dict(top_p=0), "top_p", "(0, 1]"),
    (dict(top_p=1.5), "top_p", "(0, 1]"),
    (dict(top_k=-2), "top_k", "-1 or 0"),
    (dict(n=0), "n", "between 1 and 16"),
    (dict(n=17), "n", "between 1 and 16"),
    (dict(best_of=3), "best_of", "best_of other than n"),
    (dict(use_beam_search=True), "use_beam_search", "not supported"),
    (dict(suffix="x"), "suffix", "not supported"),
    (dict(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
    (dict(frequency_penalty=-3), "frequency_penalty", "[-2, 2]"),
    (dict(repetition_penalty=0), "repetition_penalty", "(0, 2]"),
    (dict(repetition_penalty=2.5), "repetition_penalty", "(0, 2]"),
    (dict(min_p=1.5), "min_p", "[0, 1]"),
    (dict(min_tokens=-1), "min_tokens", ">= 0"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens", "must not exceed"),
    (dict(logit_bias={"abc": 1}), "logit_bias", "token ids"),
    (dict(logit_bias={"49152": 1}), "logit_bias", "out of the vocabulary"),
    (dict(logit_bias={"5": 101}), "logit_bias", "[-100, 100]"),
    (dict(stop_token_ids=[49152]), "stop_token_ids", "out of the vocabulary"),
    (dict(echo=True, logprobs=2), "echo", "echo with logprobs"),
    (dict(stream_options={"include_usage": True}), "stream_options", "only allowed when stream"),
    (dict(structured_outputs={"regex": "a+", "choice": ["a"]}), "structured_outputs",
     "exactly one"),
    (dict(structured_outputs={"choice": []}), "structured_outputs", "non-empty list"),
    (dict(structured_outputs={"json": "{not json"}), "structured_outputs", "not valid JSON"),
    (dict(structured_outputs={"regex": "a"}, guided_regex="b"), "guided_regex",
     "one output constraint"),
    (dict(structured_outputs={"regex": "a" * 70000}), "structured_outputs", "at most 65536"),
    (dict(structured_outputs={"choice": [str(i) for i in range(1100)]}), "structured_outputs",
     "at most 1024 choices"),
    (dict(structured_outputs={"whitespace_pattern": "x"}),
     "structured_outputs.whitespace_pattern", "unrecognized"),
    (dict(logprobs=21), "logprobs", "between 0 and 20"),
    (dict(logprobs=-1), "logprobs", "between 0 and 20"),
    (dict(stop=["x"] * 17), "stop", "at most 16"),
    (dict(stop=[""]), "stop", "must not be empty"),
    (dict(seed=-1), "seed", "seed"),
    (dict(foo=1), "foo", "unrecognized request argument: foo"),
    (dict(stream_options={"bogus": True}), "stream_options.bogus", "unrecognized"),
]


@pytest.mark.parametrize("fields,param,contains", BAD_COMPLETIONS)
def test_bad_completion_requests(client, fields, param, contains):
    _assert_error(client.post("/v1/completions", json=_completion(**fields)), 400, param, contains)


BAD_CHATS = [
    (dict(messages=[]), "messages", "must not be empty"),
    (dict(messages=[{"role": "user", "content": "x", "x": 1}]), "messages.0.x", "unrecognized"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]),
     "messages[0].content[0].type", "text only"),
    (dict(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role", "unknown role"),
    (dict(messages=[{"role": "user", "content": None}]), "messages[0].content", "no content"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id",
     "tool_call_id"),
    (dict(response_format={"type": "xml"}), "response_format.type", ""),
    (dict(response_format={"type": "json_schema"}), "response_format.json_schema",
     "needs json_schema.schema"),
    (dict(logprobs=False, top_logprobs=5), "top_logprobs", "requires logprobs"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs", "between 0 and 20"),
    (dict(max_completion_tokens=0), "max_completion_tokens", "at least 1"),
    (dict(max_tokens=0), "max_tokens", "at least 1"),
    (dict(n=30), "n", "between 1 and 16"),
    (dict(stream=False, stream_options={"include_usage": True}), "stream_options",
     "only allowed when stream"),
]


@pytest.mark.parametrize("fields,param,contains", BAD_CHATS)
def test_bad_chat_requests(client, fields, param, contains):
    _assert_error(client.post("/v1/chat/completions", json=_chat(**fields)), 400, param, contains)


def test_context_limit_states_both_numbers(client, preparer):
    n = len(preparer.tokenizer.encode("Hello"))
    err = _assert_error(client.post("/v1/completions", json=_completion(max_tokens=MAX_LEN)),
                        400, "max_tokens")
    assert str(MAX_LEN) in err["message"] and str(n + MAX_LEN) in err["message"]
    long_chat = _chat(messages=[{"role": "user", "content": "word " * 100}])
    err = _assert_error(client.post("/v1/chat/completions", json=long_chat), 400, "messages")
    assert str(MAX_LEN) in err["message"] and "no room" in err["message"]


def test_unknown_model_is_404(client):
    err = _assert_error(client.post("/v1/completions", json=_completion(model="gpt-4")), 404,
                        "model", "gpt-4")
    assert err["code"] == "model_not_found"
    err = _assert_error(client.post("/v1/chat/completions", json=_chat(model="x")), 404)
    assert err["code"] == "model_not_found"


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b"", b'"text"'])
def test_malformed_bodies_are_400(client, body):
    resp = client.post("/v1/completions", content=body,
                       headers={"content-type": "application/json"})
    _assert_error(resp, 400)


def test_missing_fields_are_400(client):
    _assert_error(client.post("/v1/completions", json={"model": MODEL}), 400, "prompt", "missing")
    _assert_error(client.post("/v1/chat/completions", json={"model": MODEL}), 400, "messages")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", _completion()),
    ("/v1/completions", _completion(prompt=[1, 2, 3], stream=True)),
    ("/v1/chat/completions", _chat(stream=True, stream_options={"include_usage": True})),
    ("/v1/chat/completions", _chat(messages=[{"role": "user",
                                              "content": [{"type": "text", "text": "Hi"}]}])),
    # the body vLLM's benchmark client sends (backend vllm, /v1/completions)
    ("/v1/completions", _completion(prompt="Hello there", temperature=0.0,
                                    repetition_penalty=1.0, max_tokens=8, logprobs=None,
                                    stream=True, stream_options={"include_usage": True},
                                    ignore_eos=True)),
    ("/v1/completions", _completion(prompt=["a", "b"], n=2, presence_penalty=0.5,
                                    frequency_penalty=0.5, logit_bias={"5": -100},
                                    min_tokens=2, min_p=0.1, stop_token_ids=[7], echo=True,
                                    structured_outputs={"choice": ["yes", "no"]})),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": True}}, seed=3,
        max_completion_tokens=5, include_stop_str_in_output=True, skip_special_tokens=False)),
])
def test_valid_requests_without_workers_are_503(client, path, body):
    _assert_error(client.post(path, json=body), 503, None, "no decode worker is available")


def test_models_health_and_unknown_routes(client):
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    health = client.get("/health")
    assert health.status_code == 200
    assert health.json()["workers"] == {"prefill": 0, "decode": 0, "refused": 0}
    _assert_error(client.get("/v1/nothing"), 404)


def test_a_clients_request_id_is_metadata_only(preparer):
    """Workers know a request by the gateway's id: two clients giving the same id (or one
    naming another request's choice, "abc#1") cannot collide there."""
    from gateway.errors import GatewayError

    a = preparer.prepare(Prompt(text="x"), RawParams(), client_request_id="abc#1")
    b = preparer.prepare(Prompt(text="x"), RawParams(), client_request_id="abc#1")
    assert a.request_id != b.request_id and "#" not in a.request_id
    assert a.public_id == b.public_id == "abc#1"
    with pytest.raises(GatewayError) as e:
        preparer.prepare(Prompt(text="x"), RawParams(), client_request_id="x" * 10_000)
    assert e.value.param == "request_id" and e.value.status == 400


def test_defaults_like_vllm(preparer):
    text = preparer.prepare(Prompt(text="Hello"), RawParams())
    assert text.params.max_tokens == 16
    assert (text.params.temperature, text.params.top_p, text.params.top_k) == (1.0, 1.0, 0)
    chat = preparer.prepare(Prompt(messages=({"role": "user", "content": "Hi"},)), RawParams())
    assert chat.params.max_tokens == MAX_LEN - chat.num_prompt_tokens   # no default set
    bounded = RequestPreparer(preparer.tokenizer, ServedModel(MODEL, MAX_LEN,
                                                              max_tokens_default=8))
    chat = bounded.prepare(Prompt(messages=({"role": "user", "content": "Hi"},)), RawParams())
    assert chat.params.max_tokens == 8
    assert chat.prompt_token_ids == tuple(
        preparer.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]))
    seeds = {preparer.prepare(Prompt(text="x"), RawParams()).params.seed for _ in range(4)}
    assert len(seeds) == 4  # a fresh random seed per request
    fixed = preparer.prepare(Prompt(token_ids=(1, 2)), RawParams(seed=7, top_k=-1, stop=("a",)))
    assert (fixed.params.seed, fixed.params.top_k, fixed.params.stop) == (7, 0, ("a",))
    assert fixed.request_id != text.request_id
