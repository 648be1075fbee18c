"""`pdserve stepbench`: one engine's decode step, in process, and the share outside the linear
layers.

The model (default: the fetched one) serves --batch sequences of --context random prompt tokens;
once every prompt is computed, --steps decode steps are timed (greedy, or sampled with
--temperature / --top-p / --top-k, seeded per sequence; the first few are warm-up).
Each linear layer's forward is timed too, so the report splits a step into its linear layers
(the weights' matmuls, lm_head included) and everything else (attention, norms, rotary,
activation, sampling, the engine's own bookkeeping).

--structured json gives every sequence a JSON-schema grammar (an array of at least 10,000
strings, so no output completes while it is timed): the report adds the time spent on the
grammar masks (filling each sequence's token bitmask, and applying them to the logits) per
step and its share of the step.

--tensor-parallel-size N splits the model over N ranks (processes, --threads each; on CPUs over
gloo): the linear layers are timed on rank 0, their all-reduces included.

--shape NAME runs a model of a known shape with random weights instead of a folder (--layers
of them, so a large model fits in memory): qwen3-30b-a3b (128 experts, top-8, expert width 768,
hidden 2048) and qwen3-30b-a3b-dense, the same attention with a dense MLP of the same active
parameters (8 x 768 = 6144 wide): the pair shows what a decode step of the MoE costs against a
dense model doing the same arithmetic per token. --moe-backend picks the experts' backend
(reference: the loop over experts; grouped: the CPU path), --expert-parallel splits them over
--tensor-parallel-size ranks.

--loras N (with --lora-rank R) gives the sequences N random LoRA adapters of rank R on every
projection, round-robin: the step then adds each adapter's batched matmuls (engine.lora), and
the step time against a run without --loras is their cost.

--compare 1,8,32 times every CPU path the host can run (--linear-method avx2 / onednn / torch
x --cpu-attention avx2 / sdpa) at each batch size, --rounds passes over them all interleaved
(the machine's noise falls on every path alike), and prints one table of median step times with
each path's ratio to the path `auto` picks on this host: the figures the defaults are chosen by.
"""

from __future__ import annotations

import json
import statistics
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

from cluster.paths import default_model_dir, resolve_model
from pdserve.flags import MOE_BACKENDS, QUANTIZATION_CHOICES, DefaultsFormatter, add_cpu_paths

if TYPE_CHECKING:
    import torch

    from engine.engine import Engine

WARMUP = 3

# --shape: HF-style configs of known models (random weights; --layers sets the depth)
_QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
                      hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                      num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                      rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                      num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
SHAPES = {
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    # the same attention, a dense MLP as wide as the 8 active experts together
    "qwen3-30b-a3b-dense": dict(_QWEN3_30B_A3B, architectures=["Qwen3ForCausalLM"],
                                intermediate_size=8 * 768),
}
ENDLESS_SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 10000}


@contextmanager
def _timing(obj, name: str, spent: list[float]):
    """Add the wall time of every obj.name(...) call to spent[0] while inside."""
    fn = getattr(obj, name)

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t0
    setattr(obj, name, timed)
    try:
        yield
    finally:
        setattr(obj, name, fn)


def _time_linears(model: torch.nn.Module) -> list[float]:
    """Wrap every Linear's forward to add its wall time to the returned one-element list."""
    from engine.layers.linear import Linear

    spent = [0.0]
    for m in model.modules():
        if isinstance(m, Linear):
            forward = m.forward

            def timed(x, forward=forward):
                t0 = time.perf_counter()
                y = forward(x)
                spent[0] += time.perf_counter() - t0
                return y
            m.forward = timed
    return spent


