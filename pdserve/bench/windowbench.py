"""`pdserve windowbench`: the KV a sequence holds on a model with sliding-window layers, against
what it would hold if every layer kept the whole context.

A model of a known shape (--shape: the KV shape of Gemma 3 1B, Gemma 2 2B, gpt-oss-20b or
Mistral 7B v0.1, every layer, with narrow random weights elsewhere so that a long prompt is
quick) serves one sequence of each --contexts length (random prompt tokens, --new decoded
tokens), in process. After each step the bench reads how many blocks the sequence's tables
hold (engine.kv_cache_manager: every KV group, sliding groups holding their window) and reports
the most it held while decoding, and the peak of the prefill (a chunk's own tokens need their
slots in every group: --chunk bounds it), in bytes, beside full attention's: every layer
holding ceil(tokens / block_size) blocks. The KV groups come from engine.kv_groups (the layer planes a block holds, the groups'
windows).
"""

from __future__ import annotations

import dataclasses
import json
import time

from pdserve.flags import DefaultsFormatter

# the KV shape of each model (its layers, KV heads, head size, window and layer pattern); the
# hidden and MLP widths are narrowed (KV bytes do not depend on them)
_NARROW = dict(vocab_size=512, hidden_size=64, intermediate_size=64, rms_norm_eps=1e-6,
               max_position_embeddings=32768, tie_word_embeddings=True)
SHAPES = {
    "gemma3-1b": dict(_NARROW, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                      num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                      head_dim=256, sliding_window=512, sliding_window_pattern=6,
                      query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh"),
    "gemma2-2b": dict(_NARROW, architectures=["Gemma2ForCausalLM"], model_type="gemma2",
                      num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                      head_dim=256, sliding_window=4096, query_pre_attn_scalar=256,
                      attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                      hidden_activation="gelu_pytorch_tanh",
                      layer_types=["sliding_attention", "full_attention"] * 13),
    "gpt-oss-20b": dict(_NARROW, architectures=["GptOssForCausalLM"], model_type="gpt_oss",
                        num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=8,
                        head_dim=64, sliding_window=128, num_local_experts=4,
                        num_experts_per_tok=2, tie_word_embeddings=False,
                        layer_types=["sliding_attention", "full_attention"] * 12),
    "mistral-7b-v0.1": dict(_NARROW, architectures=["MistralForCausalLM"], model_type="mistral",
                            num_hidden_layers=32, num_attention_heads=8, num_key_value_heads=8,
                            head_dim=128, sliding_window=4096),
}


def measure(shape: str, context: int, new: int, block_size: int, threads: int,
            layers: int = 0, chunk: int = 2048) -> dict:
    """One sequence of `context` prompt tokens decoding `new`: its peak KV held, and full
    attention's, in bytes."""
    import random

    import torch

    from engine.config import EngineConfig, ModelConfig, kv_bytes_per_block
    from engine.engine import Engine
    from engine.kv_groups import of_engine
    from engine.request import Request, SamplingParams

    torch.set_num_threads(threads)
    hf = {k: v for k, v in SHAPES[shape].items() if k != "model_type"}
    if layers:
        hf["num_hidden_layers"] = layers
        if "layer_types" in hf:
            hf["layer_types"] = hf["layer_types"][:layers]
    model_cfg = ModelConfig.from_hf(hf)
    tokens = context + new
    need = -(-tokens // block_size)
    cfg = EngineConfig(num_blocks=1, block_size=block_size, max_model_len=tokens + block_size,
                       max_num_batched_tokens=chunk, enable_prefix_caching=False)
    groups = of_engine(model_cfg, cfg)           # room for every group's whole table
    cfg = dataclasses.replace(cfg, num_blocks=groups.num_groups * need + 64)
    t0 = time.perf_counter()
    eng = Engine(None, cfg, model_cfg, random_weights=True)
    try:
        rng = random.Random(context)
        prompt = [rng.randrange(model_cfg.vocab_size) for _ in range(context)]
        eng.add_request(Request("r", prompt, SamplingParams(temperature=0, max_tokens=new,
                                                            ignore_eos=True)))
        peak = decoding = 0
        started = False                   # the prompt is computed: the steps after decode
        while eng.has_work():
            outs = eng.step()
            held = eng.kv_manager.held_blocks("r")
            peak = max(peak, held)
            if started:
                decoding = max(decoding, held)
            started = started or any(o.new_token_ids for o in outs)
        groups = eng.kv_manager.groups
        block_bytes = kv_bytes_per_block(model_cfg, eng.cfg)      # a block: its layer planes
        plane = block_bytes // groups.slots
        return {"shape": shape, "layers": model_cfg.num_layers, "context": context, "new": new,
                "block_size": block_size, "groups": groups.describe(),
                "decode_blocks": decoding, "bytes": decoding * block_bytes,
                "prefill_peak_bytes": peak * block_bytes,
                "full_attention_bytes": model_cfg.num_layers * need * plane,
                "seconds": round(time.perf_counter() - t0, 1)}
    finally:
        eng.close()


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def register(sub) -> None:
    p = sub.add_parser(
        "windowbench", help="KV bytes a sequence holds with sliding-window layers vs full",
        formatter_class=DefaultsFormatter,
        description="Serve one sequence per --contexts length on a model of a known KV shape "
                    "(random weights), in process, and print the peak KV it holds against "
                    "every layer holding the whole context.")
    p.add_argument("--shape", default="gemma3-1b", choices=sorted(SHAPES),
                   help="the model whose KV shape and layer pattern are used")
    p.add_argument("--contexts", default="4096,16384",
                   help="comma list of prompt lengths")
    p.add_argument("--new", type=int, default=8, help="decoded tokens after each prompt")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--layers", type=int, default=0,
                   help="decoder layers (0: the model's; fewer keep the pattern's start)")
    p.add_argument("--chunk", type=int, default=2048,
                   help="prefill chunk (--max-num-batched-tokens): the prefill's peak grows "
                        "with it")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    p.set_defaults(target="pdserve.bench.windowbench:main")


def main(args) -> int:
    rows = [measure(args.shape, int(c), args.new, args.block_size, args.threads, args.layers,
                    args.chunk)
            for c in args.contexts.split(",")]
    print(f"{'shape':16} {'tokens':>8} {'decoding':>12} {'prefill peak':>13} "
          f"{'full attention':>15} {'ratio':>7}  groups")
    for r in rows:
        print(f"{r['shape']:16} {r['context'] + r['new']:>8} {_mib(r['bytes']):>12} "
              f"{_mib(r['prefill_peak_bytes']):>13} {_mib(r['full_attention_bytes']):>15} "
              f"{r['bytes'] / r['full_attention_bytes']:>7.3f}  {r['groups']}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0
