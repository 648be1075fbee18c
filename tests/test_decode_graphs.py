"""Decode steps through graph buckets: the batch staged, padded to its bucket (padding rows store
no KV and attend nothing) and replayed from the static buffers gives exactly the eager step's
tokens. On CPUs a stand-in replays by running the forward again on the buffers and metadata it
was "captured" with (what a CUDA graph replays); the triton backend's kernels run under the
interpreter. The buckets themselves, and the device defaults of the worker flags."""

from __future__ import annotations

import argparse

import pytest

import torch

from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, graph_buckets
from engine.engine import Engine
from engine.request import Request, SamplingParams
from pdserve.launcher import place_workers
from serving.worker import _spec_config, resolve_device_defaults, resolve_speculative
from tests.test_model_parity import make_model


class ReplayOnBuffers(DecodeGraphs):
    """capture(): per bucket, the metadata staged for it; replay(): the forward over the same
    static buffers and metadata, as a captured graph would run it."""

    def capture(self) -> None:
        self.replays = []
        self._meta = {b: self.runner.stage_empty_decode(b) for b in self.buckets}

    def replay(self, bucket: int) -> torch.Tensor:
        r = self.runner
        self.replays.append(bucket)
        d = r.buffers.dev
        with torch.inference_mode():
            return r.model(d["input_ids"][:bucket], d["positions"][:bucket], r.kv,
                           self._meta[bucket])


def run(eng: Engine) -> dict[str, list[int]]:
    prompts = [[5, 9, 17, 3, 3, 100, 41], [7] * 13, [1, 2, 3]]
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.0 if i != 1 else 0.8, seed=3, max_tokens=5,
                                ignore_eos=True)
        eng.add_request(Request(str(i), p, params))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while eng.has_work():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


def test_padded_bucket_replays_give_the_eager_tokens(tmp_path):
    make_model(tmp_path, "llama")
    cfg = EngineConfig(num_blocks=32, block_size=4, max_num_batched_tokens=16, max_num_seqs=5,
                       attention_backend="triton")
    want = run(Engine(tmp_path, cfg))
    eng = Engine(tmp_path, cfg)
    eng.runner.graphs = graphs = ReplayOnBuffers(eng.runner, cfg.max_num_seqs)
    graphs.capture()
    assert run(eng) == want
    # 3 sequences decode in bucket 4 (one padding row), then fewer as they finish
    assert graphs.replays and set(graphs.replays) <= {1, 2, 4} and 4 in graphs.replays
    assert eng.pool.num_free == eng.pool.num_blocks      # padding rows stored nothing


def test_graph_buckets():
    assert graph_buckets(1) == [1]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(100)[-3:] == [80, 96, 100]
    assert graph_buckets(256)[-2:] == [240, 256]


def test_worker_defaults_follow_the_device():
    args = argparse.Namespace(device="cuda:1", dtype="auto", max_num_batched_tokens=0,
                              max_num_seqs=0)
    assert resolve_device_defaults(args) == dict(dtype="bfloat16", max_num_batched_tokens=2048,
                                                 max_num_seqs=256, long_prefill_tokens=0)
    args.device, args.max_num_seqs = "cpu", 8
    assert resolve_device_defaults(args) == dict(dtype="float32", max_num_batched_tokens=512,
                                                 max_num_seqs=8, long_prefill_tokens=0)
    # a CPU prefill worker's step, and its chunk cap while prompts wait (0: a quarter)
    for role, budget, cap in (("decode", 512, 0), ("prefill", 256, 128)):
        got = resolve_device_defaults(args, role)
        assert (got["max_num_batched_tokens"], got["long_prefill_tokens"]) == (budget, cap)
    args.long_prefill_tokens = 32
    assert resolve_device_defaults(args, "prefill")["long_prefill_tokens"] == 32
    args.device, args.long_prefill_tokens = "cuda:0", 0
    assert resolve_device_defaults(args, "prefill") == dict(
        dtype="bfloat16", max_num_batched_tokens=2048, max_num_seqs=8, long_prefill_tokens=0)
    args.device, args.max_num_batched_tokens = "cpu", 1024
    got = resolve_device_defaults(args, "prefill")
    assert (got["max_num_batched_tokens"], got["long_prefill_tokens"]) == (1024, 0)
    assert place_workers("cuda", num_gpus=2) == ("cuda:0", "cuda:1", 0.9)
    assert place_workers("cuda", num_gpus=1) == ("cuda:0", "cuda:0", 0.45)
    assert place_workers("cuda:2,cuda:3") == ("cuda:2", "cuda:3", 0.9)
    assert place_workers("cpu") == ("cpu", "cpu", 0.9)
    # tensor parallel: a worker takes its GPU and the next N-1
    assert place_workers("cuda", num_gpus=8, prefill_tp=4, decode_tp=4) == ("cuda:0", "cuda:4",
                                                                            0.9)
    assert place_workers("cuda", num_gpus=3, prefill_tp=1, decode_tp=2) == ("cuda:0", "cuda:1",
                                                                            0.9)
    assert place_workers("cuda", num_gpus=2, prefill_tp=2, decode_tp=1) == ("cuda:0", "cuda:0",
                                                                            0.45)
    assert place_workers("cuda:0,cuda:1", prefill_tp=2) == ("cuda:0", "cuda:1", 0.45)
    assert place_workers("cuda:0,cuda:2", prefill_tp=2) == ("cuda:0", "cuda:2", 0.9)
    with pytest.raises(ValueError, match="tensor parallel size 4 needs as many GPUs; 2"):
        place_workers("cuda", num_gpus=2, prefill_tp=4)


def test_speculation_by_default_on_a_cpu_worker_of_one_process():
    """--speculative auto (the default): n-gram proposals on a CPU decode worker of one
    process, off on a GPU and across tensor-parallel ranks; a value given is kept, and the
    engine settings carry the step-growth bound."""
    from tests.test_launcher import _subcommand

    args = _subcommand("decode").parse_args(["--model", "m"])
    assert (args.speculative, args.spec_max_step_growth) == ("auto", 0.1)
    assert resolve_speculative(args) == "ngram"
    assert _spec_config(args)["speculative"] == "ngram"
    assert _spec_config(args)["spec_max_step_growth"] == 0.1
    args.tensor_parallel_size = 2
    assert resolve_speculative(args) == "off" and _spec_config(args) == {}
    args.device, args.tensor_parallel_size = "cuda:0", 1
    assert resolve_speculative(args) == "off"
    for given in ("off", "ngram", "draft:/m"):
        args.speculative = given
        assert resolve_speculative(args) == given

