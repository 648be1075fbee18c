"""The whole engine through the triton attention backend (and its norm / activation kernels)
gives the same greedy tokens as the torch backend: tiny random-weight models, chunked prefill
after a cached prefix, decodes, speculative verification. On CPUs the kernels run under
Triton's interpreter (tests/conftest.py); PDSERVE_TEST_DEVICE=cuda runs this on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.request import Request, SamplingParams
from tests.test_model_parity import make_model

DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
PROMPTS = [[5, 9, 17, 3, 3, 100, 41, 7, 7, 2], [7] * 13, [1, 2, 3]]
LATER = [5, 9, 17, 3, 3, 100, 41, 7, 11, 12, 13, 14, 15]   # the first's 2 blocks, then 5 new


def generate(model_dir, backend: str, rounds=(PROMPTS, [LATER]), max_tokens: int = 6, **cfg
             ) -> tuple[dict[str, list[int]], Engine]:
    cfg = {"num_blocks": 48, **cfg}
    eng = Engine(model_dir, EngineConfig(block_size=4, max_num_batched_tokens=8,
                                         device=DEVICE, attention_backend=backend, **cfg))
    assert eng.runner.backend.name == backend
    got: dict[str, list[int]] = {}
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for batch in rounds:                      # the second round starts from a cached prefix
        for p in batch:
            eng.add_request(Request(str(len(got)), p, params))
            got[str(len(got))] = []
        while eng.has_work():
            for o in eng.step():
                got[o.request_id].extend(o.new_token_ids)
    assert eng.pool.num_free == eng.pool.num_blocks
    return got, eng


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_triton_backend_gives_the_torch_backends_greedy_tokens(tmp_path, family):
    make_model(tmp_path, family)
    want, _ = generate(tmp_path, "torch")
    got, eng = generate(tmp_path, "triton")
    assert got == want
    assert len(want) == len(PROMPTS) + 1 and all(len(t) == 6 for t in want.values())
    assert eng.kv_manager.hit_tokens == 8         # the later prompt found the first's blocks


def test_triton_backend_verifies_ngram_proposals_as_torch_does(tmp_path):
    make_model(tmp_path, "qwen2")
    rounds = ([[5, 9, 17, 3, 5, 9, 17, 3, 5, 9], [1, 2, 3, 1, 2, 3, 1, 2]],)
    want, _ = generate(tmp_path, "torch", rounds, 12)
    got, eng = generate(tmp_path, "triton", rounds, 12, speculative="ngram",
                        num_speculative_tokens=3)
    assert got == want
    assert eng.stats.spec_proposed > 0


@pytest.mark.parametrize("family", ["qwen2_moe", "glm4_moe"])
def test_triton_moe_backend_gives_the_torch_backends_greedy_tokens(tmp_path, family):
    """An MoE model on the triton backends: attention and the fused-MoE kernel (its experts'
    backend under auto) against the torch attention backend with the reference experts."""
    from engine.layers.moe import Experts
    from tests.moe_models import make_moe

    make_moe(tmp_path, family)
    want, _ = generate(tmp_path, "torch", moe_backend="reference")
    got, eng = generate(tmp_path, "triton")
    assert {m.method.name for m in eng.model.modules() if isinstance(m, Experts)} == {"triton"}
    assert got == want


def test_triton_backend_keeps_block_tables_on_the_device_through_preemption(tmp_path):
    """Block tables stay on the device across steps (engine.attention.block_tables): with a
    pool small enough to preempt (a re-admitted request's table has a new id) and more
    requests than resident rows (rows evicted and reused), the tokens are the torch
    backend's, and the steps uploaded fewer entries than whole tables every step would."""
    make_model(tmp_path, "llama")
    prompts = [[3 + i, 9, 17, 3, 3 + i, 100, 41, 7, 7, i] for i in range(6)]
    cfg = dict(num_blocks=8, max_num_seqs=2)
    want, _ = generate(tmp_path, "torch", ([*prompts],), 10, **cfg)
    got, eng = generate(tmp_path, "triton", ([*prompts],), 10, **cfg)
    assert got == want
    assert eng.stats.preemptions > 0
    tables = eng.runner.backend.tables
    assert tables.rows == 4
    # whole tables each step: >= 3 blocks x 2 sequences x ~60 steps
    assert 0 < tables.entries_staged < eng.stats.steps * 2


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_triton_backend_gives_the_torch_backends_tokens_for_sliding_layers(tmp_path, family):
    """Sliding windows shorter than the prompts, soft-capped scores (Gemma 2), a local rotary
    base (Gemma 3): the Triton kernels give the torch path's greedy tokens."""
    from tests.test_attention_families import make_model as make_sliding

    make_sliding(tmp_path, family)
    want, _ = generate(tmp_path, "torch", max_tokens=10)
    got, _ = generate(tmp_path, "triton", max_tokens=10)
    assert got == want


def test_gpt_oss_on_the_triton_attention_backend(tmp_path):
    """gpt-oss on CUDA's path: the Triton attention kernel with its sliding layers and sinks,
    the fused MoE kernel with the experts' biases and clamped SwiGLU."""
    from engine.layers.moe import Experts
    from tests.moe_models import make_moe

    make_moe(tmp_path, "gpt_oss")
    want, _ = generate(tmp_path, "torch", moe_backend="reference")
    got, eng = generate(tmp_path, "triton")
    assert {m.method.name for m in eng.model.modules() if isinstance(m, Experts)} == {"triton"}
    assert got == want


def test_lora_adapters_on_the_triton_backend(tmp_path):
    """CUDA's LoRA path (pdkernels.triton_lora, chosen with the Triton attention backend): a
    batch of the base model and two adapters gives the torch path's greedy tokens."""
    from tests.test_lora import make_base, write_adapter

    make_base(tmp_path)
    write_adapter(tmp_path / "a1", ["q_proj", "v_proj", "down_proj"], 4, 8, seed=1)
    write_adapter(tmp_path / "a2", ["k_proj", "o_proj", "gate_proj", "up_proj"], 8, 16, seed=2)

    def run(backend):
        eng = Engine(tmp_path, EngineConfig(block_size=4, max_num_batched_tokens=8,
                                            num_blocks=48, device=DEVICE,
                                            attention_backend=backend, enable_lora=True,
                                            max_loras=2, max_lora_rank=8))
        eng.add_lora("a1", str(tmp_path / "a1"))
        eng.add_lora("a2", str(tmp_path / "a2"))
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        got = {}
        for i, (prompt, lora) in enumerate(zip(PROMPTS, ["a1", "", "a2"])):
            req = Request(str(i), prompt, params)
            req.lora_name = lora
            eng.add_request(req)
            got[str(i)] = []
        while eng.has_work():
            for o in eng.step():
                got[o.request_id].extend(o.new_token_ids)
        return got, eng

    want, _ = run("torch")
    got, eng = run("triton")
    assert eng.runner.lora.state.triton
    assert got == want
