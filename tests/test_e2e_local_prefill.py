"""Conditional disaggregation: with the gateway told to compute prompts on the decode worker,
greedy output still equals HF, the prefill worker computes nothing, and blocks come back."""

from __future__ import annotations

import grpc
import httpx
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.stack import standard_stack
from tests.test_e2e import PLAIN, grpc_generate, hf, hf_greedy, prompt_ids  # noqa: F401
from tests.test_e2e_batching import metric

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    with standard_stack(model_dir, tmp_path_factory.mktemp("stack"),
                        gateway_args=("--local-prefill-max-tokens", "4096",
                                      "--local-prefill-queue", "0")) as s:
        yield s


def test_local_prefill_matches_hf_and_skips_the_prefill_worker(stack, hf):
    with grpc.insecure_channel(stack.procs[-1].address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        for p in PLAIN:
            toks, _, _, usage = grpc_generate(stub, text=p, params=pb.SamplingParams(
                temperature=0.0, max_tokens=24))
            ref = hf_greedy(hf, prompt_ids(hf, plain=p), 24)
            assert toks == ref
            assert usage.completion_tokens == len(ref)
    prefill = next(p for p in stack.procs if p.name == "prefill")
    decode = next(p for p in stack.procs if p.name == "decode")
    assert metric(prefill.metrics, "pdserve_prompt_tokens_computed_total") == 0
    assert metric(decode.metrics, "pdserve_prompt_tokens_computed_total") >= sum(
        len(prompt_ids(hf, plain=p)) for p in PLAIN)
    gateway = httpx.get(stack.procs[-1].http + "/metrics", timeout=10).text
    assert 'pdserve_routing_decisions_total{prefill="decode-local"} 3.0' in gateway
    assert metric(decode.metrics, "pdserve_kv_blocks_free") == metric(
        decode.metrics, "pdserve_kv_blocks_total")


def test_prompt_logprobs_of_a_prompt_computed_on_the_decode_worker(stack, hf):
    """The decode worker computed the prompt: it scores it too (the first TokenBatch carries
    them), on REST and on gRPC (GenerateResponse.prompt_logprobs on the choice's first)."""
    from tests.test_e2e_openai_api import check_prompt_logprobs

    prompt = "One, two, three, four, five, six"
    ids = prompt_ids(hf, plain=prompt)
    body = httpx.post(stack.procs[-1].http + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}).json()
    check_prompt_logprobs(hf, ids, body["choices"][0]["prompt_logprobs"], 2)
    with grpc.insecure_channel(stack.procs[-1].address) as ch:
        first = next(iter(pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            text=prompt, params=pb.SamplingParams(temperature=0.0, max_tokens=2,
                                                  prompt_logprobs=2)), timeout=120)))
    assert [lp.token_id for lp in first.prompt_logprobs] == ids[1:]
    rest = body["choices"][0]["prompt_logprobs"][1:]
    for lp, entry in zip(first.prompt_logprobs, rest):
        assert abs(lp.logprob - entry[str(lp.token_id)]["logprob"]) < 1e-4
        assert lp.rank == entry[str(lp.token_id)]["rank"] and len(lp.top) == 2
    prefill = next(p for p in stack.procs if p.name == "prefill")
    assert metric(prefill.metrics, "pdserve_prompt_tokens_computed_total") == 0


def test_beam_search_over_grpc_with_the_prompt_computed_on_the_decode_worker(stack, hf):
    """The decode worker computes the prompt and runs the beams from its own last row:
    GenerateResponse per choice, HF's beams best first."""
    from tests.test_beam_search import _hf_beams

    prompt = "My favourite colour is"
    with grpc.insecure_channel(stack.procs[-1].address) as ch:
        got: dict[int, list[int]] = {}
        for r in pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                text=prompt, params=pb.SamplingParams(max_tokens=10, beam_width=3)),
                timeout=120):
            got.setdefault(r.index, []).extend(r.token_ids)
    assert [got[i] for i in range(3)] == _hf_beams(hf, prompt_ids(hf, plain=prompt), 3, 1.0,
                                                   False, 10)
