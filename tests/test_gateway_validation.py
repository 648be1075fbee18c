"""Request validation of the REST front door: every bad input is a 400 (404 for an unknown model)
with an OpenAI error body, and never reaches a worker (there are none here: a valid request gets
503 "no decode worker is available"). Hidden inputs too, those a schema-driven fuzzer does not
make: strings that are not valid Unicode anywhere in a body, every integer field past its wire
type's bounds, a batch larger than --max-in-flight; after each the app still serves."""

from __future__ import annotations

import json
import shutil

import pytest
from fastapi.testclient import TestClient

from gateway.errors import GatewayError
from gateway.limits import InFlight
from gateway.openai_api import create_app
from gateway.params import GenerationParams, Prompt, RequestPreparer, ServedModel
from gateway.pipeline import Pipeline
from gateway.router import Router
from gateway.tokenizer import Tokenizer
from gateway.wire import int_type, sampling_int_fields
from proto import pdserve_pb2 as pb

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
    (dict(use_beam_search=True, stream=True), "use_beam_search", "does not stream"),
    (dict(use_beam_search=True, temperature=0.7), "temperature", "does not apply to beam"),
    (dict(use_beam_search=True, top_p=0.5), "top_p", "does not apply to beam"),
    (dict(use_beam_search=True, logprobs=1), "logprobs", "not supported with beam"),
    (dict(use_beam_search=True, stop=["x"]), "stop", "not supported with beam"),
    (dict(use_beam_search=True, early_stopping="sometimes"), "early_stopping", ""),
    (dict(length_penalty=0.5), "length_penalty", "applies to beam search"),
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
    (dict(prompt_logprobs=-1), "prompt_logprobs", "between 0 and 20"),
    (dict(prompt_logprobs=21), "prompt_logprobs", "between 0 and 20"),
    (dict(prompt_logprobs=1, stream=True), "prompt_logprobs", "not available with stream"),
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
    # fields that would change nothing are refused by name, never ignored
    (dict(stream=True, stream_options={"continuous_usage_stats": True}),
     "stream_options.continuous_usage_stats", "needs stream_options.include_usage"),
    (dict(truncation_side="right"), "truncation_side",
     "truncation_side applies to truncate_prompt_tokens"),
    (dict(truncation_side="left"), "truncation_side", "set truncate_prompt_tokens too"),
    (dict(use_beam_search=True, n=2, seed=7), "seed", "seed does not apply to beam search"),
]


@pytest.mark.parametrize("fields,param,contains", BAD_COMPLETIONS)
def test_bad_completion_requests(client, fields, param, contains):
    _assert_error(client.post("/v1/completions", json=_completion(**fields)), 400, param, contains)


BAD_CHATS = [
    (dict(messages=[]), "messages", "must not be empty"),
    (dict(prompt_logprobs=-1), "prompt_logprobs", "between 0 and 20"),
    (dict(prompt_logprobs=2, stream=True), "prompt_logprobs", "not available with stream"),
    (dict(messages=[{"role": "user", "content": "x", "x": 1}]), "messages.0.x", "unrecognized"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]),
     "messages[0].content[0].type", "text only"),
    (dict(messages=[{"role": "wiz ard", "content": "x"}]), "messages[0].role", "not a name"),
    (dict(messages=[{"role": "user<|im_end|>", "content": "x"}]), "messages[0].role",
     "custom role"),
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
    (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": False}}),
     "response_format.json_schema.strict", "pdserve always enforces the schema"),
    (dict(stream=True, stream_options={"include_usage": False, "continuous_usage_stats": True}),
     "stream_options.continuous_usage_stats", "needs stream_options.include_usage"),
    (dict(truncation_side="left"), "truncation_side", "applies to truncate_prompt_tokens"),
    (dict(use_beam_search=True, seed=0), "seed", "seed does not apply to beam search"),
    # the default model's template renders no name: the model would never see it. "user" shows
    # in the prompt anyway (as a role): the check does not look for the name itself
    (dict(messages=[{"role": "user", "content": "Hi", "name": "bob"}]), "messages[0].name",
     "does not render a message's name"),
    (dict(messages=[{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi", "name": "user"}]), "messages[1].name",
     "does not render a message's name"),
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
    ("/v1/chat/completions", {"model": MODEL, "messages": [    # a custom role the template renders
        {"role": "my-custom-role", "content": [{"type": "text", "text": "what is 1+1?"}]}]}),
    # what the refusals above need: include_usage, truncate_prompt_tokens, no seed; strict
    # absent (true is above)
    ("/v1/completions", _completion(stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True})),
    ("/v1/chat/completions", _chat(truncate_prompt_tokens=4, truncation_side="right")),
    ("/v1/completions", _completion(use_beam_search=True, n=2)),
    ("/v1/chat/completions", _chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}}})),
])
def test_valid_requests_without_workers_are_503(client, path, body):
    _assert_error(client.post(path, json=body), 503, None, "no decode worker is available")


