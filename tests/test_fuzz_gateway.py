"""The gateway's REST API fuzzed from its own OpenAPI schema, on the real stack (redis, a prefill
and a decode worker, the gateway; the default model).

Every operation of /openapi.json gets schemathesis-generated requests, ones the schema admits
(positive) and ones it refuses (negative); a stateful run then chains /tokenize, /detokenize and
generation. Whatever comes in: no 5xx, every error body is OpenAI's ({"error": {"message",
"type", "param", "code"}}), a refused request is a 4xx, a streamed error is such a body too;
and afterwards the gateway answers a normal completion exactly as before and both workers are
idle with every KV block free. Inputs the schema cannot make (lone surrogates, integers past
their wire type, gRPC strings that are not UTF-8) are sent by hand: each is refused naming the
field, and a request after it is served.

Bounded for CI: the gateway serves a 64-token context (so an output is at most that), generated
requests ask for at most a few tokens, choices and prompts (`_small`), and every operation gets
a fixed number of derandomized examples, without shrinking a failing one.
"""

from __future__ import annotations

import json
import re

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, initialize, rule,
                                 run_state_machine_as_test)
from schemathesis import GenerationMode

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.stack import standard_stack, wait_idle
from tests.test_gateway_grpc import _undecodable
from tests.test_gateway_validation import BAD_TEXT, OUT_OF_RANGE, post_json

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CONTEXT = 64                 # --max-model-len of the gateway: no output is longer
MAX_NEW = 4                  # what a generated request may ask for, at most
EXAMPLES = 40                # per operation and mode
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"),
              ("GET", "/version"), ("GET", "/health"), ("GET", "/metrics")]
GENERATING = ("/v1/completions", "/v1/chat/completions")
GREEDY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8,
          "temperature": 0, "ignore_eos": True}
# No shrinking (it can take minutes against a real stack): a failure's note is its curl command.
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    with standard_stack(model_dir, tmp_path_factory.mktemp("fuzz-gateway"),
                        gateway_args=("--max-model-len", str(CONTEXT), "--max-tokens-default",
                                      str(MAX_NEW), "--tool-call-parser", "hermes")) as s:
        yield s


@pytest.fixture(scope="module")
def base(stack) -> str:
    return stack.procs[-1].http


@pytest.fixture(scope="module")
def http(base):
    with httpx.Client(base_url=base, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def before(http) -> dict:
    """A greedy completion before any fuzzing: the answer the gateway must still give after."""
    r = http.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


@pytest.fixture(scope="module")
def schema(base, before):
    return schemathesis.openapi.from_url(base + "/openapi.json", timeout=30)


# ------------------------------------------------------------------------------------ checks

def assert_openai_error(body: object, status: int) -> None:
    """OpenAI's error body: {"error": {"message": str, "type": str, "param", "code"}}."""
    assert isinstance(body, dict) and set(body) == {"error"}, (status, body)
    err = body["error"]
    assert isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err), body
    assert isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str) and err["type"], body
    assert err["param"] is None or isinstance(err["param"], str), body
    assert err["code"] is None or isinstance(err["code"], (str, int)), body


def sse_lines(text: str) -> list[str]:
    """An event stream's lines: SSE ends them with CR, LF or CRLF only (str.splitlines would
    also split an event's JSON at a U+0085 or U+2028 that a generated text holds unescaped)."""
    return re.split(r"\r\n|\r|\n", text)


def assert_served(status: int, content_type: str, text: str, refused: bool,
                  whole: bool = True) -> None:
    """One response of the gateway: never a 5xx; a 4xx (or an SSE error event) is an OpenAI
    error; `refused`: the request breaks the schema, so it must be a 4xx; `whole`: an event
    stream was read to its end."""
    assert status < 500, f"{status}: {text[:2000]}"
    if refused:
        assert 400 <= status < 500, f"a request outside the schema got {status}: {text[:500]}"
    if status >= 400:
        assert content_type.startswith("application/json"), (status, content_type, text)
        assert_openai_error(json.loads(text), status)
    elif content_type.startswith("text/event-stream"):
        events = [line[6:] for line in sse_lines(text) if line.startswith("data: ")]
        assert events and (events[-1] == "[DONE]" or not whole), text[-500:]
        for data in events:
            if data == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:           # an error after the 200: must not be ours
                assert_openai_error(event, status)
                assert event["error"]["type"] != "server_error", event
    elif content_type.startswith("application/json"):
        json.loads(text)


