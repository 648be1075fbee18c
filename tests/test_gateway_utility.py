"""/tokenize, /detokenize and /version of the REST front door, against the real default model's
tokenizer and without workers: vLLM's shapes, the same token ids a chat completion computes,
and OpenAI error bodies naming the field."""

from __future__ import annotations

import importlib.metadata

import pytest

from gateway.params import Prompt

from tests.test_gateway_validation import MAX_LEN, MODEL, client, preparer  # noqa: F401

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def _ok(resp) -> dict:
    assert resp.status_code == 200, resp.text
    return resp.json()


def _error(resp, status: int, param, contains: str = "") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert contains in err["message"]
    return err


@pytest.mark.parametrize("text", ["Hello world", "  héllo, 世界!\n\tend", "a" * 200])
def test_tokenize_round_trips_through_detokenize(client, preparer, text):
    got = _ok(client.post("/tokenize", json={"model": MODEL, "prompt": text}))
    assert set(got) == {"count", "max_model_len", "tokens", "token_strs"}
    assert got["tokens"] == preparer.tokenizer.encode(text)
    assert got["count"] == len(got["tokens"]) > 0
    assert got["max_model_len"] == MAX_LEN            # the prompt may be longer: not refused
    assert got["token_strs"] is None
    assert _ok(client.post("/detokenize", json={"tokens": got["tokens"]})) == {"prompt": text}


def test_tokenize_add_special_tokens_is_passed_to_the_tokenizer(client, preparer):
    tok = preparer.tokenizer
    text = "<|im_start|>user"                          # special tokens in text are recognised
    for flag in (True, False):
        got = _ok(client.post("/tokenize", json={"prompt": text, "add_special_tokens": flag}))
        assert got["tokens"] == tok.encode(text, add_special_tokens=flag)
    assert _ok(client.post("/tokenize", json={"prompt": ""}))["count"] == len(tok.encode(""))


def test_messages_tokenize_as_a_chat_completion_would(client, preparer):
    """The default flags give exactly RequestPreparer.prompt_ids, which chat completions use."""
    got = _ok(client.post("/tokenize", json={"model": MODEL, "messages": CHAT}))
    expected = preparer.prompt_ids(Prompt(messages=tuple(CHAT)))
    assert tuple(got["tokens"]) == expected
    assert got["count"] == len(expected)
    # detokenize keeps special tokens (as vLLM's does): the rendered template comes back
    assert _ok(client.post("/detokenize", json={"tokens": got["tokens"]}))["prompt"] == \
        preparer.tokenizer.render_chat(CHAT)


def test_messages_options(client, preparer):
    tok = preparer.tokenizer
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                          {"type": "text", "text": "there"}]}]
    joined = [{"role": "user", "content": "Hi\nthere"}]
    assert _ok(client.post("/tokenize", json={"messages": parts}))["tokens"] == \
        _ok(client.post("/tokenize", json={"messages": joined}))["tokens"]
    no_prompt = _ok(client.post("/tokenize", json={"messages": CHAT,
                                                   "add_generation_prompt": False}))
    assert no_prompt["tokens"] == tok.encode(tok.render_chat(CHAT, add_generation_prompt=False),
                                             add_special_tokens=False)
    assert no_prompt["count"] < _ok(client.post("/tokenize", json={"messages": CHAT}))["count"]
    special = _ok(client.post("/tokenize", json={"messages": CHAT, "add_special_tokens": True}))
    assert special["tokens"] == tok.encode(tok.render_chat(CHAT), add_special_tokens=True)


def test_return_token_strs(client, preparer):
    tok = preparer.tokenizer
    for body in ({"prompt": "Hello world, again", "return_token_strs": True},
                 {"messages": CHAT, "return_token_strs": True}):
        got = _ok(client.post("/tokenize", json=body))
        assert got["token_strs"] == [tok.token_text(t) for t in got["tokens"]]
        assert len(got["token_strs"]) == got["count"]
    plain = _ok(client.post("/tokenize", json={"prompt": "Hello world"}))
    with_strs = _ok(client.post("/tokenize", json={"prompt": "Hello world",
                                                   "return_token_strs": True}))
    assert "".join(with_strs["token_strs"]) == "Hello world"
    assert plain["tokens"] == with_strs["tokens"]


def test_detokenize_edges(client, preparer):
    assert _ok(client.post("/detokenize", json={"tokens": []})) == {"prompt": ""}
    top = preparer.tokenizer.vocab_size - 1
    assert isinstance(_ok(client.post("/detokenize", json={"tokens": [0, top]}))["prompt"], str)


BAD_TOKENIZE = [
    ({"prompt": "x", "foo": 1}, "foo", "unrecognized request argument: foo"),
    ({"messages": CHAT, "add_generation_promp": True}, "add_generation_promp", "unrecognized"),
    ({"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt", "unrecognized"),
    ({"prompt": "x", "messages": CHAT}, "messages", "either prompt or messages"),
    ({}, "prompt", "missing required argument: prompt"),
    ({"prompt": 5}, "prompt", "invalid value for prompt"),
    ({"prompt": "x", "return_token_strs": "maybe"}, "return_token_strs", "invalid value"),
    ({"messages": []}, "messages", "must not be empty"),
    ({"messages": [{"role": "user", "content": "x", "bogus": 1}]}, "messages.0.bogus",
     "unrecognized"),
]


@pytest.mark.parametrize("body,param,contains", BAD_TOKENIZE)
def test_bad_tokenize_requests_name_the_field(client, body, param, contains):
    _error(client.post("/tokenize", json=body), 400, param, contains)


BAD_DETOKENIZE = [
    ({"tokens": [1, 49152]}, "tokens", "token id 49152 at position 1 is out of the vocabulary"),
    ({"tokens": [-1]}, "tokens", "out of the vocabulary range"),
    ({"tokens": ["5"]}, "tokens.0", "invalid value for tokens.0"),
    ({"tokens": [1.5]}, "tokens.0", "invalid value"),
    ({"tokens": [1], "skip": True}, "skip", "unrecognized request argument: skip"),
    ({}, "tokens", "missing required argument: tokens"),
]


@pytest.mark.parametrize("body,param,contains", BAD_DETOKENIZE)
def test_bad_detokenize_requests_name_the_field(client, body, param, contains):
    _error(client.post("/detokenize", json=body), 400, param, contains)


@pytest.mark.parametrize("path,body", [("/tokenize", {"model": "gpt-4", "prompt": "x"}),
                                       ("/tokenize", {"model": "gpt-4", "messages": CHAT}),
                                       ("/detokenize", {"model": "gpt-4", "tokens": [1]})])
def test_unknown_model_is_404(client, path, body):
    err = _error(client.post(path, json=body), 404, "model", "`gpt-4` does not exist")
    assert err["code"] == "model_not_found"


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_a_body_that_is_not_an_object_is_refused(client, path):
    _error(client.post(path, json=[1, 2]), 400, None, "must be a JSON object")
    resp = client.post(path, content=b"{nope", headers={"content-type": "application/json"})
    _error(resp, 400, None, "not valid JSON")


def test_version(client):
    try:
        expected = importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:
        expected = "0.1.0"
    assert _ok(client.get("/version")) == {"version": expected}
