"""The whole stack as real processes: redis-server, a prefill worker, a decode worker and the
gateway, on the real default model in fp32. Greedy output must equal HF transformers' generate()
token for token."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
import torch

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.stack import idle, standard_stack, wait_idle, worker_stats

pytestmark = pytest.mark.slow

PLAIN = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
CHATS = [
    [{"role": "user", "content": "What is the tallest mountain in the world?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
NEW = 40


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    with standard_stack(model_dir, tmp_path_factory.mktemp("stack")) as s:
        yield s


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.procs[-1].http, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def gen_stub(stack):
    with grpc.insecure_channel(stack.procs[-1].address) as ch:
        yield pb_grpc.GenerationStub(ch)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tok, model


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    tok, model = hf
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                         pad_token_id=tok.eos_token_id)
    return out[0, len(ids):].tolist()


def prompt_ids(hf, plain: str | None = None, chat: list | None = None) -> list[int]:
    tok = hf[0]
    if chat is not None:
        return tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    return tok(plain).input_ids


def grpc_generate(stub, **kw) -> tuple[list[int], str, str, pb.Usage]:
    ids, text, reason, usage = [], "", "", None
    for r in stub.Generate(pb.GenerateRequest(**kw), timeout=180):
        ids += r.token_ids
        text += r.text
        reason = r.finish_reason or reason
        if r.HasField("usage"):
            usage = r.usage
    return ids, text, reason, usage


def greedy(n=NEW, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0.0, max_tokens=n, **kw)


def test_greedy_tokens_equal_hf_concurrently(hf, gen_stub):
    cases = [dict(text=p) for p in PLAIN] + [
        dict(chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in c])) for c in CHATS]
    refs = [prompt_ids(hf, plain=p) for p in PLAIN] + [prompt_ids(hf, chat=c) for c in CHATS]
    with ThreadPoolExecutor(len(cases)) as ex:
        got = list(ex.map(lambda c: grpc_generate(gen_stub, params=greedy(), **c), cases))
    for ids, (toks, text, reason, usage) in zip(refs, got):
        ref = hf_greedy(hf, ids, NEW)
        assert toks == ref, (hf[0].decode(toks), hf[0].decode(ref))
        assert usage.prompt_tokens == len(ids) and usage.completion_tokens == len(ref)
        assert reason == ("stop" if ref[-1] == hf[0].eos_token_id else "length")
        assert text == hf[0].decode(ref, skip_special_tokens=True)


def test_rest_completion_and_chat_equal_hf(hf, http):
    tok = hf[0]
    r = http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": PLAIN[1],
                                           "max_tokens": 32, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ref = hf_greedy(hf, prompt_ids(hf, plain=PLAIN[1]), 32)
    assert body["choices"][0]["text"] == tok.decode(ref, skip_special_tokens=True)
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert body["usage"] == {"prompt_tokens": len(prompt_ids(hf, plain=PLAIN[1])),
                             "completion_tokens": 32, "total_tokens": body["usage"]["total_tokens"],
                             "prompt_tokens_details": {"cached_tokens": cached}}
    assert 0 <= cached < body["usage"]["prompt_tokens"] and cached % 16 == 0
    r = http.post("/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct",
                                                "messages": CHATS[1], "max_tokens": 32,
                                                "temperature": 0})
    assert r.status_code == 200, r.text
    ref = hf_greedy(hf, prompt_ids(hf, chat=CHATS[1]), 32)
    msg = r.json()["choices"][0]
    assert msg["message"]["content"] == tok.decode(ref, skip_special_tokens=True)
    assert msg["finish_reason"] == ("stop" if ref[-1] == tok.eos_token_id else "length")


def test_prompt_as_token_ids(hf, http):
    ids = prompt_ids(hf, plain=PLAIN[0])
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 8, "temperature": 0,
                                           "model": "SmolLM2-135M-Instruct"})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == hf[0].decode(hf_greedy(hf, ids, 8),
                                                          skip_special_tokens=True)


def sse_events(resp) -> list:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            events.append(line[6:])
    return events


def test_stream_assembles_to_non_stream(http):
    req = {"model": "SmolLM2-135M-Instruct", "messages": CHATS[2], "max_tokens": 40,
           "temperature": 0.8, "seed": 7}
    full = http.post("/v1/chat/completions", json=req).json()
    with http.stream("POST", "/v1/chat/completions",
                     json=dict(req, stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == full["choices"][0]["message"]["content"]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert reasons[-1] == full["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == []
    streamed, plain = dict(chunks[-1]["usage"]), dict(full["usage"])
    # the stream's prompt finds the first request's blocks cached: every whole block of it
    # (16 tokens, the workers' default) but where its last token is, which is always computed
    cached = streamed.pop("prompt_tokens_details")["cached_tokens"]
    plain.pop("prompt_tokens_details")
    assert cached == (streamed["prompt_tokens"] - 1) // 16 * 16 > 0, (cached, streamed)
    assert streamed == plain


def test_seeded_sampling_is_reproducible(http):
    req = {"model": "SmolLM2-135M-Instruct", "prompt": PLAIN[2], "max_tokens": 24,
           "temperature": 1.0, "top_p": 0.95, "top_k": 50, "seed": 1234}
    a, b = (http.post("/v1/completions", json=req).json()["choices"][0]["text"] for _ in range(2))
    assert a == b
    others = {http.post("/v1/completions", json=dict(req, seed=s)).json()["choices"][0]["text"]
              for s in (1, 2, 3)}
    assert len(others | {a}) > 1


def test_stop_strings_cut_the_text(http):
    base = {"model": "SmolLM2-135M-Instruct", "prompt": PLAIN[1], "max_tokens": 32,
            "temperature": 0}
    full = http.post("/v1/completions", json=base).json()["choices"][0]["text"]
    stop = "return"
    assert stop in full
    for stream in (False, True):
        req = dict(base, stop=[stop, "never-appears"], stream=stream)
        if stream:
            with http.stream("POST", "/v1/completions", json=req) as r:
                chunks = [json.loads(e) for e in sse_events(r)[:-1]]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            reason = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
        else:
            choice = http.post("/v1/completions", json=req).json()["choices"][0]
            text, reason = choice["text"], choice["finish_reason"]
        assert text == full[:full.index(stop)]
        assert reason == "stop"


def test_logprobs_match_hf(hf, http):
    tok, model = hf
    ids = prompt_ids(hf, plain=PLAIN[0])
    r = http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": PLAIN[0],
                                           "max_tokens": 4, "temperature": 0, "logprobs": 3})
    lp = r.json()["choices"][0]["logprobs"]
    ref = hf_greedy(hf, ids, 4)
    with torch.no_grad():
        logits = model(torch.tensor([ids + ref])).logits[0, len(ids) - 1:-1].log_softmax(-1)
    want = [float(logits[i, t]) for i, t in enumerate(ref)]
    assert lp["token_logprobs"] == pytest.approx(want, abs=1e-3)
    assert all(len(t) == 3 for t in lp["top_logprobs"])


def test_openai_client(stack):
    import openai

    client = openai.OpenAI(base_url=stack.procs[-1].http + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=CHATS[0], max_tokens=12,
                                       temperature=0)
    text = r.choices[0].message.content
    assert text and r.usage.completion_tokens <= 12
    stream = client.chat.completions.create(model=model, messages=CHATS[0], max_tokens=12,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    c = client.completions.create(model=model, prompt=PLAIN[0], max_tokens=5, temperature=0)
    assert c.choices[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=PLAIN[0], max_tokens=0)


BAD = [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "", "max_tokens": 4}, "prompt"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "n": 17}, "n"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": "hi", "max_tokens": 9000}, "max_tokens"),
    ({"prompt": "hi", "bogus_field": 1}, "bogus_field"),
]


@pytest.mark.parametrize("body,param", BAD)
def test_bad_completion_requests_get_400(http, body, param):
    r = http.post("/v1/completions", json=dict({"model": "SmolLM2-135M-Instruct"}, **body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]


def test_malformed_json_unknown_model_and_empty_messages(http):
    r = http.post("/v1/chat/completions", content=b"{not json",
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = http.post("/v1/chat/completions", json={"model": "nope", "messages": CHATS[0]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.post("/v1/chat/completions", json={"model": "SmolLM2-135M-Instruct",
                                                "messages": []})
    assert r.status_code == 400
    assert http.get("/health").status_code == 200          # and the server keeps serving


def test_grpc_bad_input_is_invalid_argument(gen_stub):
    for params in (pb.SamplingParams(max_tokens=0), pb.SamplingParams(max_tokens=4,
                                                                       temperature=-1)):
        with pytest.raises(grpc.RpcError) as e:
            list(gen_stub.Generate(pb.GenerateRequest(text="hi", params=params), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(gen_stub.Generate(pb.GenerateRequest(text="", params=greedy()), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_client_disconnect_frees_request_on_every_worker(stack, http):
    req = {"model": "SmolLM2-135M-Instruct", "prompt": PLAIN[2], "max_tokens": 2000,
           "temperature": 0, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=req) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) >= 3:
                break
        assert all('"error"' not in e and e != "data: [DONE]" for e in events), events
        workers = stack.proc("prefill"), stack.proc("decode")
        assert not idle(*workers), ("the request should be running while we read it",
                                    [worker_stats(p) for p in workers], events)
    wait_idle(*workers, timeout_s=20)


def test_metrics_endpoints(stack, http):
    http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": PLAIN[0],
                                       "max_tokens": 4, "temperature": 0})
    text = http.get("/metrics").text
    for name in ("pdserve_time_to_first_token_seconds_count", "pdserve_inter_token_latency_seconds",
                 "pdserve_e2e_request_latency_seconds_count", "pdserve_requests_in_flight"):
        assert name in text, name
    ttft_count = next(float(line.split()[-1]) for line in text.splitlines()
                      if line.startswith("pdserve_time_to_first_token_seconds_count"))
    assert ttft_count >= 1
    for role in ("prefill", "decode"):
        worker = next(p for p in stack.procs if p.name == role)
        body = httpx.get(worker.metrics, timeout=10).text
        for name in ("pdserve_requests_running", "pdserve_requests_waiting",
                     "pdserve_kv_usage_ratio", "pdserve_engine_steps_total",
                     "pdserve_step_batch_sequences_bucket", "pdserve_step_batch_tokens_bucket"):
            assert name in body, (role, name)
        steps = next(float(line.split()[-1]) for line in body.splitlines()
                     if line.startswith("pdserve_engine_steps_total"))
        assert steps >= 1, role
        # every step counted by the threads it ran on (one here: the stack's workers run
        # --threads 1, which the core share leaves alone)
        by_threads = {line.split('threads="')[1].split('"')[0]: float(line.split()[-1])
                      for line in body.splitlines()
                      if line.startswith("pdserve_engine_steps_by_threads_total")}
        assert by_threads == {"1": steps}, (role, by_threads)