def _count(value: object) -> int | None:
    """VALUE as a whole number (schemathesis spells some as 2.0), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value) if float(value).is_integer() else None


def _small(body: object, mode: GenerationMode) -> None:
    """Bound what a generated request may cost without changing whether it is valid: outputs
    of at most MAX_NEW tokens, at most 2 choices, 3 prompts; in positive mode the served model."""
    if not isinstance(body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        v = _count(body.get(key))
        if v is not None and 1 <= v <= CONTEXT:
            body[key] = min(v, MAX_NEW)
    n = _count(body.get("n"))
    if n is not None and 2 < n <= 16:
        body["n"] = 2
        if body.get("best_of") == n:
            body["best_of"] = 2
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        body["prompt"] = prompt[:3]
    if mode is GenerationMode.POSITIVE and isinstance(body.get("model"), str):
        body["model"] = MODEL


# ------------------------------------------------------------------------------------- tests

def test_the_schema_describes_every_endpoint(schema):
    ops = {(r.ok().method.upper(), r.ok().path) for r in schema.get_all_operations()}
    assert set(OPERATIONS) <= ops, set(OPERATIONS) - ops
    for path in GENERATING + ("/tokenize", "/detokenize"):
        body = schema[path]["POST"].definition.raw["requestBody"]["content"]
        assert body["application/json"]["schema"], path     # a described body, not "any"


# A GET without parameters has no request outside its schema: positive only.
RUNS = [(m, p, mode) for m, p in OPERATIONS
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
        if m == "POST" or mode is GenerationMode.POSITIVE]


@pytest.mark.parametrize("method,path,mode", RUNS,
                         ids=[f"{m} {p} {mode.value}" for m, p, mode in RUNS])
def test_fuzzed_requests_get_a_proper_answer(schema, base, method, path, mode):
    op = schema[path][method]

    @FUZZ
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        _small(case.body, mode)
        note(case.as_curl_command())
        r = case.call(base_url=base, timeout=120)
        content_type = (r.headers.get("content-type") or [""])[0]
        assert_served(r.status_code, content_type, r.text,
                      refused=mode is GenerationMode.NEGATIVE, whole=not r.stream_cut_short)
        if mode is GenerationMode.POSITIVE and method == "GET":
            assert r.status_code == 200, r.text

    run()


class ApiMachine(RuleBasedStateMachine):
    """Token ids travel between the endpoints: /tokenize's ids feed /detokenize and prompts;
    /tokenize's count of a chat is the chat completion's prompt_tokens; streams are cut off
    halfway."""

    ids = Bundle("ids")
    base = ""                 # the gateway's URL and the model's vocabulary size: set by the test
    vocab = 0

    def __init__(self) -> None:
        super().__init__()
        self.http = httpx.Client(base_url=self.base, timeout=120)

    def teardown(self) -> None:
        self.http.close()

    def post(self, path: str, body: dict) -> httpx.Response:
        r = self.http.post(path, json=body)
        assert_served(r.status_code, r.headers.get("content-type", ""), r.text, refused=False)
        return r

    @initialize(target=ids)
    def hello(self):
        return self.post("/tokenize", {"prompt": "Hello there"}).json()["tokens"]

    # The default model's byte-level vocabulary has no token for the bytes 04, 06, 13, 14, 16,
    # 1D, nor for the lead bytes of code points past U+3FFFF (unassigned and private-use
    # planes): its tokenizer drops them, so they cannot survive a round trip. Surrogates are no
    # text a client can send (they have no UTF-8): the utf-8 codec leaves them out.
    @rule(target=ids, text=st.text(st.characters(max_codepoint=0x3FFFF, codec="utf-8",
                                                 exclude_characters="\x04\x06\x13\x14\x16\x1d"),
                                   min_size=1, max_size=60))
    def tokenize(self, text):
        r = self.post("/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False})
        assert r.status_code == 200
        body = r.json()
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == CONTEXT
        back = self.post("/detokenize", {"tokens": body["tokens"]}).json()["prompt"]
        assert back == text, (text, body["tokens"], back)
        return body["tokens"]

    @rule(ids=ids, junk=st.integers(min_value=0, max_value=2 ** 40))
    def detokenize_out_of_vocabulary(self, ids, junk):
        r = self.post("/detokenize", {"tokens": [*ids, self.vocab + junk]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"

    @rule(ids=ids, new=st.integers(1, MAX_NEW), n=st.integers(1, 2), stream=st.booleans())
    def complete(self, ids, new, n, stream):
        body = {"model": MODEL, "prompt": ids, "max_tokens": new, "n": n, "stream": stream,
                "temperature": 0.7, "seed": 1, "ignore_eos": True}
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = self.post("/v1/completions", body)
        if len(ids) + new > CONTEXT:
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            return
        assert r.status_code == 200, r.text
        if stream:
            chunks = [json.loads(line[6:]) for line in sse_lines(r.text)
                      if line.startswith("data: {")]
            usage = chunks[-1]["usage"]
        else:
            usage = r.json()["usage"]
            assert len(r.json()["choices"]) == n
        assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == n * new

    @rule(text=st.text(min_size=1, max_size=40), role=st.sampled_from(["user", "system"]))
    def chat_counts_like_tokenize(self, text, role):
        messages = [{"role": role, "content": text}]
        count = self.post("/tokenize", {"model": MODEL, "messages": messages}).json()["count"]
        r = self.post("/v1/chat/completions", {"model": MODEL, "messages": messages,
                                               "max_tokens": 2, "temperature": 0})
        if count + 2 > CONTEXT:
            assert r.status_code == 400
            return
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == count

    @rule(ids=ids)
    def cut_a_stream_short(self, ids):
        if len(ids) + 32 > CONTEXT:
            return
        body = {"model": MODEL, "prompt": ids, "max_tokens": 32, "ignore_eos": True,
                "stream": True}
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break              # closing the response here aborts the request


def test_stateful_token_ids_travel_between_endpoints(base, before, model_dir):
    ApiMachine.base = base
    ApiMachine.vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    run_state_machine_as_test(ApiMachine, settings=settings(
        max_examples=12, stateful_step_count=8, deadline=None, derandomize=True,
        database=None, phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck)))


# Inputs a schema-driven fuzzer does not make (its strings are valid Unicode, its integers are
# within what the schema states): each is a 400 naming the field, and a request after it is
# served.
HIDDEN = [(path, body, param, f"{path}:{param}") for path, body, param in BAD_TEXT] + [
    ("/v1/completions", {"prompt": "Hi", "top_k": 2 ** 31}, "top_k", "top_k=2^31"),
    *OUT_OF_RANGE]
SMALL = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0,
         "ignore_eos": True}


@pytest.mark.parametrize("path,body,param", [h[:3] for h in HIDDEN], ids=[h[3] for h in HIDDEN])
def test_hidden_inputs_are_400s_naming_the_field_and_serving_goes_on(http, before, path, body,
                                                                      param):
    r = post_json(http, path, body)
    assert_served(r.status_code, r.headers.get("content-type", ""), r.text, refused=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = http.post("/v1/completions", json=SMALL)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_grpc_text_that_is_not_utf8_is_invalid_argument_and_serving_goes_on(stack, before):
    with grpc.insecure_channel(stack.procs[-1].address) as ch:
        raw = ch.unary_stream("/pdserve.v1.Generation/Generate")
        with pytest.raises(grpc.RpcError) as e:
            list(raw(_undecodable(b"\xed\xa0\x80"), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert "UTF-8" in e.value.details()
        good = pb.GenerateRequest(text="Hello", params=pb.SamplingParams(max_tokens=2,
                                                                         ignore_eos=True))
        out = list(pb_grpc.GenerationStub(ch).Generate(good, timeout=60))
    assert out[-1].finish_reason == "length" and out[-1].usage.completion_tokens == 2


def test_afterwards_the_gateway_serves_as_before_and_nothing_leaked(stack, http, before):
    r = http.post("/v1/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == before["text"]
    assert r.json()["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert http.get("/health").json()["status"] == "ok"

    wait_idle(stack.proc("prefill"), stack.proc("decode"))
    for p in stack.procs:
        assert p.alive(), f"{p.name} died:\n{p.log.read_text()[-3000:]}"
