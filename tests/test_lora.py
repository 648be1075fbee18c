"""LoRA adapters in one engine (engine.lora): PEFT folders written here by hand, a batch mixing
the base model and two adapters against HF with each adapter merged into its weights (W + s B
A) in fp32, greedy token for token; the prefix cache keeps each adapter's KV its own, across an
unload and a reload under the same name; bad adapters are refused by name; more adapters than
--max-loras take turns."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

from engine.config import EngineConfig
from engine.engine import Engine
from engine.lora.adapter import AdapterError
from engine.request import Request, SamplingParams

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
SHAPES = {"q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
          "gate_proj": (64, 96), "up_proj": (64, 96), "down_proj": (96, 64)}
MODULE = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
          "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def make_base(path, **overrides):
    """A tiny random Llama (peaked: greedy ties do not flip) saved in `path`; returns HF's."""
    cfg = AutoConfig.for_model("llama", architectures=["LlamaForCausalLM"],
                               **{**TINY, **overrides})
    cfg.initializer_range = 0.2
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(path)
    return hf


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    return d, make_base(d)


def write_adapter(path, targets, rank, alpha, seed, rslora=False, shapes=SHAPES, layers=2,
                  **config):
    """A PEFT LoRA folder; returns {(layer, proj): (A, B)} and its scaling."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors, weights = {}, {}
    for i in range(layers):
        for proj in targets:
            fan_in, fan_out = shapes[proj]
            a = torch.randn(rank, fan_in, generator=g) * 0.3
            b = torch.randn(fan_out, rank, generator=g) * 0.3
            key = f"base_model.model.model.layers.{i}.{MODULE[proj]}.{proj}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
            weights[i, proj] = (a, b)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    conf = dict(peft_type="LORA", r=rank, lora_alpha=alpha, target_modules=list(targets),
                use_rslora=rslora, bias="none", base_model_name_or_path="tiny", **config)
    (path / "adapter_config.json").write_text(json.dumps(conf))
    return weights, alpha / (math.sqrt(rank) if rslora else rank)


def merged(hf, weights, scaling):
    """HF's model with the adapter merged: W + scaling * B @ A."""
    m = copy.deepcopy(hf)
    with torch.no_grad():
        for (i, proj), (a, b) in weights.items():
            lin = getattr(getattr(m.model.layers[i], MODULE[proj]), proj)
            lin.weight += scaling * (b @ a)
    return m


def hf_greedy(model, prompt, n):
    return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


def run(eng, reqs):
    for r in reqs:
        eng.add_request(r)
    got = {r.request_id: [] for r in reqs}
    while eng.has_work():
        for o in eng.step():
            assert not o.error, o.error
            got[o.request_id].extend(o.new_token_ids)
    return got


def req(rid, prompt, lora="", n=12):
    r = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    r.lora_name = lora
    return r


PROMPTS = [[5, 9, 17, 3, 3, 100, 41, 8, 8, 2], [7] * 13, [1, 2, 3, 4, 5, 6, 7]]


@pytest.mark.parametrize("max_loras", [2, 1])
def test_a_batch_of_base_and_two_adapters_matches_hf_merged(base, tmp_path, max_loras):
    """max_loras 2: one step serves all three; 1: the two adapters take turns."""
    d, hf = base
    w1, s1 = write_adapter(tmp_path / "a1", ["q_proj", "v_proj", "o_proj", "gate_proj",
                                             "down_proj"], 4, 8, seed=1)
    w2, s2 = write_adapter(tmp_path / "a2", ["k_proj", "up_proj"], 8, 16, seed=2, rslora=True)
    eng = Engine(d, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16,
                                 enable_lora=True, max_loras=max_loras, max_lora_rank=8))
    eng.add_lora("one", str(tmp_path / "a1"))
    eng.add_lora("two", str(tmp_path / "a2"))
    assert eng.list_loras() == ["one", "two"]
    reqs = [req("base", PROMPTS[0]), req("one-a", PROMPTS[0], "one"),
            req("one-b", PROMPTS[1], "one"), req("two", PROMPTS[2], "two"),
            req("base-b", PROMPTS[2])]
    got = run(eng, reqs)
    m1, m2 = merged(hf, w1, s1), merged(hf, w2, s2)
    want = {"base": hf_greedy(hf, PROMPTS[0], 12), "one-a": hf_greedy(m1, PROMPTS[0], 12),
            "one-b": hf_greedy(m1, PROMPTS[1], 12), "two": hf_greedy(m2, PROMPTS[2], 12),
            "base-b": hf_greedy(hf, PROMPTS[2], 12)}
    assert got == want
    assert want["one-a"] != want["base"]                  # the adapter changes the output
    assert eng.pool.num_free == eng.pool.num_blocks


