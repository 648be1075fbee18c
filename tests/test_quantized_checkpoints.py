"""Pre-quantized checkpoints end to end on CPU: a tiny Llama (group 128) written in each
format's published layout by `pdserve model quantize` (GPTQ v1 and v2, AWQ GEMM,
compressed-tensors pack-quantized W4A16 with and without zero points, int-quantized W8A8; its
packing is checked against the writers' known words in test_quant_formats), loaded by the
engine and compared with the
same model's dequantized weights loaded as a plain fp32 checkpoint: the same logits (W8A8: its
activations quantized per token, within their rounding) and greedy tokens; tensor parallel
over two ranks too; and the configurations that cannot be served, refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from engine.layers.linear import linear_method_for
from engine.layers.quant_formats import QuantScheme, resolve
from pdserve.gpucheck import engine_generate, engine_logits
from pdserve.quantize import quantize_checkpoint
from tests.conftest import make_engine

GROUP = 128
TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128,
            hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=False)
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 9, 17, 3, 3, 100, 41], [7] * 13, [1, 2, 3]]
IDS = torch.randint(0, 128, (29,), generator=torch.Generator().manual_seed(1)).tolist()


def write_quantized(root: Path, fmt: str) -> tuple[Path, Path]:
    """(a tiny Llama quantized as `fmt` by `pdserve model quantize`, the same model with its
    dequantized weights as a plain fp32 folder)."""
    src, quant, dense = root / "src", root / fmt, root / "dense"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**dict(TINY)),
                                     dtype=torch.float32).save_pretrained(src)
    errors = quantize_checkpoint(src, quant, fmt, GROUP, dequantized=dense)
    assert len(errors) == 7 * TINY["num_hidden_layers"]
    assert all(0 < e < (0.02 if fmt == "w8a8" else 0.2) for e in errors.values())
    return quant, dense


def _run(path, tp=1, **kw):
    eng = make_engine(path, tensor_parallel_size=tp, **kw)
    try:
        return engine_logits(eng, IDS), engine_generate(eng, PROMPTS, 12), eng
    finally:
        eng.close()


@pytest.mark.parametrize("fmt", ["gptq", "gptq-v2", "awq", "w4a16", "w4a16-asym"])
def test_4bit_checkpoint_matches_its_dequantized_weights(tmp_path, fmt):
    quant, dense = write_quantized(tmp_path, fmt)
    ref_logits, ref_tokens, _ = _run(dense)
    logits, tokens, eng = _run(quant)
    methods = {m.method.name for m in eng.runner.model.modules() if hasattr(m, "method")}
    scheme = resolve("none", quant)
    host = linear_method_for(torch.device("cpu"), torch.float32).name   # the float layers'
    assert methods == {scheme.name, host}
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert tokens == ref_tokens


def test_w8a8_checkpoint_quantizes_activations_per_token(tmp_path):
    """The reference: HF's model over the dequantized weights, each projection's input rounded
    to int8 per token first (what W8A8 computes), against the engine's chunked prefill."""
    quant, dense = write_quantized(tmp_path, "w8a8")
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()

    def quantized_input(module, args):
        x = args[0]
        s = (x.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-12)
        return (torch.round(x / s).clamp(-127, 127) * s,)

    for name, m in hf.named_modules():
        if name.rpartition(".")[2] in PROJ:
            m.register_forward_pre_hook(quantized_input)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0]
    logits, _, eng = _run(quant)
    assert {m.method.name for m in eng.runner.model.modules()
            if hasattr(m, "method")} >= {"compressed-tensors-w8a8"}
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    dense_logits, _, _ = _run(dense)           # the activations' rounding shows
    assert (logits - dense_logits).abs().max() > 1e-4


@pytest.mark.parametrize("fmt", ["gptq", "w8a8"])
def test_quantized_checkpoint_under_tensor_parallelism(tmp_path, fmt):
    """Two ranks (gloo): q/k/v and gate/up scales split by rows, o/down's group scales by
    columns with their weights (per-channel W8A8 scales whole on each rank). W8A8's row-parallel
    layers quantize each rank's slice of the activations with its own per-token scale (as
    vLLM's do): the same up to that rounding."""
    quant, _ = write_quantized(tmp_path, fmt)
    ref_logits, ref_tokens, _ = _run(quant)
    logits, tokens, _ = _run(quant, tp=2)
    tol = 3e-2 if fmt == "w8a8" else 1e-5
    torch.testing.assert_close(logits, ref_logits, rtol=tol, atol=tol)
    if fmt != "w8a8":
        assert tokens == ref_tokens