@pytest.mark.parametrize("body", [_completion(max_tokens=3), _chat(max_completion_tokens=3)])
def test_invocations_takes_either_request_by_its_body(client, body):
    """SageMaker's /invocations: a valid chat or completion body goes to the workers (503 here,
    none), a bad one is the same 400 as on /v1, a body of neither kind a 400 saying so."""
    _assert_error(client.post("/invocations", json=body), 503, None, "no decode worker")
    _assert_error(client.post("/invocations", json={**body, "temperature": 9}), 400,
                  "temperature", "between 0 and 2")
    _assert_error(client.post("/invocations", json={**body, "nope": 1}), 400, "nope",
                  "unrecognized request argument")


@pytest.mark.parametrize("raw", [b'{"model": "smol-test"}', b"[1, 2]", b"{not json", b""])
def test_invocations_refuses_a_body_of_neither_kind(client, raw):
    resp = client.post("/invocations", content=raw, headers={"content-type": "application/json"})
    _assert_error(resp, 400)
    assert client.get("/ping").status_code == 200 and client.post("/ping").status_code == 200


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
    params = GenerationParams.from_client()
    a = preparer.prepare(Prompt(text="x"), params, client_request_id="abc#1")
    b = preparer.prepare(Prompt(text="x"), params, client_request_id="abc#1")
    assert a.request_id != b.request_id and "#" not in a.request_id
    assert a.public_id == b.public_id == "abc#1"
    with pytest.raises(GatewayError) as e:
        preparer.prepare(Prompt(text="x"), params, client_request_id="x" * 10_000)
    assert e.value.param == "request_id" and e.value.status == 400


def test_defaults_like_vllm(preparer):
    defaults = GenerationParams.from_client
    text = preparer.prepare(Prompt(text="Hello"), defaults())
    assert text.params.max_tokens == 16
    assert (text.params.temperature, text.params.top_p, text.params.top_k) == (1.0, 1.0, 0)
    chat = preparer.prepare(Prompt(messages=({"role": "user", "content": "Hi"},)), defaults())
    assert chat.params.max_tokens == MAX_LEN - chat.num_prompt_tokens   # no default set
    bounded = RequestPreparer(preparer.tokenizer, ServedModel(MODEL, MAX_LEN,
                                                              max_tokens_default=8))
    chat = bounded.prepare(Prompt(messages=({"role": "user", "content": "Hi"},)), defaults())
    assert chat.params.max_tokens == 8
    assert chat.prompt_token_ids == tuple(
        preparer.tokenizer.encode_chat([{"role": "user", "content": "Hi"}]))
    unseeded = defaults()        # one for the prompts of a batch: each gets a seed of its own
    seeds = {preparer.prepare(Prompt(text="x"), unseeded).params.seed for _ in range(4)}
    assert len(seeds) == 4  # a fresh random seed per request
    fixed = preparer.prepare(Prompt(token_ids=(1, 2)), defaults(seed=7, top_k=-1, stop=("a",)))
    assert (fixed.params.seed, fixed.params.top_k, fixed.params.stop) == (7, 0, ("a",))
    assert fixed.request_id != text.request_id


