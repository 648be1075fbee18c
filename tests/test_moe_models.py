"""The MoE families against HF transformers on tiny random configs (fp32): logits of every
position through chunked prefill and the paged cache, greedy tokens of a batch, every expert
checkpoint layout, every MoE backend and CPU linear path this host runs, int8 experts, and
what is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.engine import Engine
from engine.layers.moe import Experts, GroupedMoE, MoEMethod, Router, expert_range
from engine.layers.linear import linear_method_for
from engine.weights import weight_bytes
from pdserve.gpucheck import engine_generate, engine_logits
from pdkernels import cpu_linear
from tests.cpu_paths import linear_params
from tests.moe_models import FAMILIES, make_moe

PROMPTS = [[5, 9, 17, 3, 3, 100, 41], [7] * 13, [1, 2, 3], list(range(40, 61))]


def _engine(path, **kw):
    cfg = dict(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    return Engine(path, EngineConfig(**dict(cfg, **kw)))


def _ids(n=37, seed=1):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def _hf_greedy(hf, prompt, n):
    return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_maps_each_family(tmp_path, family):
    make_moe(tmp_path, family)
    mc = ModelConfig.from_dir(tmp_path)
    assert mc.family == family and mc.moe is not None and mc.moe.num_experts == 6
    want_layers = {"qwen2_moe": (0, 2), "glm4_moe": (1, 2)}.get(family, (0, 1, 2))
    assert mc.moe.layers == want_layers
    assert mc.rope_dim == {"glm4_moe": 16, "minimax_m2": 8}.get(family, mc.head_dim)
    assert mc.moe.scoring == ("sigmoid" if family in ("glm4_moe", "minimax_m2") else "softmax")


@pytest.mark.parametrize("backend", ["reference", "grouped"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_hf(tmp_path, family, backend):
    hf = make_moe(tmp_path, family)
    eng = _engine(tmp_path, moe_backend=backend)
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits[0]
    torch.testing.assert_close(engine_logits(eng, ids[0].tolist()), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("linear", linear_params())
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe"])
def test_grouped_experts_on_every_cpu_linear_path(tmp_path, family, linear):
    hf = make_moe(tmp_path, family)
    eng = _engine(tmp_path, linear_method=linear)
    want = {"torch": "dense"}.get(linear, linear)
    experts = [m for m in eng.model.modules() if isinstance(m, Experts)]
    assert experts and all(e.method.name == "grouped" for e in experts)
    assert {layer.method.name for e in experts for layer in e.expert_gate_up} == {want}
    ids = _ids(23, seed=3)
    with torch.no_grad():
        ref = hf(ids).logits[0]
    torch.testing.assert_close(engine_logits(eng, ids[0].tolist()), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_generate_matches_hf(tmp_path, family):
    """A batch of four through chunked prefill (8 tokens a step) and 4-token blocks, 32
    tokens each, token-exact; every block back in the pool after."""
    hf = make_moe(tmp_path, family)
    eng = _engine(tmp_path, max_num_batched_tokens=8)
    got = engine_generate(eng, PROMPTS, 32)
    for p, g in zip(PROMPTS, got):
        assert g == _hf_greedy(hf, p, 32)
    assert eng.pool.num_free == eng.pool.num_blocks
    counts = sum(m.counts for m in eng.model.modules() if hasattr(m, "counts"))
    assert int(counts.sum()) > 0


@pytest.mark.parametrize("family", ["mixtral", "glm4_moe", "minimax_m2"])
def test_fused_expert_tensors_load(tmp_path, family):
    """transformers 5's own layout: experts.gate_up_proj [E, 2I, H], experts.down_proj."""
    hf = make_moe(tmp_path, family, fused=True)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as st:
        names = list(st.keys())
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names)
    assert not any(".experts.0." in n for n in names)
    eng = _engine(tmp_path)
    ids = _ids(19, seed=4)
    with torch.no_grad():
        ref = hf(ids).logits[0]
    torch.testing.assert_close(engine_logits(eng, ids[0].tolist()), ref, rtol=1e-4, atol=1e-4)


def test_mixtral_checkpoint_names_are_its_own(tmp_path):
    make_moe(tmp_path, "mixtral")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as st:
        names = list(st.keys())
    assert any(".block_sparse_moe.experts.3.w2.weight" in n for n in names)