def test_quantization_flag_and_checkpoint_must_agree(tmp_path):
    quant, dense = write_quantized(tmp_path, "gptq")
    assert isinstance(resolve("gptq", quant), QuantScheme)
    assert resolve("none", dense) == "none" and resolve("int8", dense) == "int8"
    with pytest.raises(ValueError, match="quantized as gptq"):
        resolve("awq", quant)
    with pytest.raises(ValueError, match="already quantized"):
        resolve("int8", quant)
    with pytest.raises(ValueError, match="not pre-quantized"):
        resolve("compressed-tensors", dense)
    with pytest.raises(ValueError, match="random weights"):
        resolve("w4a16", dense)
    # a projection left in full precision where the scheme quantizes every one
    state = load_file(str(quant / "model.safetensors"))
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        del state[f"model.layers.1.mlp.down_proj.{suffix}"]
    state["model.layers.1.mlp.down_proj.weight"] = torch.zeros(256, 256)
    save_file(state, str(quant / "model.safetensors"))
    with pytest.raises(ValueError, match="stored unquantized"):
        make_engine(quant)


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "fp8"}, "'fp8' is not supported"),
    ({"quant_method": "gptq", "bits": 3}, "3 bits"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "marlin"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "gemv"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                          "strategy": "channel"}}}}, "float-quantized"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["re:.*mlp"],
      "config_groups": {"g": {"weights": {"num_bits": 4, "strategy": "group",
                                          "group_size": 128}}}}, "only lm_head"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "strategy": "channel"},
                              "input_activations": {"num_bits": 8, "strategy": "tensor",
                                                    "dynamic": False}}}}, "dynamic"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "strategy": "group",
                                          "group_size": 128, "actorder": "group"}}}},
     "actorder"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["re:.*"],
      "config_groups": {"g": {"weights": {"num_bits": 4, "strategy": "group",
                                          "group_size": 128}}}}, "only lm_head"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "kv_cache_scheme": {"num_bits": 8, "type": "float"},
      "config_groups": {"g": {"weights": {"num_bits": 4, "strategy": "group",
                                          "group_size": 128}}}}, "kv_cache_scheme"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "sparsity_config": {"format": "sparse-24-bitmask"},
      "config_groups": {"g": {"weights": {"num_bits": 4, "strategy": "group",
                                          "group_size": 128}}}}, "sparsity"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "strategy": "channel"},
                              "output_activations": {"num_bits": 8}}}}, "output_activations"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*down": {}}}, "dynamic"),
    ({"quant_method": "awq", "bits": 4, "modules_to_not_convert": ["visual"]},
     "modules_to_not_convert"),
])
def test_unservable_quantization_configs_are_refused_by_name(qc, match):
    with pytest.raises(ValueError, match=match):
        QuantScheme.from_hf(qc)


def test_act_order_gptq_checkpoint_is_refused(tmp_path):
    quant, _ = write_quantized(tmp_path, "gptq")
    state = load_file(str(quant / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.g_idx"] = torch.randperm(256).to(torch.int32) // GROUP
    save_file(state, str(quant / "model.safetensors"))
    with pytest.raises(ValueError, match="act-order"):
        make_engine(quant)


def test_group_that_a_rank_cannot_hold_is_refused(tmp_path):
    """down_proj's 256 inputs over 4 ranks are 64 each: not a whole group of 128."""
    quant, _ = write_quantized(tmp_path, "w4a16")
    with pytest.raises(Exception, match="whole groups of 128"):
        make_engine(quant, tensor_parallel_size=4)
    make_engine(quant, tensor_parallel_size=2).close()   # the failed start left no group behind


def test_cli_quantization_choices_are_the_engines():
    from engine.config import QUANTIZATION_CHOICES
    from pdserve.flags import QUANTIZATION_CHOICES as CLI_CHOICES
    assert list(QUANTIZATION_CHOICES) == CLI_CHOICES


@pytest.mark.slow
def test_model_quantize_then_agreebench_on_the_default_model(model_dir, tmp_path):
    """`pdserve model quantize` writes the default model as W4A16 (groups of 64: its 576
    features are not whole groups of 128); `pdserve agreebench` serves it beside fp32."""
    import subprocess
    import sys

    dest, out = tmp_path / "w4a16", tmp_path / "agree.json"
    cli = [sys.executable, "-m", "pdserve.cli"]
    proc = subprocess.run(cli + ["model", "quantize", str(model_dir), str(dest), "--format",
                                 "w4a16", "--group-size", "64"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "210 projections" in proc.stderr
    qc = json.loads((dest / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "pack-quantized" and (dest / "tokenizer.json").is_file()
    proc = subprocess.run(cli + ["agreebench", "--model", str(model_dir), "--candidate",
                                 str(dest), "--quantization", "none", "--tokens", "3",
                                 "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert "compressed-tensors-w4a16-g64" in got["methods"]
    assert 0 <= got["identical_share"] <= 1 and len(got["first_divergence"]) == 10
    errors = got["layer_relative_error"]
    assert len(errors) == 30 and all(0 < e < 1 for e in errors)
    assert "identical tokens" in proc.stdout


def test_gptq_zero_biases_are_skipped_and_a_missing_g_idx_under_desc_act_refused(tmp_path):
    """Some GPTQ writers store an all-zero bias for every projection of a bias-free model: it is
    dropped; a real one is an error. desc_act without g_idx cannot be read: refused."""
    quant, dense = write_quantized(tmp_path, "gptq")
    ref, _, _ = _run(dense)
    path = quant / "model.safetensors"
    state = load_file(str(path))
    for name in list(state):
        if name.endswith(".qweight"):
            state[name.replace(".qweight", ".bias")] = torch.zeros(state[name].shape[1])
    save_file(state, str(path))
    logits, _, _ = _run(quant)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    state["model.layers.0.mlp.up_proj.bias"] = torch.ones(256)
    save_file(state, str(path))
    with pytest.raises(ValueError, match="unexpected tensor"):
        make_engine(quant)
    del state["model.layers.0.mlp.up_proj.bias"]
    for name in [n for n in state if n.endswith(".g_idx")]:
        del state[name]
    save_file(state, str(path))
    cfg = json.loads((quant / "config.json").read_text())
    cfg["quantization_config"]["desc_act"] = True
    (quant / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="no g_idx"):
        make_engine(quant)