# ------------------------------------------------------------- hidden inputs: text and integers
# Bodies without "model" (the served one), so the real-stack suite (test_fuzz_gateway) sends
# them too. JSON escapes spell the lone surrogates: the client's encoder cannot hold one.
LONE = "\ud800"
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
BAD_TEXT = [
    ("/v1/completions", {"prompt": LONE}, "prompt"),
    ("/v1/completions", {"prompt": "ok " + "\udfff" + " ok"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "x" + LONE]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "Hi", "stop": LONE}, "stop"),
    ("/v1/completions", {"prompt": "Hi", "stop": ["a", LONE]}, "stop[1]"),
    ("/v1/completions", {"prompt": "Hi", "user": LONE}, "user"),
    ("/v1/completions", {"prompt": "Hi", "cache_salt": LONE}, "cache_salt"),
    ("/v1/completions", {"prompt": "Hi", "model": LONE}, "model"),
    ("/v1/completions", {"prompt": "Hi", "suffix": LONE}, "suffix"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {LONE: 1}}, "logit_bias.\\ud800"),
    ("/v1/completions", {"prompt": "Hi", LONE: 1}, "\\ud800"),
    ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"regex": LONE}},
     "structured_outputs.regex"),
    ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"choice": ["a", LONE]}},
     "structured_outputs.choice[1]"),
    ("/v1/completions", {"prompt": "Hi", "structured_outputs": {"json": {"enum": [LONE]}}},
     "structured_outputs.json.enum[0]"),
    ("/v1/completions", {"prompt": "Hi", "guided_json": {"type": "string", "pattern": LONE}},
     "guided_json.pattern"),
    ("/v1/completions", {"prompt": "Hi", "guided_grammar": LONE}, "guided_grammar"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"},
                                     {"type": "text", "text": LONE}]}]},
     "messages[0].content[1].text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", "name": LONE}]},
     "messages[0].name"),
    ("/v1/chat/completions", {"messages": [{"role": LONE, "content": "Hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": LONE}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]},
     "messages[1].tool_calls[0].function.arguments"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x",
                                            "tool_call_id": LONE}]},
     "messages[0].tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stop": [LONE]},
     "stop[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "description": LONE}}]},
     "tools[0].function.description"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {LONE: {"type": "string"}}}}}]},
     "tools[0].function.parameters.properties.\\ud800"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "tools": [_TOOL],
                              "tool_choice": {"type": "function", "function": {"name": LONE}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"const": LONE}}}},
     "response_format.json_schema.schema.const"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    ("/detokenize", {"tokens": [1], "model": LONE}, "model"),
]


def post_json(client, path: str, body: object):
    """BODY as JSON with every non-ASCII character escaped (lone surrogates as \\udXXX)."""
    return client.post(path, content=json.dumps(body).encode("ascii"),
                       headers={"content-type": "application/json"})


@pytest.mark.parametrize("path,body,param", BAD_TEXT, ids=[p for _, _, p in BAD_TEXT])
def test_text_that_is_not_unicode_is_a_400_naming_the_field(client, path, body, param):
    err = _assert_error(post_json(client, path, body), 400, param, "not valid Unicode")
    assert "lone surrogate" in err["message"]
    assert client.post("/tokenize", json={"prompt": "Hi"}).status_code == 200    # still serving


@pytest.mark.parametrize("raw", [b'"\xed\xa0\x80"', b'"ok \xed\xb0\x80"',
                                 b'"\xed\xa0\xbd\xed\xb8\x80"'])   # surrogates, as UTF-8-like
def test_surrogates_as_raw_bytes_are_400_too(client, raw):
    r = client.post("/v1/completions", content=b'{"prompt": ' + raw + b'}',
                    headers={"content-type": "application/json"})
    _assert_error(r, 400, "prompt", "not valid Unicode")


def test_an_error_body_always_encodes():
    body = GatewayError("bad \ud800 text", param="k\udfff").body()
    assert json.dumps(body, ensure_ascii=False).encode("utf-8")
    assert body["error"]["message"] == "bad \\ud800 text" and body["error"]["param"] == "k\\udfff"