def run(args) -> dict:
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine

    from engine.config import ModelConfig

    torch.set_num_threads(args.threads)
    shape = getattr(args, "shape", None)
    model_cfg = None
    if shape:
        if args.model:
            raise ValueError("--shape builds a model of random weights: drop --model")
        model_cfg = ModelConfig.from_hf(dict(SHAPES[shape], num_hidden_layers=args.layers))
    budget = max(2048, args.context)
    # the first sequences decode while the last prompts are computed: room for those tokens too
    new = args.steps + WARMUP + 2 + -(-args.batch * args.context // budget) + 1
    blocks = args.batch * (-(-(args.context + new) // 16)) + 16
    eng = Engine(None if shape else resolve_model(args.model),
                 EngineConfig(num_blocks=blocks, max_num_seqs=args.batch,
                              max_num_batched_tokens=budget,
                              attention_backend=args.attention_backend,
                              linear_method=getattr(args, "linear_method", "auto"),
                              cpu_attention=getattr(args, "cpu_attention", "auto"),
                              quantization=args.quantization,
                              tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                              expert_parallel=getattr(args, "expert_parallel", False),
                              moe_backend=getattr(args, "moe_backend", "auto"),
                              enable_lora=getattr(args, "loras", 0) > 0,
                              max_loras=max(getattr(args, "loras", 0), 1),
                              max_lora_rank=getattr(args, "lora_rank", 16)),
                 model_cfg, random_weights=bool(shape))
    try:
        return _measure(args, eng, new)
    finally:
        eng.close()


def _add_requests(args, eng: Engine, new: int) -> bool:
    """--batch random prompts of --context tokens, each decoding `new` tokens (a JSON-schema
    grammar each with --structured json), computed until every sequence decodes; -> whether
    they are structured."""
    import torch

    from engine.request import Request, SamplingParams

    gen = torch.Generator().manual_seed(args.seed)
    vocab = eng.model_cfg.vocab_size
    structured = getattr(args, "structured", "off") == "json"
    grammar = spec = None
    if structured:
        from engine.structured import GrammarCompiler, StructuredSpec

        spec = StructuredSpec("json_schema", json.dumps(ENDLESS_SCHEMA))
        grammar = GrammarCompiler(eng.model_dir, vocab, eng.model_cfg.eos_token_ids).compile(spec)
    sampling = dict(temperature=getattr(args, "temperature", 0.0),
                    top_p=getattr(args, "top_p", 1.0), top_k=getattr(args, "top_k", 0))
    loras = _random_adapters(eng, getattr(args, "loras", 0), getattr(args, "lora_rank", 16))
    for i in range(args.batch):
        params = SamplingParams(max_tokens=new, ignore_eos=True, structured=spec, seed=i,
                                **sampling)
        req = Request(str(i), torch.randint(0, vocab, (args.context,), generator=gen).tolist(),
                      params)
        if loras:
            req.lora_name = loras[i % len(loras)]
        if grammar is not None:
            req.structured_state = grammar.matcher()
        eng.add_request(req)
    while any(r.num_computed_tokens < r.num_prompt_tokens
              for r in list(eng.scheduler.waiting) + eng.scheduler.running):
        eng.step()
    return structured


def _random_adapters(eng: Engine, n: int, rank: int) -> list[str]:
    """n adapters of rank `rank` on every projection (random, small), loaded into `eng`."""
    import tempfile
    from pathlib import Path

    import torch
    from safetensors.torch import save_file

    from engine.lora.adapter import projection_shape

    mc, names = eng.model_cfg, []
    attn = ("q_proj", "k_proj", "v_proj", "o_proj")
    projs = attn + (() if mc.moe is not None else ("gate_proj", "up_proj", "down_proj"))
    for j in range(n):
        d = Path(tempfile.mkdtemp(prefix="stepbench-lora-"))
        g = torch.Generator().manual_seed(j)
        tensors = {}
        for layer in range(mc.num_layers):
            for p in projs:
                fan_in, fan_out = projection_shape(mc, p)
                key = (f"base_model.model.model.layers.{layer}."
                       f"{'self_attn' if p in attn else 'mlp'}.{p}")
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.01
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
        save_file(tensors, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps(
            dict(peft_type="LORA", r=rank, lora_alpha=rank, target_modules=list(projs))))
        eng.add_lora(f"bench{j}", str(d))
        names.append(f"bench{j}")
    return names


def _sampling(args) -> str:
    t = getattr(args, "temperature", 0.0)
    if not t:
        return "greedy"
    top_p, top_k = getattr(args, "top_p", 1.0), getattr(args, "top_k", 0)
    extra = [f"top-p {top_p}" if top_p < 1.0 else "", f"top-k {top_k}" if top_k else ""]
    return ", ".join([f"temperature {t}"] + [e for e in extra if e])


def _timed_steps(args, eng: Engine) -> tuple[list[float], list[float], list[float]]:
    """WARMUP + --steps decode steps of every sequence; -> the timed steps' seconds, their
    linear layers' and every step's grammar masks' (warm-up ones included)."""
    import engine.structured as structured_module

    spent = _time_linears(eng.model)
    steps, linear, masks = [], [], []
    mask_spent = [0.0]
    for i in range(args.steps + WARMUP):
        spent[0] = mask_spent[0] = 0.0
        t0 = time.perf_counter()
        with _timing(eng.batch, "_grammar_masks", mask_spent), \
                _timing(structured_module, "apply_bitmask", mask_spent):
            eng.step()
        dt = time.perf_counter() - t0
        masks.append(mask_spent[0])
        if eng.last_step.num_seqs != args.batch or eng.last_step.num_tokens != args.batch:
            raise RuntimeError(f"step {i}: {eng.last_step}: the timed steps must be decodes of "
                               "every sequence")
        if i >= WARMUP:
            steps.append(dt)
            linear.append(spent[0])
    return steps, linear, masks


def _measure(args, eng: Engine, new: int) -> dict:
    from engine.layers.linear import Linear

    structured = _add_requests(args, eng, new)
    steps, linear, masks = _timed_steps(args, eng)
    step, lin = statistics.median(steps), statistics.median(linear)
    tp = eng.cfg.tensor_parallel_size
    runner = eng.runner
    methods = sorted({m.method.name for m in eng.model.modules() if isinstance(m, Linear)})
    cpu_path = None
    if runner.device.type == "cpu" and getattr(runner.backend, "kernel", None) is not None:
        cpu_path = "avx2" if runner.backend.kernel else "sdpa"
    moe = eng.model_cfg.moe
    out = dict(shape=getattr(args, "shape", None), moe_backend=getattr(args, "moe_backend", None)
               if moe else None,
               batch=args.batch, context=args.context, threads=args.threads, tensor_parallel=tp,
               backend=runner.backend.name, cpu_attention=cpu_path, linear_methods=methods, step_ms=step * 1e3, linear_ms=lin * 1e3,
               outside_ms=(step - lin) * 1e3, outside_share=(step - lin) / step,
               best_step_ms=min(steps) * 1e3, sampling=_sampling(args),
               loras=getattr(args, "loras", 0), lora_rank=getattr(args, "lora_rank", 0))
    if structured:
        mask = statistics.median(masks[WARMUP:])
        out.update(structured="json", mask_ms=mask * 1e3, mask_share=mask / step)
    if moe is not None:
        from engine.layers.moe import Experts
        backend = next(m for m in eng.model.modules() if isinstance(m, Experts)).method.name
        print(f"MoE: {moe.num_experts} experts, top-{moe.top_k}, {len(moe.layers)} MoE "
              f"layers; experts' backend {backend}")
    lora = (f", {out['loras']} LoRA adapters of rank {out['lora_rank']}" if out["loras"]
            else "")
    print(f"batch {args.batch}, {args.context}-token contexts, {out['sampling']}{lora}, "
          f"{args.threads} thread(s)"
          f"{f' x {tp} ranks' if tp > 1 else ''}, "
          f"{out['backend']}{f'/{cpu_path}' if cpu_path else ''} attention, linear {'+'.join(methods)}: decode step {out['step_ms']:.1f} ms (median of "
          f"{args.steps}, best {out['best_step_ms']:.1f}); linear layers {out['linear_ms']:.1f} "
          f"ms; outside them {out['outside_ms']:.1f} ms = {out['outside_share']:.0%}")
    if structured:
        print(f"grammar masks (JSON schema, every sequence): {out['mask_ms']:.2f} ms a step = "
              f"{out['mask_share']:.1%} of it ({out['mask_ms'] / args.batch * 1e3:.0f} us per "
              "sequence)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


def cpu_paths() -> list[tuple[str, str]]:
    """(linear method, cpu attention) pairs this host runs for the fp32 model on its CPU."""
    import torch

    from engine.attention.torch_backend import runnable_cpu_attention
    from engine.layers.linear import runnable_linear_methods

    attn = runnable_cpu_attention(64, 16, torch.float32)
    return [(lin, a) for lin in runnable_linear_methods(torch.device("cpu"), torch.float32)
            for a in attn]


def auto_path() -> tuple[str, str]:
    """What `auto` resolves to on this host (fp32 on the CPU)."""
    import torch

    from engine.attention.torch_backend import use_cpu_kernel
    from engine.layers.linear import linear_method_for

    method = linear_method_for(torch.device("cpu"), torch.float32).name
    kernel = use_cpu_kernel("auto", torch.device("cpu"), 64, 16, torch.float32)
    return ("torch" if method == "dense" else method), ("avx2" if kernel else "sdpa")


def compare(args) -> list[dict]:
    """The --compare table: every path at every batch, interleaved over --rounds."""
    import argparse
    import contextlib
    import io

    import torch

    batches = [int(b) for b in args.compare.split(",") if b.strip()]
    paths = cpu_paths()
    times: dict[tuple, list[float]] = {}
    for r in range(args.rounds):
        for batch in batches:
            for lin, attn in paths:
                one = argparse.Namespace(**{**vars(args), "batch": batch, "linear_method": lin,
                                            "cpu_attention": attn, "out": None,
                                            "compare": None})
                with contextlib.redirect_stdout(io.StringIO()):
                    got = run(one)
                times.setdefault((batch, lin, attn), []).append(got["step_ms"])
                print(f"round {r + 1}/{args.rounds}: batch {batch}, linear {lin}, attention "
                      f"{attn}: {got['step_ms']:.1f} ms", flush=True)
    auto = auto_path()
    rows = []
    for batch in batches:
        base = statistics.median(times.get((batch, *auto), [float("nan")]))
        for lin, attn in paths:
            ms = statistics.median(times[(batch, lin, attn)])
            rows.append(dict(batch=batch, linear=lin, attention=attn, step_ms=ms,
                             tok_s=batch / ms * 1e3, vs_auto=ms / base,
                             auto=(lin, attn) == auto))
    cap = torch.backends.cpu.get_cpu_capability()
    print(f"\ndecode steps, {args.context}-token contexts, {args.threads} thread(s), fp32, "
          f"best ISA {cap}; median of {args.rounds} rounds x {args.steps} steps; auto here = "
          f"linear {auto[0]}, attention {auto[1]}")
    print(f"{'batch':>5}  {'linear':<7} {'attention':<9} {'step ms':>8} {'tok/s':>8} "
          f"{'x auto':>7}")
    for row in rows:
        mark = "  <- auto" if row["auto"] else ""
        print(f"{row['batch']:>5}  {row['linear']:<7} {row['attention']:<9} "
              f"{row['step_ms']:>8.1f} {row['tok_s']:>8.1f} {row['vs_auto']:>7.2f}{mark}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(isa=cap, auto=auto, rows=rows), f, indent=1)
    return rows


def register(sub) -> None:
    p = sub.add_parser(
        "stepbench", help="an engine's decode step in process, and its share outside the linears",
        formatter_class=DefaultsFormatter,
        description="Time --steps decode steps of --batch sequences at --context tokens, in "
                    "process, and how much of each step the linear layers take.")
    p.add_argument("--model", default=None,
                   help=f"model folder (default: {default_model_dir()})")
    p.add_argument("--batch", type=int, default=32, help="decoding sequences")
    p.add_argument("--context", type=int, default=256, help="prompt tokens of each")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="attention kernels")
    add_cpu_paths(p)
    p.add_argument("--quantization", default="none", choices=QUANTIZATION_CHOICES,
                   help="as the workers' flag; w4a16 / w8a8 with random weights (no --model)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N ranks, --threads each (as the workers' flag)")
    p.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="a model of this shape with random weights instead of --model (MoE "
                        "and its dense equal in active parameters)")
    p.add_argument("--layers", type=int, default=2,
                   help="with --shape: decoder layers (a 48-layer model in 2 fits in memory)")
    p.add_argument("--moe-backend", default="auto", choices=MOE_BACKENDS,
                   help="MoE models: the experts' backend (as the workers' flag)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="MoE models: experts split whole over the ranks (as the workers' flag)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--loras", type=int, default=0, metavar="N",
                   help="give the sequences N random LoRA adapters (round-robin): the step's "
                        "LoRA cost against a run without")
    p.add_argument("--lora-rank", type=int, default=16, metavar="R",
                   help="with --loras: the adapters' rank")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample the decoded tokens (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature")
    p.add_argument("--structured", default="off", choices=["off", "json"],
                   help="json: every sequence follows a JSON-schema grammar; the report adds "
                        "the grammar masks' time per step")
    p.add_argument("--compare", default=None, metavar="BATCHES",
                   help="comma list of batch sizes (e.g. 1,8,32): time every CPU path this "
                        "host can run (each --linear-method x --cpu-attention) at each, "
                        "interleaved, and print one table (ratios against the auto choice)")
    p.add_argument("--rounds", type=int, default=2,
                   help="with --compare: passes over all paths (the median is kept)")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    p.set_defaults(target="pdserve.bench.stepbench:main")


def main(args) -> int:
    if getattr(args, "compare", None):
        compare(args)
    else:
        run(args)
    return 0
