"""`pdserve agreebench`: how closely a quantized model follows full precision.

Ten chat prompts of mixed kinds (facts, code, arithmetic, a list, a translation, a story, JSON,
a definition, a comparison, a how-to) are decoded greedily for --tokens tokens by the model in
fp32 and by the candidate: the same folder with --quantization (int8 at load), or --candidate,
a pre-quantized checkpoint of it (`pdserve model quantize`, or a published one). Reported: the
share of identical tokens (position by position), where each prompt first diverges, and each
decoder layer's relative error ||h_q - h|| / ||h|| on the first prompt's hidden states (the
residual stream after the layer), which shows how the error grows with depth.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.paths import default_model_dir, resolve_model
from pdserve.flags import QUANTIZATION_CHOICES, DefaultsFormatter

if TYPE_CHECKING:
    import torch

    from engine.engine import Engine

PROMPTS = [
    "What is the capital of Australia, and why was it chosen?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is 17 multiplied by 23? Show your steps.",
    "List five fruits that are high in vitamin C.",
    "Translate 'The weather is lovely today' into French.",
    "Tell me a short story about a lighthouse keeper and a storm.",
    'Return a JSON object with the fields "name" and "age" for a fictional person.',
    "Define entropy in one paragraph.",
    "Compare trains and planes for a 500 km trip.",
    "How do I make a cup of green tea?",
]


def _prompt_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) for p in PROMPTS]


def _engine(model_dir: Path, quantization: str, threads: int) -> Engine:
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine

    torch.set_num_threads(threads)
    return Engine(model_dir, EngineConfig(num_blocks=256, block_size=16, quantization=quantization,
                                          max_num_seqs=len(PROMPTS)))


def _hidden_states(eng: Engine, ids: list[int]) -> list[torch.Tensor]:
    """Each decoder layer's residual stream (output + the stream before it) over `ids`."""
    import torch

    from pdserve.gpucheck import engine_logits

    states: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(
        lambda m, a, out: states.append((out[0] + out[1]).detach().float().clone()))
        for layer in eng.runner.model.model.layers]
    try:
        engine_logits(eng, ids)
    finally:
        for h in hooks:
            h.remove()
    n = len(eng.runner.model.model.layers)
    steps = [states[i:i + n] for i in range(0, len(states), n)]     # one list per step
    return [torch.cat([s[j] for s in steps]) for j in range(n)]


def run(args) -> dict:
    from pdserve.gpucheck import engine_generate

    model_dir = resolve_model(args.model)
    prompts = _prompt_ids(model_dir)
    ref = _engine(model_dir, "none", args.threads)
    try:
        ref_tokens = engine_generate(ref, prompts, args.tokens)
        ref_states = _hidden_states(ref, prompts[0])
    finally:
        ref.close()
    cand_dir = Path(args.candidate) if args.candidate else model_dir
    cand = _engine(cand_dir, args.quantization, args.threads)
    try:
        methods = sorted({m.method.name for m in cand.runner.model.modules()
                          if hasattr(m, "method")})
        tokens = engine_generate(cand, prompts, args.tokens)
        states = _hidden_states(cand, prompts[0])
    finally:
        cand.close()
    same = sum(a == b for r, c in zip(ref_tokens, tokens) for a, b in zip(r, c))
    first = [next((i for i, (a, b) in enumerate(zip(r, c)) if a != b), None)
             for r, c in zip(ref_tokens, tokens)]
    layer_error = [float((s - r).norm() / r.norm()) for s, r in zip(states, ref_states)]
    return {"candidate": str(cand_dir), "quantization": args.quantization, "methods": methods,
            "prompts": len(prompts), "tokens": args.tokens,
            "identical_share": same / (len(prompts) * args.tokens),
            "first_divergence": first, "layer_relative_error": layer_error}


def register(sub) -> None:
    p = sub.add_parser(
        "agreebench", help="greedy agreement of a quantized model with fp32",
        formatter_class=DefaultsFormatter,
        description="Decode ten mixed chat prompts greedily with the model in fp32 and with a "
                    "quantized candidate (the same folder with --quantization, or --candidate: "
                    "a pre-quantized checkpoint of it); print the share of identical tokens, "
                    "where each prompt first diverges and each layer's relative error.")
    p.add_argument("--model", default=None,
                   help=f"full-precision model folder (default: {default_model_dir()})")
    p.add_argument("--candidate", default=None,
                   help="a pre-quantized checkpoint of --model (default: --model itself)")
    p.add_argument("--quantization", default="int8", choices=QUANTIZATION_CHOICES,
                   help="the candidate's --quantization (none: a pre-quantized candidate's own)")
    p.add_argument("--tokens", type=int, default=48, help="greedy tokens per prompt")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    p.set_defaults(target="pdserve.bench.agreebench:main")


def main(args) -> int:
    res = run(args)
    first = ", ".join("-" if f is None else str(f) for f in res["first_divergence"])
    errs = res["layer_relative_error"]
    print(f"candidate {res['candidate']} (--quantization {res['quantization']}; linear layers "
          f"{', '.join(res['methods'])}) against fp32, {res['prompts']} prompts x "
          f"{res['tokens']} greedy tokens")
    print(f"identical tokens: {100 * res['identical_share']:.1f}%")
    print(f"first divergence per prompt (token index, - = none): {first}")
    print("relative error of the hidden states after each layer: "
          + " ".join(f"{100 * e:.2f}%" for e in errs))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    return 0
