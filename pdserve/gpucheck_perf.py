"""`make gpu-check`'s performance sections (pdserve.gpucheck runs them): decode steps of a
random-weight Llama-3-8B-shaped model against the bandwidth floor, a prefill against the
matmul peak, the same decode steps with int8 and 4-bit linear layers against bf16's, and the
fused MoE kernel at Qwen3-30B-A3B's MoE layer against its roofline (`--quick`: a tiny model of
the same shape family, no targets). torch and the engine are imported in the functions."""

from __future__ import annotations

import time

from pdserve.gpucheck_device import release, sync, timed

LLAMA3_8B = dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                 rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
                 rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                               ("low_freq_factor", 1.0),
                               ("original_max_position_embeddings", 8192),
                               ("rope_type", "llama3")))
TINY_DECODE = dict(LLAMA3_8B, vocab_size=512, hidden_size=128, intermediate_size=256,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)


def _copy_bandwidth(dev) -> float:
    """Device copy bandwidth, bytes read + written per second (2 GiB buffers)."""
    import torch

    if dev.type != "cuda":
        return float("nan")
    a = torch.empty(1 << 30, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 10
    return 2 * a.numel() * a.element_size() / seconds


def _matmul_peak(dev) -> float:
    import torch

    if dev.type != "cuda":
        return float("nan")
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n ** 3 / (start.elapsed_time(end) / 1e3 / 10)


def _decode_inputs(batch: int, ctx: int, block_size: int, vocab: int):
    from engine.attention.base import BatchLayout
    from engine.model_runner import StepInputs
    from engine.request import SamplingParams
    from engine.sampler import RowSampling

    per = -(-ctx // block_size)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(batch)]
    greedy = SamplingParams(temperature=0, max_tokens=1)
    return StepInputs([(7 * i) % vocab for i in range(batch)],
                      # named tables: the steps after the first upload none of them
                      BatchLayout(tables, [ctx - 1] * batch, [1] * batch, list(range(batch))),
                      list(range(batch)),
                      [RowSampling(greedy, 0)] * batch)


def quantized_layers(report, section: str, model, four_bit: bool, device,
                      quick: bool) -> None:
    """How the quantized layers are held and launched: packed 4-bit where the scheme is, and
    the Triton kernel's grid at batch 1 for each projection shape (programs against SMs; no
    target for --quick's tiny shapes)."""
    from pdkernels.triton_quant_linear import num_sms_of, plan

    layers = [m for m in model.modules() if hasattr(m, "qweight")]
    packed = sum(getattr(m, "qbits", 8) == 4 for m in layers)
    if four_bit:
        report.add(section, "storage", f"{packed}/{len(layers)} linear layers hold 4-bit "
                   "weights two per byte", "all packed", bool(layers) and packed == len(layers))
    sms = num_sms_of(device)
    shapes = sorted({(m.out_features, m.in_features, m.group if m.groups > 1 else 0)
                     for m in layers})
    grids = [f"{n}x{k}: {plan(1, n, k, g, sms).programs(1, n)}" for n, k, g in shapes]
    report.add(section, "batch-1 grid", f"programs per projection ({sms} SMs) "
               + ", ".join(grids), f">= {2 * sms}",
               None if quick else
               all(plan(1, n, k, g, sms).programs(1, n) >= 2 * sms for n, k, g in shapes))


def decode_and_prefill(report, device: str, quick: bool,
                       steps: dict | None = None, quantization: str = "none") -> None:
    """bf16 decode steps and a prefill; with quantization "int8" or "w4a16" the decode steps
    only, each against the bf16 step of the same batch and mode in `steps` (filled by the bf16
    run)."""
    import torch

    from engine.config import EngineConfig, ModelConfig
    from engine.model_runner import ModelRunner
    from engine.weights import weight_bytes as model_bytes

    dev = torch.device(device)
    release(device)
    mc = ModelConfig(**(TINY_DECODE if quick else LLAMA3_8B))
    batches, ctx, prompt = ((1, 2), 32, 32) if quick else ((1, 16, 64), 1024, 2048)
    dtype = "float32" if dev.type == "cpu" else "bfloat16"
    bs = 16
    cfg = EngineConfig(device=device, dtype=dtype, compute_dtype=dtype, block_size=bs,
                       num_blocks=max(batches) * -(-ctx // bs) + prompt // bs + 1,
                       max_num_seqs=max(batches), max_num_batched_tokens=prompt,
                       max_model_len=max(2048, prompt), attention_backend="triton",
                       quantization=quantization)
    quantized = quantization != "none"
    section = {"none": "decode", "int8": "int8", "w4a16": "int4"}[quantization]
    t0 = time.perf_counter()
    runner = ModelRunner(None, mc, cfg, random_weights=True)
    runner.kv.normal_()
    sync(dev)
    setup = time.perf_counter() - t0
    params = sum(p.numel() for p in runner.model.parameters())
    bw, peak = _copy_bandwidth(dev), _matmul_peak(dev)
    report.add(section, "setup", f"{params / 1e9:.2f} B params "
               f"{dtype}{f' + {quantization} linear layers' if quantized else ''}, weights "
               f"{model_bytes(runner.model) / 2**30:.2f} GiB, {runner.num_blocks} KV blocks, graphs "
               f"{runner.graphs.buckets if runner.graphs else 'off'}, {setup:.0f} s; copy "
               f"bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul peak {peak / 1e12:.0f} TFLOP/s")
    if quantized and dev.type == "cuda":
        quantized_layers(report, section, runner.model, quantization == "w4a16", dev, quick)
    for batch in batches:
        _decode_rows(report, section, runner, mc, batch, ctx, bs, bw, quick,
                     None if quantized else steps, (steps or {}) if quantized else None)
    if not quantized:
        _prefill_row(report, runner, mc, max(batches) * -(-ctx // bs), prompt, bs, peak, quick)
    del runner
    release(device)


def _decode_rows(report, section: str, runner, mc, batch: int, ctx: int, bs: int, bw: float,
                 quick: bool, record: dict | None, bf16_steps: dict | None) -> None:
    """Decode steps of `batch` sequences at `ctx` tokens, eager and with the runner's graphs,
    against the bandwidth floor (weights but the embedding table, plus the KV read); bf16 runs
    `record` their steps, quantized ones are compared with `bf16_steps`."""
    from engine.weights import weight_bytes as model_bytes

    embed = runner.model.model.embed_tokens.weight
    # what a decode step reads: every weight but the embedding table (one row per token)
    weight_bytes = model_bytes(runner.model) - embed.numel() * embed.element_size()
    kv_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * runner.kv.element_size()
    inp = _decode_inputs(batch, ctx, bs, mc.vocab_size)
    floor = (weight_bytes + batch * ctx * kv_token) / bw
    graphs = runner.graphs
    for mode in ("eager", "graphs"):
        if mode == "graphs" and graphs is None:
            continue
        runner.graphs = graphs if mode == "graphs" else None
        step = timed(lambda: runner.execute(inp), *((1, 1) if quick else (20, 3)))
        ratio = step / floor
        item = f"batch {batch} ctx {ctx} {mode}"
        if bf16_steps is None:
            if record is not None:
                record[item] = step
            target = "<= 1.5x floor" if batch in (1, 64) and mode == "graphs" else ""
            ok = None if quick or not target else ratio <= 1.5
            report.add("decode", item, f"{step * 1e3:.2f} ms/step ({batch / step:.0f} "
                       f"tok/s); floor {floor * 1e3:.2f} ms; {ratio:.2f}x", target, ok)
            continue
        bf16 = bf16_steps.get(item)
        vs = step / bf16 if bf16 else None
        target = "< bf16's step" if batch == 1 else ""
        ok = None if quick or not target or vs is None else vs < 1.0
        report.add(section, item, f"{step * 1e3:.2f} ms/step; "
                   + (f"{vs:.2f}x bf16's {bf16 * 1e3:.2f} ms; " if vs else "")
                   + f"floor {floor * 1e3:.2f} ms; {ratio:.2f}x", target, ok)
    runner.graphs = graphs


def _prefill_row(report, runner, mc, base: int, prompt: int, bs: int, peak: float,
                 quick: bool) -> None:
    """One `prompt`-token prefill in blocks from `base` on: tokens/s and the share of the
    matmul peak its FLOPs reach."""
    from engine.attention.base import BatchLayout
    from engine.model_runner import StepInputs
    from engine.request import SamplingParams
    from engine.sampler import RowSampling

    greedy = SamplingParams(temperature=0, max_tokens=1)
    table = list(range(base, base + -(-prompt // bs)))
    inp = StepInputs(list(range(prompt)), BatchLayout([table], [0], [prompt]), [prompt - 1],
                     [RowSampling(greedy, 0)])
    seconds = timed(lambda: runner.execute(inp), *((1, 1) if quick else (5, 2)))
    h, layers = mc.hidden_size, mc.num_layers
    linear = sum(p.numel() for n, p in runner.model.named_parameters()
                 if n.endswith("proj.weight"))
    flops = 2 * linear * prompt + 2 * mc.vocab_size * h \
        + 4 * layers * mc.num_heads * mc.head_dim * prompt * (prompt + 1) / 2
    share = flops / seconds / peak
    report.add("prefill", f"{prompt}-token prompt", f"{seconds * 1e3:.1f} ms, "
               f"{prompt / seconds:.0f} tok/s, {flops / seconds / 1e12:.0f} TFLOP/s = "
               f"{share:.0%} of the matmul peak", ">= 40%", None if quick else share >= 0.40)


# ---------------------------------------------------------------------------- MoE kernel
QWEN3_30B_A3B_MOE = dict(hidden=2048, intermediate=768, experts=128, topk=8)
TINY_MOE = dict(hidden=128, intermediate=96, experts=8, topk=2)


def _graph_time(fn, reps: int) -> float:
    """Seconds per call of fn from a CUDA graph of `reps` calls replayed back to back (launch
    overhead off the clock: what a decode step's graph pays), the best of 3 replays."""
    import torch

    fn()                                        # compiles, fills the allocator's pools
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / reps)
    return best


def moe_kernel(report, device: str, quick: bool) -> None:
    """pdkernels.triton_moe.fused_moe at Qwen3-30B-A3B's MoE layer (2048 -> 768, 128 experts,
    top-8) in bf16 with random weights and a random router, at T = 1, 16 and 256 tokens: its
    output against fused_moe_ref, its time per call (CUDA graph replays, and eager calls), and
    the roofline: the weight bytes of the experts it routes to (+ x and out) over the measured
    copy bandwidth, or its FLOPs over the bf16 matmul peak, whichever is longer. Memory-bound
    at these T; the time includes moe_align's torch ops. (`--quick`: a tiny layer, no
    targets; on CPUs, under the interpreter, eager times only: the section runs on CUDA.)"""
    import torch

    from pdkernels.triton_moe import fused_moe, fused_moe_ref, plan
    from pdkernels.triton_quant_linear import num_sms_of

    dev = torch.device(device)
    release(device)
    shape = TINY_MOE if quick else QWEN3_30B_A3B_MOE
    h, inter, e, k = (shape[n] for n in ("hidden", "intermediate", "experts", "topk"))
    dtype = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, h, generator=g, device=dev) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=g, device=dev) * inter ** -0.5).to(dtype)
    sms = num_sms_of(dev)
    bw, peak = _copy_bandwidth(dev), _matmul_peak(dev)
    expert_bytes = 3 * h * inter * w13.element_size()
    report.add("moe", "setup", f"{e} experts x [{2 * inter}x{h} + {h}x{inter}] bf16 = "
               f"{e * expert_bytes / 2**30:.2f} GiB, top-{k}, {sms} SMs; copy bandwidth "
               f"{bw / 1e12:.2f} TB/s, bf16 matmul peak {peak / 1e12:.0f} TFLOP/s")
    for t in (1, 16, 256):
        x = torch.randn(t, h, generator=g, device=dev).to(dtype)
        logits = torch.randn(t, e, generator=g, device=dev)
        weights, ids = logits.softmax(-1).topk(k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = fused_moe(x, w13, w2, weights, ids, num_sms=sms)
        ref = fused_moe_ref(x, w13, w2, weights, ids)
        err = float((out.float() - ref.float()).abs().max() / ref.float().abs().max())

        def eager():
            fused_moe(x, w13, w2, weights, ids, num_sms=sms)
            sync(dev)

        wall = timed(eager, *((1, 1) if quick else (20, 3)))
        graph = wall if dev.type != "cuda" else \
            _graph_time(lambda: fused_moe(x, w13, w2, weights, ids, num_sms=sms),
                        1 if quick else 20)
        hit = int(ids.unique().numel())
        moved = hit * expert_bytes + 2 * x.numel() * x.element_size()
        flops = 2 * t * k * 3 * h * inter
        roof = max(moved / bw, flops / peak)
        p = plan(t, h, inter, e, k, sms)
        ok = err <= 2e-2
        report.add("moe", f"fused_moe T={t} (block_m {p.block_m}, {hit} experts hit)",
                   f"{graph * 1e6:.1f} us graphed ({wall * 1e6:.0f} us eager); "
                   f"{moved / graph / 1e12:.2f} TB/s = {moved / graph / bw:.0%} of copy, "
                   f"{flops / graph / 1e12:.1f} TFLOP/s = {flops / graph / peak:.1%} of peak; "
                   f"roofline {roof * 1e6:.1f} us: {graph / roof:.2f}x; max |out - ref| "
                   f"{err:.1e} x max", "|out - ref| <= 2e-2 x max", None if quick else ok)
    del w13, w2
    release(device)


def quant_tune(report, device: str, quick: bool) -> None:
    """The quantized linear's decode-batch tiles tuned per shape (pdkernels.triton_quant_linear
    `tune`): for each Llama-3-8B projection, int8 per channel and 4-bit in groups of 128, at 8
    and 16 rows, the fastest tile and split against the rule's, and the entries for
    quant_linear_tuned.json (keyed by this device's name). CUDA only: the interpreter's times
    say nothing."""
    import json

    import torch

    from pdkernels import triton_quant_linear as tq

    dev = torch.device(device)
    if dev.type != "cuda":
        report.add("tune", "skipped", "CUDA only (interpreter times say nothing)", "", None)
        return
    release(device)
    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    rows = (8,) if quick else (8, 16)
    entries: dict[str, list[int]] = {}
    g = torch.Generator(device=dev).manual_seed(0)

    def time_of(fn) -> float:
        import triton.testing
        return triton.testing.do_bench(fn, warmup=5, rep=15)

    for scheme, bits, groups in (("int8", 8, 1), ("int4 g128", 4, 0)):
        gains = []
        for n, k in shapes[:1] if quick else shapes:
            grp = groups or k // 128
            q = torch.randint(-7 if bits == 4 else -127, 8 if bits == 4 else 128, (n, k),
                              generator=g, device=dev, dtype=torch.int8)
            scale = torch.rand(n, grp, generator=g, device=dev) / (8 * k ** 0.5) + 1e-4
            q, scale, offset, b = tq.prepare(q, scale, bits)
            for m in rows:
                x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
                key, entry, best, rule = tq.tune(x, q, scale, offset, b, time_of)
                entries[key] = entry
                gains.append(f"{n}x{k} M={m}: {rule * 1e3:.0f} -> {best * 1e3:.0f} us")
        report.add("tune", scheme, "; ".join(gains), "tuned <= rule", True)
    report.add("tune", "entries", f"{tq.device_name(dev)}: {json.dumps(entries)}", "", None)
