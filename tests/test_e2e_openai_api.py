"""The OpenAI API's breadth through the real stack (redis, a prefill worker, a decode worker with
n-gram speculation, the gateway with the hermes tool-call parser) with the official `openai`
client, streaming and not: n (one prompt computed and sent once, forked on the decode worker),
batched prompts, penalties and logit_bias, stop_token_ids, min_tokens, echo, structured outputs
(JSON schema, JSON object, regex, choice, grammar), tool calling, and the body vLLM's
benchmark client sends."""

from __future__ import annotations

import json
import re

import grpc
import httpx
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.stack import standard_stack
from tests.test_structured_engine import SCHEMA, valid

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "maxLength": 16}},
                       "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    with standard_stack(model_dir, tmp_path_factory.mktemp("api"),
                        decode_args=("--speculative", "ngram", "--num-speculative-tokens", "4"),
                        gateway_args=("--tool-call-parser", "hermes")) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    from openai import OpenAI

    with OpenAI(base_url=stack.procs[-1].http + "/v1", api_key="unused", timeout=180,
                max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.procs[-1].http, timeout=180) as c:
        yield c


def _stream_text(stream) -> tuple[dict[int, str], dict[int, str], object]:
    """Texts and finish reasons per choice index of a streamed completion; the usage."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if hasattr(c, "text") else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url, timeout=10).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_n_shares_the_prompt_and_seeded_n_reproduces(stack, client):
    prefill = stack.procs[1]
    sent0 = _metric(prefill.metrics, "pdserve_kv_transfers_total")
    computed0 = _metric(prefill.metrics, "pdserve_prompt_tokens_computed_total")
    prompt = "The three most useful things to pack for a long hike are"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=16, temperature=1.0, seed=123, n=4)
    a = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    assert len({c.text for c in a.choices}) > 1, "each choice draws its own stream"
    assert a.usage.completion_tokens == 4 * 16
    n_prompt = a.usage.prompt_tokens
    # the prompt's KV was computed and transferred once for the four choices
    assert _metric(prefill.metrics, "pdserve_kv_transfers_total") - sent0 == 1
    assert _metric(prefill.metrics, "pdserve_prompt_tokens_computed_total") - computed0 \
        <= n_prompt
    b = client.completions.create(**kw)
    assert [c.text for c in b.choices] == [c.text for c in a.choices]
    texts, reasons, usage = _stream_text(client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert texts == {c.index: c.text for c in a.choices}
    assert set(reasons.values()) == {"length"}
    assert usage.prompt_tokens == n_prompt and usage.completion_tokens == 64
    greedy = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12,
                                            temperature=0, n=3)
    assert len({c.message.content for c in greedy.choices}) == 1


def test_batched_prompts_give_one_choice_per_prompt_and_n_each(client):
    prompts = ["The capital of France is", "def add(a, b):"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0,
                                    n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        alone = client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
        assert out.choices[2 * i].text == out.choices[2 * i + 1].text == alone.choices[0].text
    texts, _, _ = _stream_text(client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=8, temperature=0, n=2, stream=True))
    assert texts == {c.index: c.text for c in out.choices}


def test_penalties_and_logit_bias_are_applied(client, model_dir):
    from gateway.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    base = dict(model=MODEL, prompt="List: apple, apple, apple, apple,", max_tokens=12,
                temperature=0)
    plain = client.completions.create(**base).choices[0].text
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    bias = client.completions.create(**base, logit_bias={str(forced): 100}).choices[0].text
    assert bias == tok.decode([forced] * 12)
    penalised = client.completions.create(**base, frequency_penalty=2.0, presence_penalty=1.0,
                                          extra_body={"repetition_penalty": 1.5})
    assert penalised.choices[0].text != plain
    streamed, _, _ = _stream_text(client.completions.create(
        **base, frequency_penalty=2.0, presence_penalty=1.0, stream=True,
        extra_body={"repetition_penalty": 1.5}))
    assert streamed[0] == penalised.choices[0].text


def test_stop_token_ids_min_tokens_and_echo(client, model_dir):
    from gateway.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    base = dict(model=MODEL, prompt="Count: one, two, three,", max_tokens=16, temperature=0)
    plain = client.completions.create(**base).choices[0]
    ids = tok.encode(plain.text, add_special_tokens=False)
    stop_at = ids[3]
    cut = client.completions.create(**base, extra_body={"stop_token_ids": [stop_at]})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == tok.decode(ids[:ids.index(stop_at)])
    kept = client.completions.create(**base, extra_body={"stop_token_ids": [stop_at],
                                                         "include_stop_str_in_output": True})
    assert kept.choices[0].text == tok.decode(ids[:ids.index(stop_at) + 1])
    held = client.completions.create(**base, extra_body={"stop_token_ids": [ids[0]],
                                                         "min_tokens": 4})
    assert held.usage.completion_tokens >= 4
    echo = client.completions.create(**base, echo=True)
    assert echo.choices[0].text == base["prompt"] + plain.text


def test_structured_outputs_parse_and_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                  "strict": True}}
    msgs = [{"role": "user", "content": "Describe a person as JSON."}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=120,
                                          temperature=0.8, seed=3, response_format=fmt)
    assert valid(json.loads(full.choices[0].message.content), SCHEMA)
    streamed, _, _ = _stream_text(client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=120, temperature=0.8, seed=3,
        response_format=fmt, stream=True))
    assert streamed[0] == full.choices[0].message.content
    ask = [{"role": "user", "content": "Give me a JSON object with the keys name and age for "
                                       "Alice, 30."}]
    obj = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=80,
                                         temperature=0, response_format={"type": "json_object"})
    assert obj.choices[0].finish_reason == "stop"        # complete, not cut by max_tokens
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
    out = client.completions.create(model=MODEL, prompt="Today's date:", max_tokens=20,
                                    temperature=1.0, seed=5, n=2,
                                    extra_body={"structured_outputs": {"regex": date}})
    assert all(re.fullmatch(date, c.text) for c in out.choices)
    pick = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8,
                                     temperature=0,
                                     extra_body={"structured_outputs": {
                                         "choice": ["red", "blue", "green"]}})
    assert pick.choices[0].text in ("red", "blue", "green")
    gram = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=8,
                                     temperature=0, extra_body={"structured_outputs": {
                                         "grammar": 'root ::= ("yes" | "no") "!"'}})
    assert gram.choices[0].text in ("yes!", "no!")


def test_a_schema_the_engine_cannot_compile_is_a_400_that_says_why(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4,
                                           "structured_outputs": {"regex": "(unclosed"}})
    assert r.status_code == 400, r.text
    assert "regex" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4,
                                           "structured_outputs": {"grammar": "root ::= ("}})
    assert r.status_code == 400, r.text
    ok = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200           # and the server keeps serving


def _assemble(stream) -> tuple[dict[int, dict], str | None]:
    """Tool calls assembled from streamed deltas, and the finish reason."""
    calls: dict[int, dict] = {}
    reason = None
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function and tc.function.name:
                    call["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    call["arguments"] += tc.function.arguments
            reason = c.finish_reason or reason
    return calls, reason


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_calls_parse_and_the_stream_assembles_to_the_same_call(client, choice):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=80,
              temperature=0)
    full = client.chat.completions.create(**kw)
    c = full.choices[0]
    assert c.finish_reason == "tool_calls"
    call = c.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    assert call.function.name in ("get_weather", "get_time")
    assert "city" in args
    streamed, reason = _assemble(client.chat.completions.create(**kw, stream=True))
    assert reason == "tool_calls"
    assert streamed[0]["name"] == call.function.name
    assert json.loads(streamed[0]["arguments"]) == args


def test_a_conversation_with_tool_results_is_rendered_and_answered(client):
    msgs = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", '
                                                           '"unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    out = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS,
                                         max_tokens=24, temperature=0, tool_choice="none")
    assert out.choices[0].message.content and out.choices[0].finish_reason in ("stop", "length")


def test_the_body_vllms_benchmark_client_sends_is_served(http, model_dir):
    """As `vllm bench serve --backend vllm` sends it (vllm/benchmarks/lib/
    endpoint_request_func.py): repetition_penalty 1.0, logprobs null, stream with usage,
    ignore_eos, temperature in the extra body."""
    body = {"model": MODEL, "prompt": "Hello, my name is", "repetition_penalty": 1.0,
            "max_tokens": 8, "logprobs": None, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}
    events = []
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert events[-1]["usage"]["completion_tokens"] == 8
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"])


def test_grpc_generate_takes_the_same_fields(stack):
    with grpc.insecure_channel(stack.procs[-1].address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        params = pb.SamplingParams(max_tokens=10, temperature=0.9, seed=4, n=2,
                                   presence_penalty=0.5, min_tokens=2,
                                   structured=pb.StructuredOutput(
                                       choice=pb.ChoiceList(choices=["alpha", "beta"])))
        texts: dict[int, str] = {}
        usage = None
        for r in stub.Generate(pb.GenerateRequest(text="Pick one:", params=params),
                               timeout=120):
            texts[r.index] = texts.get(r.index, "") + r.text
            if r.HasField("usage"):
                usage = r.usage
        assert set(texts) == {0, 1} and all(t in ("alpha", "beta") for t in texts.values())
        assert usage is not None and usage.completion_tokens >= 2
        # echo: each choice starts with the prompt, a token-id prompt's special tokens too
        greedy = pb.SamplingParams(max_tokens=4, temperature=0, n=2)
        for prompt, echoed in ((dict(text="Pick one:"), "Pick one:"),
                               (dict(token_ids=pb.TokenIds(ids=[0, 0])), "<|endoftext|>" * 2)):
            echo, plain = ({}, {})
            for want, out in ((True, echo), (False, plain)):
                req = pb.GenerateRequest(**prompt, params=greedy, echo=want)
                for r in stub.Generate(req, timeout=120):
                    out[r.index] = out.get(r.index, "") + r.text
            assert echo == {i: echoed + plain[i] for i in (0, 1)}


LONG_PROMPT = "The history of the lighthouse keepers on the northern coast, told slowly: " * 6


def test_return_token_ids_gives_the_prompts_and_the_outputs_ids(http, model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}
    full = http.post("/v1/completions", json=body).json()
    (c,) = full["choices"]
    assert c["prompt_token_ids"] == tok("Once upon a time")["input_ids"]
    assert len(c["token_ids"]) == 6 and tok.decode(c["token_ids"]) == c["text"]
    with http.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == c["prompt_token_ids"]
    assert not any("prompt_token_ids" in k["choices"][0] for k in chunks[1:])
    assert [t for k in chunks for t in k["choices"][0]["token_ids"]] == c["token_ids"]
    chat = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "max_tokens": 5, "temperature": 0,
        "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] == tok.apply_chat_template(
        ASK, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.decode(chat["choices"][0]["token_ids"]) == chat["choices"][0]["message"]["content"]
    plain = http.post("/v1/completions", json=dict(body, return_token_ids=False)).json()
    assert "token_ids" not in plain["choices"][0]


def test_truncate_prompt_tokens_keeps_the_last_or_the_first_tokens(http, model_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir)(LONG_PROMPT)["input_ids"]
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0,
            "return_token_ids": True}
    left = http.post("/v1/completions", json=dict(body, truncate_prompt_tokens=10)).json()
    assert left["usage"]["prompt_tokens"] == 10
    assert left["choices"][0]["prompt_token_ids"] == ids[-10:]
    right = http.post("/v1/completions", json=dict(body, truncate_prompt_tokens=10,
                                                  truncation_side="right")).json()
    assert right["choices"][0]["prompt_token_ids"] == ids[:10]
    as_ids = http.post("/v1/completions", json=dict(body, prompt=ids[-10:])).json()
    assert as_ids["choices"][0]["token_ids"] == left["choices"][0]["token_ids"]
    whole = http.post("/v1/completions", json=dict(body, truncate_prompt_tokens=-1)).json()
    assert whole["usage"]["prompt_tokens"] == len(ids)
    for bad, says in ((0, "empty prompt"), (-2, "at least 1"), (10 ** 6, "context length")):
        r = http.post("/v1/completions", json=dict(body, truncate_prompt_tokens=bad))
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
    r = http.post("/v1/completions", json=dict(body, truncation_side="middle"))
    assert r.status_code == 400
    chat = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "max_tokens": 2, "truncate_prompt_tokens": 5}).json()
    assert chat["usage"]["prompt_tokens"] == 5


def test_continuous_usage_stats_and_cached_tokens(http):
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    first = http.post("/v1/completions", json=dict(body, stream=False, stream_options=None))
    prompt = first.json()["usage"]["prompt_tokens"]
    with http.stream("POST", "/v1/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    content, final = chunks[:-1], chunks[-1]
    counts = [k["usage"]["completion_tokens"] for k in content]
    assert counts == sorted(counts) and counts[-1] == 5 and counts[0] >= 1
    assert all(k["usage"]["prompt_tokens"] == prompt and k["usage"]["total_tokens"] ==
               prompt + k["usage"]["completion_tokens"] for k in content)
    # the same prompt again: blocks of it were cached by the first request (16-token blocks)
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5
    cached = final["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < prompt and cached % 16 == 0
    with http.stream("POST", "/v1/completions", json=dict(body, stream_options={
            "include_usage": True})) as r:
        plain = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all(k["usage"] is None for k in plain[:-1])
    # chat, as vLLM's suite reads it: after the role chunk the count grows with every chunk,
    # the finish rides on the last text's chunk, and only the usage chunk repeats the count
    chat = {"model": MODEL, "messages": ASK, "max_tokens": 6, "min_tokens": 6, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    with http.stream("POST", "/v1/chat/completions", json=chat) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [k["usage"]["completion_tokens"] for k in chunks[1:-1]]
    assert counts == sorted(set(counts)) and counts[-1] == 6
    last = chunks[-2]["choices"][0]
    assert last["finish_reason"] == "length" and last["delta"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_grpc_truncates_and_returns_prompt_ids_and_cached_tokens(stack):
    with grpc.insecure_channel(stack.procs[-1].address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        req = pb.GenerateRequest(text=LONG_PROMPT, params=pb.SamplingParams(max_tokens=3),
                                 truncate_prompt_tokens=40, truncation_side="right",
                                 return_prompt_token_ids=True, continuous_usage=True)
        first = list(stub.Generate(req, timeout=120))
        out = list(stub.Generate(req, timeout=120))   # the same 40 tokens again
        assert len(out[0].prompt_token_ids) == 40
        assert not any(r.prompt_token_ids for r in out[1:])
        counts = [r.usage.completion_tokens for r in out]     # speculation: several at once
        assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 3
        # the first request left the prompt's two whole 16-token blocks cached (the third holds
        # its last token, always computed); earlier tests may have cached some of them already
        assert first[-1].usage.cached_tokens in (0, 16, 32)
        assert out[-1].usage.prompt_tokens == 40 and out[-1].usage.cached_tokens == 32
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(pb.GenerateRequest(text="hi", truncate_prompt_tokens=0,
                                                  params=pb.SamplingParams(max_tokens=2)),
                               timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_json_is_laid_out_as_the_model_writes_it_unless_compact_is_asked(http):
    """The issue's case: greedy, a strict {name, age} schema, "Invent a person.": the model's
    own layout stops; one compact line is there by disable_any_whitespace (vLLM's field)."""
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Invent a person."}],
            "temperature": 0, "max_tokens": 60, "response_format": {
                "type": "json_schema", "json_schema": {"name": "p", "schema": schema,
                                                       "strict": True}}}
    free = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert free["finish_reason"] == "stop" and "\n" in free["message"]["content"]
    assert set(json.loads(free["message"]["content"])) == {"name", "age"}
    compact = http.post("/v1/chat/completions", json=dict(body, structured_outputs={
        "disable_any_whitespace": True})).json()["choices"][0]
    assert "\n" not in compact["message"]["content"]
    assert compact["message"]["content"].startswith('{"name": ')
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": ASK, "max_tokens": 4,
        "structured_outputs": {"disable_any_whitespace": True}})
    assert r.status_code == 400 and "applies to JSON outputs" in r.text