def test_a_body_that_is_not_utf8_at_all_is_400(client):
    r = client.post("/v1/completions", content=b'{"prompt": "\xff\xfe"}',
                    headers={"content-type": "application/json"})
    _assert_error(r, 400)


# (type, least, greatest) of logit_bias' keys and of a prompt's token ids
_LOGIT_BIAS_KEY = int_type(pb.SamplingParams.DESCRIPTOR.fields_by_name["logit_bias"]
                           .message_type.fields_by_name["key"])
_IDS = int_type(pb.TokenIds.DESCRIPTOR.fields_by_name["ids"])


def _int_cases() -> list[tuple[str, str, object, str]]:
    """(path, SamplingParams field it travels in, a function of the value to a body, param)."""
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    return [
        ("/v1/completions", "top_k", lambda v: {"prompt": "Hi", "top_k": v}, "top_k"),
        ("/v1/chat/completions", "top_k", lambda v: {**chat, "top_k": v}, "top_k"),
        ("/v1/completions", "seed", lambda v: {"prompt": "Hi", "seed": v}, "seed"),
        ("/v1/completions", "max_tokens", lambda v: {"prompt": "Hi", "max_tokens": v},
         "max_tokens"),
        ("/v1/chat/completions", "max_tokens", lambda v: {**chat, "max_completion_tokens": v},
         "max_completion_tokens"),
        ("/v1/chat/completions", "max_tokens", lambda v: {**chat, "max_tokens": v},
         "max_tokens"),
        ("/v1/completions", "top_logprobs", lambda v: {"prompt": "Hi", "logprobs": v},
         "logprobs"),
        ("/v1/chat/completions", "top_logprobs",
         lambda v: {**chat, "logprobs": True, "top_logprobs": v}, "top_logprobs"),
        ("/v1/completions", "min_tokens", lambda v: {"prompt": "Hi", "min_tokens": v},
         "min_tokens"),
        ("/v1/completions", "stop_token_ids", lambda v: {"prompt": "Hi", "stop_token_ids": [v]},
         "stop_token_ids"),
        ("/v1/completions", "n", lambda v: {"prompt": "Hi", "n": v}, "n"),
        ("/v1/chat/completions", "n", lambda v: {**chat, "n": v, "best_of": v}, "n"),
        ("/v1/completions", "beam_width",
         lambda v: {"prompt": "Hi", "n": v, "use_beam_search": True}, "n"),
        ("/v1/completions", "prompt_logprobs", lambda v: {"prompt": "Hi", "prompt_logprobs": v},
         "prompt_logprobs"),
        ("/v1/chat/completions", "prompt_logprobs",
         lambda v: {**chat, "prompt_logprobs": v}, "prompt_logprobs"),
    ]


INT_CASES = _int_cases()


def test_every_integer_sampling_field_has_its_bound_cases():
    assert {field for _, field, _, _ in INT_CASES} == set(sampling_int_fields())


def out_of_range_bodies() -> list[tuple[str, object, str, str]]:
    """(path, body, param, case id): every integer field at its wire type's max + 1 and
    min - 1 (REST integers are unbounded JSON numbers), token ids too."""
    out = []
    for path, field, body, param in INT_CASES:
        _, lo, hi = sampling_int_fields()[field]
        for v in (hi + 1, lo - 1):
            out.append((path, body(v), param, f"{path}:{param}={v}"))
    for v in (_LOGIT_BIAS_KEY[2] + 1, _LOGIT_BIAS_KEY[1] - 1):
        out.append(("/v1/completions", {"prompt": "Hi", "logit_bias": {str(v): 1}},
                    "logit_bias", f"logit_bias[{v}]"))
    for v in (_IDS[2] + 1, _IDS[1] - 1):
        out += [("/v1/completions", {"prompt": [1, v]}, "prompt", f"prompt=[1, {v}]"),
                ("/v1/completions", {"prompt": [[1], [v]]}, "prompt", f"prompt=[[1], [{v}]]"),
                ("/detokenize", {"tokens": [v]}, "tokens", f"detokenize {v}")]
    return out