def test_int8_experts_match_hf_on_the_same_rounded_weights(tmp_path):
    """--quantization int8 covers the experts: HF with every projection (experts included,
    lm_head not: it stays in full precision) rounded to int8 per output channel gives the same
    logits."""
    hf = make_moe(tmp_path, "qwen2_moe")
    eng = _engine(tmp_path, quantization="int8")
    experts = [m for m in eng.model.modules() if isinstance(m, Experts)]
    assert {layer.method.name for e in experts for layer in e.expert_down} == {"int8"}
    full = _engine(tmp_path)
    assert weight_bytes(eng.model) < 0.5 * weight_bytes(full.model)

    def rounded(w):
        q, s = cpu_linear.quantize_int8(w)
        return q.float() * s[:, None]

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                p.copy_(torch.stack([rounded(w) for w in p]))
            elif (p.dim() == 2 and "embed" not in name and not name.endswith("gate.weight")
                  and "shared_expert_gate" not in name and "lm_head" not in name):
                p.copy_(rounded(p))
    ids = _ids(21, seed=5)
    with torch.no_grad():
        ref = hf(ids).logits[0]
    torch.testing.assert_close(engine_logits(eng, ids[0].tolist()), ref, rtol=2e-4, atol=2e-4)


def test_grouped_matches_reference_with_ids_of_other_ranks():
    """The backends on one layer: ids -1 (experts on another rank) contribute nothing, an
    expert with no token is skipped, a token's weights need not sum to one."""
    torch.manual_seed(0)
    ex = Experts(5, 32, 24, _single(), False)
    ex.gate_up_proj.data.normal_(0, 0.2)
    ex.down_proj.data.normal_(0, 0.2)
    x = torch.randn(9, 32)
    ids = torch.tensor([[0, 2], [2, -1], [4, 0], [-1, -1], [0, 4], [2, 0], [4, 2], [0, -1],
                        [2, 4]])
    w = torch.rand(9, 2)
    ref = MoEMethod().apply(ex, x, w, ids)
    assert ref[3].abs().max() == 0
    for linear in ("torch", "avx2") if cpu_linear.available() else ("torch",):
        grouped = GroupedMoE(linear_method_for(torch.device("cpu"), torch.float32, "none",
                                               linear))
        import copy
        ex2 = copy.deepcopy(ex)
        grouped.process_weights_after_loading(ex2)
        torch.testing.assert_close(grouped.apply(ex2, x, w, ids), ref, rtol=1e-5, atol=1e-5)


def _single():
    from engine.parallel import SINGLE
    return SINGLE


def test_router_group_limited_choice():
    """DeepSeek-style: the choice only among the best topk_group groups (by their two best
    biased scores), weights the unbiased sigmoid scores renormalized then scaled."""
    from engine.config import MoEConfig
    moe = MoEConfig(num_experts=8, top_k=2, intermediate_size=4, layers=(0,), scoring="sigmoid",
                    correction_bias=True, n_group=4, topk_group=1, norm_topk_prob=True,
                    routed_scaling_factor=2.0)
    r = Router(3, moe)
    r.weight.data = torch.zeros(8, 3)
    r.e_score_correction_bias.data = torch.tensor([0, 0, 0, 0, 0, 0, 0.5, 0.4])
    r.weight.data[0, 0] = 5.0      # expert 0 scores highest, but group 3 wins by its bias
    w, ids = r(torch.tensor([[1.0, 0.0, 0.0]]))
    assert sorted(ids[0].tolist()) == [6, 7]
    torch.testing.assert_close(w.sum(), torch.tensor(2.0))


def test_expert_ranges_cover_every_expert_once():
    for e, n in ((6, 2), (6, 3), (7, 3), (128, 5)):
        got = [expert_range(e, n, r) for r in range(n)]
        assert sum(c for _, c in got) == e and all(c >= 1 for _, c in got)
        assert [f for f, _ in got] == sorted(f for f, _ in got)


def test_refused_by_name(tmp_path):
    make_moe(tmp_path, "mixtral", sliding_window=8)
    with pytest.raises(ValueError, match="sliding-window attention"):
        ModelConfig.from_dir(tmp_path)
    make_moe(tmp_path, "qwen3_moe")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                  "desc_act": False, "sym": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="checkpoints of MoE models"):
        _engine(tmp_path)


def test_expert_parallel_needs_an_moe_model(tmp_path):
    from tests.test_model_parity import make_model
    make_model(tmp_path, "llama")
    with pytest.raises(ValueError, match="needs an MoE model"):
        _engine(tmp_path, expert_parallel=True)