def test_jsonbench_counts_what_finishes_and_validates(stack, tmp_path, capsys):
    from pdserve.cli import build_parser

    out = tmp_path / "rows.json"
    args = build_parser().parse_args(["jsonbench", "--url", stack.procs[-1].http, "--cases", "2",
                                      "--out", str(out)])
    from pdserve.bench.jsonbench import main

    assert main(args) == 0
    rows = json.loads(out.read_text())
    assert [r["finish"] for r in rows] == ["stop", "stop"] and all(r["valid"] for r in rows)
    assert "finished with stop and valid: 2/2" in capsys.readouterr().out


def hf_prompt_logprobs(hf, ids: list[int]):
    """HF's log-softmax over the prompt's positions [len(ids), vocab] (fp32)."""
    import torch

    with torch.no_grad():
        return hf[1](torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_prompt_logprobs(hf, ids: list[int], entries: list, k: int) -> None:
    """vLLM's prompt_logprobs shape (None, then per token a dict of token id -> {logprob, rank,
    decoded_token}: the prompt's own token and the k best) with HF's values, to rounding."""
    ref = hf_prompt_logprobs(hf, ids)
    assert len(entries) == len(ids) and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        row, own = ref[i - 1], ids[i]
        assert str(own) in entry, (i, entry)
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {str(own), *map(str, top)}, (i, entry, top)
        for tid, e in entry.items():
            assert abs(e["logprob"] - float(row[int(tid)])) < 1e-3, (i, tid, e)
            # ranks count the strictly better tokens; values within rounding may swap
            better = int((row > row[int(tid)] + 1e-4).sum()) + 1
            close = int((row > row[int(tid)] - 1e-4).sum())
            assert better <= e["rank"] <= close, (i, tid, e, better, close)
            assert isinstance(e["decoded_token"], str)


@pytest.fixture(scope="module")
def hf(model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoTokenizer.from_pretrained(model_dir),
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())


def test_prompt_logprobs_match_hf_and_skip_the_prefix_cache(http, stack, hf):
    """prompt_logprobs on both endpoints: computed on the prefill worker from the prompt's own
    forward pass, vLLM's shape, HF's values; a repeat of the prompt (its blocks in the prefix
    cache now) scores every position again, reading nothing from the cache, as vLLM does."""
    prompt = "The capital of France is Paris. The capital of Spain is Madrid. The capital of"
    ids = hf[0](prompt).input_ids
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0,
            "prompt_logprobs": 3}
    first = http.post("/v1/completions", json=body).json()
    check_prompt_logprobs(hf, ids, first["choices"][0]["prompt_logprobs"], 3)
    again = http.post("/v1/completions", json={**body, "n": 2}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    for c in again["choices"]:                    # every choice of the prompt carries them
        assert c["prompt_logprobs"] == first["choices"][0]["prompt_logprobs"]
    zero = http.post("/v1/completions", json={**body, "prompt_logprobs": 0}).json()
    check_prompt_logprobs(hf, ids, zero["choices"][0]["prompt_logprobs"], 0)
    assert http.post("/v1/completions", json={k: v for k, v in body.items()
                                              if k != "prompt_logprobs"}
                     ).json()["choices"][0]["prompt_logprobs"] is None
    msgs = [{"role": "user", "content": "Name a colour."}]
    chat = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": msgs, "max_tokens": 2, "temperature": 0,
        "prompt_logprobs": 1}).json()
    check_prompt_logprobs(hf, hf[0].apply_chat_template(msgs, add_generation_prompt=True,
                                                        tokenize=True, return_dict=False),
                          chat["prompt_logprobs"], 1)
    assert chat["choices"][0]["message"]["content"]


