"""LoRA adapters through the real stack: a tiny Llama (the default model's vocabulary) with
adapters written here, gateway -> prefill worker -> KV transfer -> decode worker, both workers
applying the request's adapter. Requests of the base model and of two adapters at once give
HF's greedy tokens with each adapter merged (W + s B A); adapters load and unload over REST on
every worker, bad ones are refused with the reason and the stack keeps serving."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.stack import copy_tokenizer, metric, standard_stack, wait_idle
from tests.test_lora import hf_greedy, make_base, merged, write_adapter

pytestmark = pytest.mark.slow

NAME = ("--served-model-name", "tiny-llama")
NEW = 10


@pytest.fixture(scope="module")
def tiny_llama(model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    hf = make_base(d, vocab_size=49152, max_position_embeddings=2048)
    copy_tokenizer(model_dir, d)
    return d, hf


def complete(base: str, model: str, ids: list[int]) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", timeout=300, json={
        "model": model, "prompt": ids, "max_tokens": NEW, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})


def tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_adapters_through_prefill_transfer_and_decode(tiny_llama, tmp_path):
    d, hf = tiny_llama
    w1, s1 = write_adapter(tmp_path / "one", ["q_proj", "v_proj", "o_proj", "down_proj"], 4, 8,
                           seed=1)
    w2, s2 = write_adapter(tmp_path / "two", ["k_proj", "gate_proj", "up_proj"], 8, 16, seed=2)
    write_adapter(tmp_path / "wide", ["q_proj"], 32, 32, seed=3)
    w3, s3 = write_adapter(tmp_path / "three", ["v_proj", "up_proj"], 4, 4, seed=4)
    lora = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
            "--lora-modules", f"one={tmp_path / 'one'}")
    gateway = (*NAME, "--lora-modules", f"three={tmp_path / 'three'}")   # loaded on demand
    with standard_stack(d, tmp_path, gateway_args=gateway, prefill_args=(*NAME, *lora),
                        decode_args=(*NAME, *lora)) as s:
        base = s.procs[-1].http
        models = httpx.get(f"{base}/v1/models", timeout=10).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [
            ("tiny-llama", None), ("one", "tiny-llama"), ("three", "tiny-llama")]
        # no worker has `three`: the first request loads it on a worker of each role
        assert tokens(complete(base, "three", [9, 8, 7] * 6)) == hf_greedy(
            merged(hf, w3, s3), [9, 8, 7] * 6, NEW)
        r = httpx.post(f"{base}/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": "two", "lora_path": str(tmp_path / "two")})
        assert r.status_code == 200 and "added successfully" in r.text, r.text
        prompts = [[17, 400, 9, 3000, 25, 8, 8, 120, 77, 5, 1000, 42, 7, 7, 9, 300, 11] * 2,
                   [5, 9, 17, 3, 3, 100, 41, 8, 8, 2] * 3]
        m1, m2 = merged(hf, w1, s1), merged(hf, w2, s2)
        cases = [("tiny-llama", prompts[0], hf), ("one", prompts[0], m1),
                 ("two", prompts[0], m2), ("one", prompts[1], m1), ("tiny-llama", prompts[1], hf)]
        with ThreadPoolExecutor(len(cases)) as pool:      # the adapters batched together
            got = list(pool.map(lambda c: tokens(complete(base, c[0], c[1])), cases))
        want = [hf_greedy(m, p, NEW) for _, p, m in cases]
        assert got == want
        assert want[0] != want[1] != want[2]
        assert metric(s.proc("decode").metrics, "pdserve_kv_transfer_blocks_total") > 0
        # refused with the reason, and nothing else changes
        r = httpx.post(f"{base}/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": "wide", "lora_path": str(tmp_path / "wide")})
        assert r.status_code == 400 and "exceeds --max-lora-rank 8" in r.text, r.text
        r = httpx.post(f"{base}/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": "gone", "lora_path": str(tmp_path / "nothing")})
        assert r.status_code == 400 and "not a folder" in r.text, r.text
        r = complete(base, "wide", prompts[1])
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        with grpc.insecure_channel(s.procs[-1].address) as ch:      # the same over gRPC
            stub = pb_grpc.GenerationStub(ch)
            assert list(stub.LoRA(pb.LoRARequest(name="two"), timeout=60).loaded) == ["one",
                                                                                "three"]
            with pytest.raises(grpc.RpcError) as err:
                stub.LoRA(pb.LoRARequest(name="wide", path=str(tmp_path / "wide")), timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "exceeds --max-lora-rank" in err.value.details()
        assert complete(base, "two", prompts[1]).status_code == 404
        assert tokens(complete(base, "one", prompts[1])) == want[3]     # still serving
        r = httpx.post(f"{base}/v1/unload_lora_adapter", timeout=60, json={"lora_name": "two"})
        assert r.status_code == 404, r.text
        wait_idle(s.proc("prefill"), s.proc("decode"), timeout_s=10)