def test_unknown_moe_backend_is_refused():
    with pytest.raises(ValueError, match="moe_backend must be one of"):
        EngineConfig(moe_backend="fast")


def test_other_activations_are_refused():
    """hidden_act other than silu is refused by name, not computed as silu."""
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf({"architectures": ["MixtralForCausalLM"], "hidden_act": "gelu",
                             "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "num_local_experts": 2,
                             "num_experts_per_tok": 1, "intermediate_size": 4})


def test_only_the_fused_kernel_is_captured_in_cuda_graphs(tmp_path):
    """The grouped and reference backends read expert counts on the host: a GPU engine with
    them (int8 experts, or forced) decodes eagerly."""
    from engine.layers.moe import ReferenceMoE, TritonMoE, graph_safe

    make_moe(tmp_path, "olmoe")
    eng = _engine(tmp_path)
    assert not graph_safe(eng.model)
    assert TritonMoE.graph_safe and not GroupedMoE.graph_safe and not ReferenceMoE.graph_safe


@pytest.mark.parametrize("ep", [False, True])
def test_each_rank_loads_its_slice_of_every_layout(ep):
    """Experts of ranks 0 and 1 of two (tensor parallel: each expert's columns; expert
    parallel: whole experts), from fused 3-D tensors and from per-expert ones, hold exactly
    their slice of the whole."""
    from engine.parallel import TPGroup

    e, h, i = 5, 8, 6
    gate_up = torch.randn(e, 2 * i, h)
    down = torch.randn(e, h, i)
    for rank in (0, 1):
        tp = TPGroup(rank=rank, size=2)
        fused, per = Experts(e, h, i, tp, ep), Experts(e, h, i, tp, ep)
        fused.weight_loader(fused.gate_up_proj, gate_up)
        fused.weight_loader(fused.down_proj, down)
        for x in range(e):
            per.weight_loader(per.gate_up_proj, gate_up[x, :i], (x, "gate"))
            per.weight_loader(per.gate_up_proj, gate_up[x, i:], (x, "up"))
            per.weight_loader(per.down_proj, down[x], (x, "down"))
        if ep:
            first, n = expert_range(e, 2, rank)
            want_gu, want_d = gate_up[first:first + n], down[first:first + n]
        else:
            cols = slice(rank * i // 2, (rank + 1) * i // 2)
            want_gu = torch.cat([gate_up[:, :i][:, cols], gate_up[:, i:][:, cols]], 1)
            want_d = down[:, :, cols]
        for got in (fused, per):
            assert torch.equal(got.gate_up_proj.data, want_gu)
            assert torch.equal(got.down_proj.data, want_d)


def test_router_tensors_keep_float32_in_a_bf16_model(tmp_path):
    """The sigmoid router's weight and correction bias are float32 parameters and load
    unrounded (HF keeps them in fp32): a bias of 5.1234567 rounded to bf16 would tie 5.13."""
    hf = make_moe(tmp_path, "glm4_moe")
    eng = _engine(tmp_path, dtype="bfloat16", compute_dtype="float32")
    ours = eng.model.model.layers[1].mlp.gate
    theirs = hf.model.layers[1].mlp.gate
    assert ours.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(ours.e_score_correction_bias, theirs.e_score_correction_bias.float())
    assert torch.equal(ours.weight, theirs.weight.float())
    experts = eng.model.model.layers[1].mlp.experts
    assert experts.method.name == "grouped"       # (the experts' weights were rounded)


@pytest.mark.parametrize("index", [False, True])
def test_the_checkpoint_index_names_the_files(tmp_path, index):
    """A repo's other trainer files (consolidated*.safetensors: the same weights under other
    names) are not read, with or without model.safetensors.index.json."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    hf = make_moe(tmp_path, "mixtral")
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)},
              str(tmp_path / "consolidated.safetensors"))
    if index:
        with safe_open(str(tmp_path / "model.safetensors"), "pt") as st:
            names = list(st.keys())
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
            {"weight_map": {n: "model.safetensors" for n in names}}))
    ids = _ids(9, seed=6)
    with torch.no_grad():
        ref = hf(ids).logits[0]
    torch.testing.assert_close(engine_logits(_engine(tmp_path), ids[0].tolist()), ref,
                               rtol=1e-4, atol=1e-4)