def test_echo_with_logprobs_puts_the_prompt_first(client, http, model_dir):
    """echo + logprobs on /v1/completions, as vLLM answers it: the prompt's tokens lead the
    logprobs (the first with None), offsets run over the echoed text, streamed and not."""
    from gateway.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    prompt = "Roses are red, violets are"
    ids = tok.encode(prompt)
    base = dict(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    full = client.completions.create(**base, echo=True).choices[0]
    plain = client.completions.create(**base).choices[0]
    assert full.text == prompt + plain.text
    lp = full.logprobs
    n = len(ids) + len(plain.logprobs.tokens)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) \
        == len(lp.text_offset) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
    assert lp.tokens[len(ids):] == plain.logprobs.tokens
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    assert "".join(lp.tokens[:len(ids)]) == prompt
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert lp.text_offset[len(ids)] == len(prompt)
    detail = http.post("/v1/completions", json={**base, "echo": True,
                                                "prompt_logprobs": 2}).json()["choices"][0]
    own = [e[str(t)]["logprob"] for e, t in zip(detail["prompt_logprobs"][1:], ids[1:])]
    assert own == pytest.approx(lp.token_logprobs[1:len(ids)], abs=1e-4)
    tokens, values = [], []
    for chunk in client.completions.create(**base, echo=True, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert tokens == lp.tokens and values[0] is None
    assert values[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
    # a token-id prompt of special tokens echoes them, and the offsets count them
    specials = [0, 0, 0, 0, 0]
    echoed = tok.decode(specials, skip_special_tokens=False)
    assert echoed == "<|endoftext|>" * 5
    ids_echo = client.completions.create(**{**base, "prompt": specials}, echo=True).choices[0]
    ids_plain = client.completions.create(**{**base, "prompt": specials}).choices[0]
    assert ids_echo.text == echoed + ids_plain.text
    assert ids_echo.logprobs.text_offset[:6] == [0, 13, 26, 39, 52, 65]


def test_beam_search_answers_hf_beams_through_the_stack(client, http, hf):
    """use_beam_search with n as the width on both endpoints (vLLM's batch case: two copies of
    a prompt, two beams each), the first token's candidates from the prefill worker, the beams
    on the decode worker: HF's beams, best first."""
    from tests.test_beam_search import _hf_beams

    prompt = "The best way to learn a language is"
    batch = client.completions.create(model=MODEL, prompt=[prompt, prompt], n=2, max_tokens=8,
                                      temperature=0.0, extra_body={"use_beam_search": True})
    texts = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]
    assert len(texts) == 4 and texts[0] != texts[1]
    assert texts[0] == texts[2] and texts[1] == texts[3]
    ref = _hf_beams(hf, hf[0](prompt).input_ids, 2, 1.0, False, 8)
    assert texts[:2] == [hf[0].decode(b, skip_special_tokens=True) for b in ref]
    assert batch.usage.completion_tokens == 2 * sum(len(b) for b in ref)
    msgs = [{"role": "user", "content": "What is the capital of Italy?"}]
    chat = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": msgs, "n": 3, "max_tokens": 20, "use_beam_search": True,
        "length_penalty": 0.5, "early_stopping": True}).json()
    ids = hf[0].apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                    return_dict=False)
    ref = _hf_beams(hf, ids, 3, 0.5, True, 20)
    got = sorted(chat["choices"], key=lambda c: c["index"])
    assert [c["message"]["content"] for c in got] == [
        hf[0].decode(b, skip_special_tokens=True) for b in ref]
    assert [c["finish_reason"] for c in got] == ["stop" if b[-1] == 2 else "length" for b in ref]


def test_top_logprobs_counts_as_vllm_gives_them(client):
    """logprobs=k on completions: k alternatives per token, the chosen one added when it is not
    among them (0: the chosen one alone); chat's top_logprobs: exactly k; none when not asked."""
    base = dict(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5, temperature=0)
    for k, least, most in ((0, 1, 1), (5, 5, 6)):
        lp = client.completions.create(**base, logprobs=k).choices[0].logprobs
        assert len(lp.top_logprobs) == len(lp.token_logprobs) == 5
        assert all(least <= len(t) <= most for t in lp.top_logprobs)
        assert all(tok in t for tok, t in zip(lp.tokens, lp.top_logprobs))
    assert client.completions.create(**base).choices[0].logprobs is None
    chat = dict(model=MODEL, messages=ASK, max_completion_tokens=5, temperature=0)
    for k in (0, 5):
        content = client.chat.completions.create(**chat, logprobs=True,
                                                 top_logprobs=k).choices[0].logprobs.content
        assert len(content) == 5 and all(len(c.top_logprobs) == k for c in content)
    assert client.chat.completions.create(**chat, logprobs=False).choices[0].logprobs is None