OUT_OF_RANGE = out_of_range_bodies()


@pytest.mark.parametrize("path,body,param", [c[:3] for c in OUT_OF_RANGE],
                         ids=[c[3] for c in OUT_OF_RANGE])
def test_integers_beyond_their_wire_type_are_400s_naming_the_field(client, path, body, param):
    _assert_error(client.post(path, json=body), 400, param)
    assert client.post("/tokenize", json={"prompt": "Hi"}).status_code == 200


def test_top_k_of_2_to_the_31_names_its_wire_type(client):
    err = _assert_error(client.post("/v1/completions", json=_completion(top_k=2 ** 31)), 400,
                        "top_k", "at most 2147483647")
    assert "int32" in err["message"]
    _assert_error(client.post("/v1/completions", json=_completion(top_k=2 ** 31 - 1)), 503)


# ----------------------------------------------------------------------- the in-flight bound

@pytest.fixture
def bounded(preparer):
    """An app admitting 2 requests at once (--max-in-flight 2), and its InFlight."""
    router = Router(NOWHERE)
    admission = InFlight(2)
    with TestClient(create_app(preparer, Pipeline(router, preparer.tokenizer), router,
                               admission)) as c:
        yield c, admission


def test_a_batch_larger_than_max_in_flight_is_a_400_naming_the_flag(bounded):
    client, admission = bounded
    r = client.post("/v1/completions", json=_completion(prompt=["a", "b", "c"]))
    err = _assert_error(r, 400, "prompt", "--max-in-flight 2")
    assert "3 prompts" in err["message"] and "retry-after" not in r.headers
    assert admission.used == 0
    # what fits is admitted (no worker here: 503), and the slots come back
    _assert_error(client.post("/v1/completions", json=_completion(prompt=["a", "b"])), 503)
    assert admission.used == 0
    # a bound that is merely full now is still a retryable 429
    held = admission.take(2)
    r = client.post("/v1/completions", json=_completion())
    held.release()
    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    _assert_error(client.post("/v1/completions", json=_completion(prompt=["x"] * 65)), 400,
                  "prompt", "at most 64 prompts")


# ------------------------------------------------------------------------ a message's name

# A ChatML template that shows a user's name beside its role, and no other role's.
NAMED_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}{% if m.role == 'user' and "
                  "m.name is defined %} ({{ m.name }}){% endif %}\n{{ m.content }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def named(model_dir, tmp_path_factory):
    """An app whose model's chat template renders user messages' names."""
    folder = tmp_path_factory.mktemp("named")
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json",
                 "generation_config.json"):
        shutil.copy(model_dir / name, folder / name)
    (folder / "chat_template.jinja").write_text(NAMED_TEMPLATE)
    preparer = RequestPreparer(Tokenizer(folder), ServedModel(MODEL, MAX_LEN))
    router = Router(NOWHERE)
    with TestClient(create_app(preparer, Pipeline(router, preparer.tokenizer), router)) as c:
        yield c


def test_a_name_the_template_renders_reaches_the_prompt(named):
    """Accepted where the template shows it (the prompt holds it), refused by name on a
    message whose role the template shows no name for."""
    conversation = [{"role": "user", "content": "Hi", "name": "Ada"}]
    _assert_error(named.post("/v1/chat/completions", json=_chat(messages=conversation)), 503,
                  None, "no decode worker is available")
    tokens = named.post("/tokenize", json={"model": MODEL, "messages": conversation}).json()
    prompt = named.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]}).json()
    assert prompt["prompt"].startswith("<|im_start|>user (Ada)")
    answered = conversation + [{"role": "assistant", "content": "Hello", "name": "bot"}]
    _assert_error(named.post("/v1/chat/completions", json=_chat(messages=answered)), 400,
                  "messages[1].name", "does not render a message's name")


def test_tokenize_refuses_a_name_the_template_drops(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi", "name": "Ada"}]}
    _assert_error(client.post("/tokenize", json=body), 400, "messages[0].name",
                  "does not render a message's name")
    del body["messages"][0]["name"]
    assert client.post("/tokenize", json=body).status_code == 200