def test_an_adapters_kv_is_its_own_in_the_prefix_cache(base, tmp_path):
    d, hf = base
    w1, s1 = write_adapter(tmp_path / "a1", ["q_proj", "k_proj", "v_proj"], 4, 8, seed=1)
    w3, s3 = write_adapter(tmp_path / "a3", ["q_proj", "k_proj", "v_proj"], 4, 8, seed=3)
    eng = Engine(d, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16,
                                 enable_lora=True, max_loras=2, max_lora_rank=8))
    eng.add_lora("x", str(tmp_path / "a1"))
    prompt = PROMPTS[1]
    kv = eng.kv_manager

    def hits_of(r):
        before = kv.hit_tokens
        got = run(eng, [r])[r.request_id]
        return kv.hit_tokens - before, got

    assert hits_of(req("b1", prompt))[0] == 0
    assert hits_of(req("b2", prompt))[0] == 12              # the base's own blocks
    assert hits_of(req("x1", prompt, "x"))[0] == 0          # not the base's
    h, got = hits_of(req("x2", prompt, "x"))
    assert h == 12 and got == hf_greedy(merged(hf, w1, s1), prompt, 12)
    eng.remove_lora("x")                                    # new weights under the same name
    eng.add_lora("x", str(tmp_path / "a3"))
    h, got = hits_of(req("x3", prompt, "x"))
    assert h == 0 and got == hf_greedy(merged(hf, w3, s3), prompt, 12)
    with pytest.raises(AdapterError, match="'gone' is not loaded"):
        eng.add_request(req("g", prompt, "gone"))


def test_bad_adapters_are_refused_by_name(base, tmp_path):
    d, _ = base
    eng = Engine(d, EngineConfig(num_blocks=16, block_size=4, enable_lora=True,
                                 max_lora_rank=8))
    write_adapter(tmp_path / "big", ["q_proj"], 16, 16, seed=1)
    with pytest.raises(AdapterError, match="rank 16 exceeds --max-lora-rank 8"):
        eng.add_lora("big", str(tmp_path / "big"))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        eng.add_lora("none", str(tmp_path))
    other = dict(SHAPES, q_proj=(128, 64))
    write_adapter(tmp_path / "other", ["q_proj"], 4, 8, seed=1, shapes=other)
    with pytest.raises(AdapterError, match="another base model"):
        eng.add_lora("other", str(tmp_path / "other"))
    write_adapter(tmp_path / "emb", ["q_proj"], 4, 8, seed=1)
    conf = json.loads((tmp_path / "emb" / "adapter_config.json").read_text())
    conf["target_modules"] = ["q_proj", "embed_tokens"]
    (tmp_path / "emb" / "adapter_config.json").write_text(json.dumps(conf))
    with pytest.raises(AdapterError, match=r"target modules \['embed_tokens'\]"):
        eng.add_lora("emb", str(tmp_path / "emb"))
    write_adapter(tmp_path / "dora", ["q_proj"], 4, 8, seed=1, use_dora=True)
    with pytest.raises(AdapterError, match="DoRA is not supported"):
        eng.add_lora("dora", str(tmp_path / "dora"))
    write_adapter(tmp_path / "deep", ["q_proj"], 4, 8, seed=1, layers=3)
    with pytest.raises(AdapterError, match="layer 2 beyond the model's 2"):
        eng.add_lora("deep", str(tmp_path / "deep"))
    write_adapter(tmp_path / "ok", ["q_proj"], 4, 8, seed=1)
    eng.add_lora("ok", str(tmp_path / "ok"))
    with pytest.raises(AdapterError, match="already loaded"):
        eng.add_lora("ok", str(tmp_path / "ok"))
    assert eng.list_loras() == ["ok"]                       # the failures left nothing behind
    plain = Engine(d, EngineConfig(num_blocks=16, block_size=4))
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.add_request(req("p", PROMPTS[0], "ok"))


def test_the_masked_path_equals_the_per_slot_reference():
    """A step of several adapters (lora_delta_masked) against the per-slot gathers and
    scatters (lora_delta), with rows of the base model among them and a slot unused."""
    from engine.lora.layers import LoRABatch, lora_delta, lora_delta_masked

    g = torch.Generator().manual_seed(0)
    slots, rank, fan_in, outs = 4, 8, 24, [16, 8, 8]
    a = torch.randn(slots, len(outs) * rank, fan_in, generator=g)
    b = [torch.randn(slots, rank, o, generator=g) for o in outs]
    batch = LoRABatch.of([2, -1, 0, 2], [3, 2, 1, 4], torch.device("cpu"))
    x, y = torch.randn(10, fan_in, generator=g), torch.randn(10, sum(outs), generator=g)
    want, got = y.clone(), y.clone()
    lora_delta(want, x, a, b, batch)
    lora_delta_masked(got, x, a, b, batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[3:5], y[3:5])                      # the base model's rows
