"""Continuous batching through the real stack: 24 concurrent greedy streams, on a decode worker
whose KV pool is too small for all of them at once (so some are preempted and recomputed), each
give exactly the tokens they give alone; afterwards both pools are all free."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc
from tests.stack import metric, standard_stack, wait_idle

pytestmark = pytest.mark.slow

WORDS = ["river", "castle", "engine", "garden", "planet", "violin", "harbor", "forest"]
PROMPTS = [f"Write one sentence about a {w}{'.' * (i % 3)}" for i, w in
           enumerate(WORDS * 3)]
NEW = 24


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    # 20 blocks of 16 tokens on the decode worker: 24 requests of ~8 + 24 tokens need 48, and
    # a third of them fill the pool, so the first to cross a block boundary preempts one
    with standard_stack(model_dir, tmp_path_factory.mktemp("stack"),
                        decode_args=("--num-blocks", "20")) as s:
        yield s


def generate(stub, prompt: str) -> list[int]:
    ids = []
    for r in stub.Generate(pb.GenerateRequest(text=prompt, params=pb.SamplingParams(
            temperature=0.0, max_tokens=NEW, ignore_eos=True)), timeout=300):
        ids += r.token_ids
    return ids


def test_concurrent_streams_equal_single_requests_with_preemption(stack):
    with grpc.insecure_channel(stack.procs[-1].address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        alone = [generate(stub, p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            together = list(ex.map(lambda p: generate(stub, p), PROMPTS))
    assert all(len(t) == NEW for t in alone)
    assert together == alone
    decode = next(p for p in stack.procs if p.name == "decode")
    assert metric(decode.metrics, "pdserve_preemptions_total") > 0
    assert metric(decode.metrics, "pdserve_step_batch_sequences_count") > 0
    wait_idle(stack.proc("prefill"), stack.proc("decode"), timeout_s=10)
