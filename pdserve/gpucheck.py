"""`make gpu-check` (`python3 -m pdserve.gpucheck`): the GPU path, checked and measured on one GPU.

Needs only torch, triton, transformers, numpy and pytest (no Redis, no web stack, no model
files: random weights, no network). Prints one summary table:

  kernels      every Triton kernel test on the device (tests/test_triton_kernels.py and
               tests/test_triton_quant_linear.py: fp32, fp16, bf16) and the engine through the
               triton backend (tests/test_triton_engine.py)
  parity       our engine (triton backend, CUDA graphs) against HF transformers on random-weight
               tiny Llama, Qwen2 and Qwen3: logits of every prompt position and greedy tokens,
               fp32 (equal) and bf16 (close)
  memory       a KV pool sized from --gpu-memory-utilization
  decode       one decode step (staging, H2D copy, forward, sampling, the tokens back) of a
               random-weight Llama-3-8B-shaped model in bf16 at batch 1, 16 and 64 with
               1,024-token contexts, eager and with CUDA graphs, against the bandwidth floor:
               (weight bytes + KV bytes read) / measured device copy bandwidth
  prefill      a 2,048-token prompt: tokens/s and the share of the measured bf16 matmul peak
  int8         the same decode steps with weight-only int8 linear layers (--quantization int8:
               the Triton kernel's split-K decode path) against bf16's, the weights' memory and
               the kernel's batch-1 grid per projection against the SMs
  int4         the same with 4-bit weights in groups of 128 (the layers of GPTQ / AWQ /
               compressed-tensors W4A16 checkpoints), which every linear layer must hold packed
               two per byte (half of int8's bytes)
  tp           with two GPUs or more: a tiny model split over two ranks (NCCL) against one,
               logits and greedy tokens (skipped with one GPU)
  sampler      the batched sampler with logits processing (logit_bias, min_tokens, penalties,
               grammar bitmasks, min-p / top-k / top-p) on the device against the per-row
               reference on the same logits, and its time per step at 256 rows
  kv transfer  KV blocks device -> host bytes -> device through the grpc transport's staging
               (kvtransfer.staging), and through the whole grpc transport when its generated
               proto code is importable; the transports off the engine's stream and thread
               (pdserve.gpucheck_kv): a grpc send's engine-thread part for a 2,048-token 8B
               prompt, a held receive beside decode steps, the torch transport (NCCL, two GPUs)
               through an idle gap longer than its timeout

Targets: decode within 1.5x of the floor at batch 1 and 64, prefill at >= 40% of the matmul
peak. Exit status 0 when every row passes. `--quick` runs tiny shapes (any device; on CPUs with
TRITON_INTERPRET=1): a smoke test of this script, with no targets.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LLAMA3_8B = dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                 num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                 rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False,
                 rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0),
                               ("low_freq_factor", 1.0),
                               ("original_max_position_embeddings", 8192),
                               ("rope_type", "llama3")))
TINY_DECODE = dict(LLAMA3_8B, vocab_size=512, hidden_size=128, intermediate_size=256,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)
TINY_HF = dict(vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               rms_norm_eps=1e-6, tie_word_embeddings=False)
FAMILIES = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], rope_theta=500000.0,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=128)),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], rope_theta=1e6),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=64,
                  rope_theta=1e6, tie_word_embeddings=True),
}


@dataclass
class Report:
    rows: list[tuple[str, str, str, str, bool | None]] = field(default_factory=list)

    def add(self, section: str, item: str, result: str, target: str = "",
            ok: bool | None = None) -> None:
        self.rows.append((section, item, result, target, ok))
        mark = {True: "ok", False: "FAIL", None: ""}[ok]
        print(f"  [{section}] {item}: {result} {target} {mark}", flush=True)

    def table(self) -> str:
        head = ("section", "check", "result", "target", "")
        rows = [head] + [(s, i, r, t, {True: "ok", False: "FAIL", None: "-"}[o])
                         for s, i, r, t, o in self.rows]
        widths = [max(len(r[c]) for r in rows) for c in range(5)]
        lines = ["| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |" for r in rows]
        lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
        return "\n".join(lines)

    @property
    def failed(self) -> int:
        return sum(1 for r in self.rows if r[4] is False)


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device) -> None:
    """Give back what the last section held (runners and their graphs refer to each other: only
    the cycle collector frees them)."""
    import gc

    import torch
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- kernel tests
def kernel_tests(report: Report, device: str) -> None:
    """The kernel and engine tests on the device, summarized per test function."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = dict(os.environ, PDSERVE_TEST_DEVICE=device)
        env.pop("TRITON_INTERPRET", None)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}", "tests/test_triton_kernels.py",
               "tests/test_triton_quant_linear.py", "tests/test_triton_engine.py"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        took = time.perf_counter() - t0
        if not xml.exists():
            report.add("kernels", "pytest", f"did not run (exit {proc.returncode}): "
                       f"{proc.stderr[-300:] or proc.stdout[-300:]}", "", False)
            return
        groups: dict[str, list[int]] = {}
        failures: list[str] = []
        for case in ET.parse(xml).getroot().iter("testcase"):
            name = case.get("name", "").split("[")[0]
            key = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{name}"
            passed = case.find("failure") is None and case.find("error") is None
            skipped = case.find("skipped") is not None
            g = groups.setdefault(key, [0, 0, 0])
            g[0 if skipped else (1 if passed else 2)] += 1
            if not passed and not skipped:
                failures.append(case.get("name", ""))
        for key, (skipped, passed, failed) in groups.items():
            report.add("kernels", key, f"{passed} passed, {failed} failed"
                       + (f", {skipped} skipped" if skipped else ""), "all pass",
                       failed == 0 and passed > 0)
        report.add("kernels", "pytest run", f"{took:.0f} s, exit {proc.returncode}"
                   + (f"; failed: {', '.join(failures[:6])}" if failures else ""), "",
                   proc.returncode == 0)


# ---------------------------------------------------------------------------- HF parity
def _tiny_hf(family: str, path: Path, dtype):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_HF, **FAMILIES[family])
    cfg = AutoConfig.for_model(spec.pop("model_type"), **spec)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():        # peaked logits (few near-ties) and norms / biases that matter
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
            else:
                p.normal_(0.0, 0.08)
    hf.save_pretrained(path)
    return hf.to(dtype)


def engine_logits(eng, ids: list[int]):
    """Logits of every position of one prompt, chunked through the scheduler as a worker does."""
    import dataclasses

    import torch
    from engine.request import Request, SamplingParams

    eng.add_request(Request("p", ids, SamplingParams(temperature=0, max_tokens=1)))
    got = []
    while eng.has_work():
        sched = eng.scheduler.schedule()
        inputs = eng.batch.inputs(sched, {})
        every = dataclasses.replace(inputs, sample_rows=list(range(len(inputs.token_ids))),
                                    sampling=[])
        got.append(eng.runner.execute(every).logits)
        eng.scheduler.update(sched, [0] * sum(s.sample for s in sched.scheduled), [None])
    return torch.cat(got)


def engine_generate(eng, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens (n each, EOS ignored) of `prompts` through `eng`, stepped in process."""
    from engine.request import Request, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(Request(f"g{i}", p, params))
    out: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompts))}
    while eng.has_work():
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[f"g{i}"] for i in range(len(prompts))]


def parity(report: Report, device: str, families: list[str], quick: bool) -> None:
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine

    dev = torch.device(device)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, TINY_HF["vocab_size"], (1, 40 if quick else 75), generator=gen)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 19, 33)]
    new = 4 if quick else 24
    dtypes = ["float32"] if quick else ["float32", "bfloat16"]
    for family in families:
        for dtype in dtypes:
            tdt = getattr(torch, dtype)
            with tempfile.TemporaryDirectory() as tmp:
                hf = _tiny_hf(family, Path(tmp), tdt).to(dev)
                cfg = EngineConfig(device=device, dtype=dtype, compute_dtype=dtype,
                                   attention_backend="triton", num_blocks=64, block_size=16,
                                   max_num_batched_tokens=32, max_num_seqs=4)
                eng = Engine(tmp, cfg)
                graphs = eng.runner.graphs is not None
                with torch.no_grad():
                    ref = hf(prompt.to(dev)).logits[0].float()
                got = engine_logits(eng, prompt[0].tolist())
                diff = float((got - ref).abs().max())
                scale = float(ref.abs().max())
                top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
                toks = engine_generate(eng, prompts, new)
                with torch.no_grad():
                    want = [hf.generate(torch.tensor([p], device=dev), max_new_tokens=new,
                                        do_sample=False, eos_token_id=None, pad_token_id=0)
                            [0, len(p):].tolist() for p in prompts]
            same = sum(a == b for t, w in zip(toks, want) for a, b in zip(t, w))
            first = [next((j for j, (a, b) in enumerate(zip(t, w)) if a != b), None)
                     for t, w in zip(toks, want)]
            item = f"{family} {dtype}" + (" (graphs)" if graphs else "")
            if dtype == "float32":
                ok = diff <= 2e-3 * max(scale, 1.0) and toks == want
                target = "tokens equal, |dlogit| <= 2e-3 x max"
            else:
                ok = top1 >= 0.95 and same >= 0.8 * new * len(prompts)
                target = "argmax >= 95% of positions, >= 80% tokens"
            report.add("parity", item, f"max |dlogit| {diff:.2e} (logits to {scale:.1f}), "
                       f"argmax {top1:.0%}, greedy {same}/{new * len(prompts)} same, first "
                       f"divergence {first}", target, ok if not quick else None)
            del eng, hf
            _release(device)


# ---------------------------------------------------------------------------- memory sizing
def memory_sizing(report: Report, device: str) -> None:
    import torch

    from engine.config import EngineConfig, ModelConfig, kv_bytes_per_block
    from engine.model_runner import ModelRunner

    _release(device)
    mc = ModelConfig(**TINY_DECODE)
    cfg = EngineConfig(device=device, dtype="bfloat16", compute_dtype="bfloat16",
                       gpu_memory_utilization=0.3, max_model_len=2048, max_num_seqs=16,
                       max_num_batched_tokens=512)
    runner = ModelRunner(None, mc, cfg, random_weights=True)
    _sync(runner.device)
    total = torch.cuda.mem_get_info(runner.device)[1]
    used = torch.cuda.memory_reserved(runner.device)
    kv = runner.num_blocks * kv_bytes_per_block(mc, cfg)
    ok = runner.num_blocks > 0 and kv <= 0.3 * total and used <= 0.3 * total * 1.02
    report.add("memory", "KV pool from --gpu-memory-utilization 0.3",
               f"{runner.num_blocks} blocks = {runner.num_blocks * 16} tokens, KV "
               f"{kv / 2**30:.1f} GiB, torch holds {used / 2**30:.1f} of {total / 2**30:.0f} GiB",
               "<= 0.3 of the device", ok)
    del runner
    _release(device)


# ---------------------------------------------------------------------------- decode, prefill
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
                      BatchLayout(tables, [ctx - 1] * batch, [1] * batch), list(range(batch)),
                      [RowSampling(greedy, 0)] * batch)


def _timed(fn, repeat: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _quantized_layers(report: Report, section: str, model, four_bit: bool, device,
                      quick: bool) -> None:
    """How the quantized layers are held and launched: packed 4-bit where the scheme is, and
    the Triton kernel's grid at batch 1 for each projection shape (programs against SMs; no
    target for --quick's tiny shapes)."""
    from kernels.triton_quant_linear import num_sms_of, plan

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


def decode_and_prefill(report: Report, device: str, quick: bool,
                       steps: dict | None = None, quantization: str = "none") -> None:
    """bf16 decode steps and a prefill; with quantization "int8" or "w4a16" the decode steps
    only, each against the bf16 step of the same batch and mode in `steps` (filled by the bf16
    run)."""
    import torch

    from engine.attention.base import BatchLayout
    from engine.config import EngineConfig, ModelConfig
    from engine.model_runner import ModelRunner, StepInputs
    from engine.request import SamplingParams
    from engine.sampler import RowSampling

    dev = torch.device(device)
    _release(device)
    mc = ModelConfig(**(TINY_DECODE if quick else LLAMA3_8B))
    batches, ctx, prompt = ((1, 2), 32, 32) if quick else ((1, 16, 64), 1024, 2048)
    dtype = "float32" if dev.type == "cpu" else "bfloat16"
    bs = 16
    cfg = EngineConfig(device=device, dtype=dtype, compute_dtype=dtype, block_size=bs,
                       num_blocks=max(batches) * -(-ctx // bs) + prompt // bs + 1,
                       max_num_seqs=max(batches), max_num_batched_tokens=prompt,
                       max_model_len=max(2048, prompt), attention_backend="triton",
                       quantization=quantization)
    int8 = quantization != "none"                   # any quantized layers
    section = {"none": "decode", "int8": "int8", "w4a16": "int4"}[quantization]
    t0 = time.perf_counter()
    runner = ModelRunner(None, mc, cfg, random_weights=True)
    runner.kv.normal_()
    _sync(dev)
    setup = time.perf_counter() - t0
    from engine.weights import weight_bytes as model_bytes

    params = list(runner.model.parameters())
    embed = runner.model.model.embed_tokens.weight
    # what a decode step reads: every weight but the embedding table (one row per token)
    weight_bytes = model_bytes(runner.model) - embed.numel() * embed.element_size()
    kv_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * runner.kv.element_size()
    bw, peak = _copy_bandwidth(dev), _matmul_peak(dev)
    report.add(section, "setup", f"{sum(p.numel() for p in params) / 1e9:.2f} B params "
               f"{dtype}{f' + {quantization} linear layers' if int8 else ''}, weights "
               f"{model_bytes(runner.model) / 2**30:.2f} GiB, {runner.num_blocks} KV blocks, graphs "
               f"{runner.graphs.buckets if runner.graphs else 'off'}, {setup:.0f} s; copy "
               f"bandwidth {bw / 1e12:.2f} TB/s, bf16 matmul peak {peak / 1e12:.0f} TFLOP/s")
    if int8 and dev.type == "cuda":
        _quantized_layers(report, section, runner.model, quantization == "w4a16", dev, quick)
    graphs = runner.graphs
    for batch in batches:
        inp = _decode_inputs(batch, ctx, bs, mc.vocab_size)
        floor = (weight_bytes + batch * ctx * kv_token) / bw
        for mode in ("eager", "graphs"):
            if mode == "graphs" and graphs is None:
                continue
            runner.graphs = graphs if mode == "graphs" else None
            step = _timed(lambda: runner.execute(inp), *((1, 1) if quick else (20, 3)))
            ratio = step / floor
            item = f"batch {batch} ctx {ctx} {mode}"
            if not int8:
                if steps is not None:
                    steps[item] = step
                target = "<= 1.5x floor" if batch in (1, 64) and mode == "graphs" else ""
                ok = None if quick or not target else ratio <= 1.5
                report.add("decode", item, f"{step * 1e3:.2f} ms/step ({batch / step:.0f} "
                           f"tok/s); floor {floor * 1e3:.2f} ms; {ratio:.2f}x", target, ok)
                continue
            bf16 = (steps or {}).get(item)
            vs = step / bf16 if bf16 else None
            target = "< bf16's step" if batch == 1 else ""
            ok = None if quick or not target or vs is None else vs < 1.0
            report.add(section, item, f"{step * 1e3:.2f} ms/step; "
                       + (f"{vs:.2f}x bf16's {bf16 * 1e3:.2f} ms; " if vs else "")
                       + f"floor {floor * 1e3:.2f} ms; {ratio:.2f}x", target, ok)
    runner.graphs = graphs
    if int8:
        del runner, graphs, params, embed
        _release(device)
        return
    greedy = SamplingParams(temperature=0, max_tokens=1)
    base = max(batches) * -(-ctx // bs)
    table = list(range(base, base + -(-prompt // bs)))
    inp = StepInputs(list(range(prompt)), BatchLayout([table], [0], [prompt]), [prompt - 1],
                     [RowSampling(greedy, 0)])
    seconds = _timed(lambda: runner.execute(inp), *((1, 1) if quick else (5, 2)))
    h, layers = mc.hidden_size, mc.num_layers
    linear = sum(p.numel() for n, p in runner.model.named_parameters()
                 if n.endswith("proj.weight"))
    flops = 2 * linear * prompt + 2 * mc.vocab_size * h \
        + 4 * layers * mc.num_heads * mc.head_dim * prompt * (prompt + 1) / 2
    share = flops / seconds / peak
    report.add("prefill", f"{prompt}-token prompt", f"{seconds * 1e3:.1f} ms, "
               f"{prompt / seconds:.0f} tok/s, {flops / seconds / 1e12:.0f} TFLOP/s = "
               f"{share:.0%} of the matmul peak", ">= 40%", None if quick else share >= 0.40)
    del runner, graphs, params, embed
    _release(device)


# ---------------------------------------------------------------------------- tensor parallel
def tensor_parallel(report: Report, device: str, quick: bool) -> None:
    """A tiny HF Llama split over two GPUs (NCCL) against one: logits and greedy tokens."""
    import torch

    from engine.config import EngineConfig
    from engine.engine import Engine

    dev = torch.device(device)
    first = dev.index or 0
    if dev.type != "cuda" or torch.cuda.device_count() < first + 2:
        report.add("tp", "2 ranks", "skipped: needs two GPUs from --device on", "", None)
        return
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, TINY_HF["vocab_size"], (40,), generator=gen).tolist()
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (7, 19, 33)]
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        _tiny_hf("llama", Path(tmp), torch.float32)
        for tp in (1, 2):
            cfg = EngineConfig(device=f"cuda:{first}", dtype="float32", compute_dtype="float32",
                               attention_backend="triton", num_blocks=64, block_size=16,
                               max_num_batched_tokens=32, max_num_seqs=4,
                               tensor_parallel_size=tp)
            t0 = time.perf_counter()
            eng = Engine(tmp, cfg)
            try:
                got[tp] = (engine_logits(eng, prompt), engine_generate(eng, prompts, 16),
                           time.perf_counter() - t0)
            finally:
                eng.close()
            del eng
            _release(device)
    diff = float((got[2][0] - got[1][0]).abs().max())
    same = got[2][1] == got[1][1]
    report.add("tp", "2 ranks vs 1 (fp32, NCCL)", f"max |dlogit| {diff:.2e}, greedy tokens "
               f"{'equal' if same else 'differ'}; start + run {got[2][2]:.0f} s",
               "tokens equal, |dlogit| <= 1e-3", same and diff <= 1e-3)


# ---------------------------------------------------------------------------- KV transfer
def sampler_check(report: Report, device: str, quick: bool) -> None:
    """Batched processing + sampling on the device vs the per-row reference (engine.sampler)."""
    import random

    import torch

    from engine.request import SamplingParams
    from engine.sampler import RowSampling, _filter, draw, process_row, sample, uniform
    from engine.structured import apply_bitmask, new_bitmask

    dev = torch.device(device)
    rows, vocab = (16, 512) if quick else (256, 49152)
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(dev)
    eos = (2,)
    specs = []
    for r in range(rows):
        bias = tuple((rng.randrange(vocab), rng.choice([-100.0, 5.0])) for _ in range(4))
        out = [rng.randrange(vocab) for _ in range(rng.randrange(40))]
        p = SamplingParams(temperature=0.0 if r % 4 == 0 else rng.choice([0.7, 1.0]),
                           seed=r, top_k=rng.choice([0, 50]), top_p=rng.choice([1.0, 0.9]),
                           min_p=rng.choice([0.0, 0.05]), presence_penalty=0.5,
                           frequency_penalty=rng.choice([0.0, 0.7]),
                           repetition_penalty=rng.choice([1.0, 1.2]), logit_bias=bias,
                           min_tokens=rng.choice([0, 100]), max_tokens=200)
        specs.append(RowSampling(p, len(out), output=out, prompt=out[:5]))
    toks, _ = sample(logits, [], [], rows=specs, eos_token_ids=eos)
    greedy_ok = drawn_ok = drawn = 0
    for r, (row, tok) in enumerate(zip(specs, toks)):
        ref = process_row(logits[r], row.params, row.output, row.prompt, eos)
        p = row.params
        if p.greedy:
            greedy_ok += tok == int(ref.argmax())
        else:
            drawn += 1
            want = draw(_filter(ref / p.temperature, p.top_k, p.top_p, p.min_p).softmax(-1),
                        uniform(p.seed, row.index))
            drawn_ok += tok == want
    greedy = rows - drawn
    report.add("sampler", f"{rows} rows x {vocab} vocab vs per-row reference",
               f"greedy {greedy_ok}/{greedy}, drawn {drawn_ok}/{drawn} equal",
               "greedy all, drawn >= 99%", greedy_ok == greedy and drawn_ok >= 0.99 * drawn)
    mask = new_bitmask(rows, vocab)
    mask[:, ::3] = torch.randint(-2**31, 2**31 - 1, mask[:, ::3].shape, generator=gen,
                                 dtype=torch.int32)
    a, b = logits.clone(), logits.cpu().clone()
    apply_bitmask(a, mask.to(dev))
    apply_bitmask(b, mask)
    report.add("sampler", "grammar bitmask on the device", "equal to the CPU's"
               if torch.equal(a.cpu(), b) else "differs from the CPU's", "equal",
               torch.equal(a.cpu(), b))
    plain = [RowSampling(SamplingParams(temperature=1.0, top_p=0.9, seed=r), 0)
             for r in range(rows)]
    t_plain = _timed(lambda: sample(logits, [], [], rows=plain), *((1, 1) if quick else (10, 2)))
    t_proc = _timed(lambda: sample(logits, [], [], rows=specs, eos_token_ids=eos),
                    *((1, 1) if quick else (10, 2)))
    report.add("sampler", f"time at {rows} rows", f"top-p only {t_plain * 1e3:.2f} ms, with "
               f"every processing {t_proc * 1e3:.2f} ms (host staging included)")


def kv_roundtrip(report: Report, device: str) -> None:
    import torch

    from kvtransfer.staging import HostStaging, tensor_from_bytes

    dev = torch.device(device)
    shape = (4, 2, 40, 16, 8, 128)                          # layers, k/v, blocks, slots, heads
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        if dev.type == "cpu" and dtype == torch.bfloat16:
            continue
        src = torch.randn(shape, device=dev).to(dtype)
        dst = torch.zeros_like(src)
        send, recv = HostStaging(dev), HostStaging(dev)
        ids, to = [3, 4, 5, 17, 39, 0], [10, 11, 12, 30, 2, 8]
        for i in range(0, len(ids), 4):                     # messages of up to 4 blocks
            data = send.blocks_to_bytes(src, ids[i:i + 4])
            n = len(ids[i:i + 4])
            part = tensor_from_bytes(data, dtype, (shape[0], 2, n, *shape[3:]))
            recv.write_blocks(dst, to[i:i + 4], part)
        _sync(dev)
        ok = torch.equal(dst[:, :, to], src[:, :, ids]) and \
            int(dst.count_nonzero()) == int(src[:, :, ids].count_nonzero())
        report.add("kv transfer", f"staging {str(dtype).split('.')[-1]}",
                   f"{len(ids)} blocks device->host->device "
                   f"{'intact' if ok else 'CORRUPTED'} (pinned: {send.pinned})", "intact", ok)
    try:
        import proto.pdserve_pb2  # noqa: F401
    except ImportError:
        report.add("kv transfer", "grpc transport", "skipped: proto code not generated here "
                   "(needs grpcio-tools); the staging rows above are its device path")
        return
    import asyncio

    report.add("kv transfer", "grpc transport", *asyncio.run(_grpc_roundtrip(dev)))


async def _grpc_roundtrip(dev):
    import socket

    import torch

    from engine.kv_layout import KVLayout
    from kvtransfer.base import TransferTarget, create_sender
    from kvtransfer.loopback import MemorySink, receiving

    layout = KVLayout("float16", 16, 4, 8, 128)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"127.0.0.1:{port}"
    src = torch.randn(4, 2, 32, 16, 8, 128, device=dev).half()
    sink = MemorySink(layout, 32, device=dev)
    sink.reservations["r"] = [5, 6, 7, 8, 9]
    async with receiving("grpc", sink, addr):
        sender = create_sender("grpc", layout, kv=src, blocks_per_message=2)
        target = TransferTarget("grpc", addr, "check", layout, (5, 6, 7, 8, 9))
        await sender.send("r", src, [1, 2, 3, 30, 31], target, 42, None)
        await sender.close()
    _sync(dev)
    ok = sink.completed.get("r", (None,))[0] == 42 and torch.equal(
        sink.kv[:, :, [5, 6, 7, 8, 9]].to(dev), src[:, :, [1, 2, 3, 30, 31]])
    return (f"5 blocks, 2 per message, {'intact' if ok else 'CORRUPTED'}", "intact", ok)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpucheck", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="torch device (cuda or cuda:N)")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, no targets, no kernel tests (a smoke test; runs on CPUs "
                        "with TRITON_INTERPRET=1)")
    p.add_argument("--families", default="llama,qwen2,qwen3", help="parity model families")
    p.add_argument("--skip", default="", help="comma list of sections to skip: kernels, "
                   "parity, memory, decode, int8, int4, tp, sampler, kv")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    from pdserve import gpucheck_kv

    skip = set(filter(None, args.skip.split(",")))
    report = Report()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("no CUDA device visible to torch", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(torch.device(args.device)) if cuda else "cpu"
    import triton
    print(f"gpu-check on {name}: torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    t0 = time.perf_counter()
    steps: dict = {}            # bf16 decode steps, for the int8 rows
    sections = [("kernels", lambda: kernel_tests(report, args.device), not args.quick),
                ("parity", lambda: parity(report, args.device, args.families.split(","),
                                          args.quick), True),
                ("memory", lambda: memory_sizing(report, args.device), cuda),
                ("decode", lambda: decode_and_prefill(report, args.device, args.quick, steps),
                 True),
                ("int8", lambda: decode_and_prefill(report, args.device, args.quick, steps,
                                                    "int8"), True),
                ("int4", lambda: decode_and_prefill(report, args.device, args.quick, steps,
                                                    "w4a16"), True),
                ("tp", lambda: tensor_parallel(report, args.device, args.quick), cuda),
                ("sampler", lambda: sampler_check(report, args.device, args.quick), True),
                ("kv", lambda: kv_roundtrip(report, args.device), True),
                ("kv", lambda: gpucheck_kv.run(report, args.device, args.quick), True)]
    for section, run, wanted in sections:
        if not wanted or section in skip:
            continue
        try:
            run()
        except Exception as exc:            # a broken section is a failed row, not a crash
            import traceback
            traceback.print_exc()
            report.add(section, "error", f"{type(exc).__name__}: {exc}"[:300], "", False)
    print(f"\ngpu-check summary ({name}, {time.perf_counter() - t0:.0f} s)\n")
    print(report.table())
    if args.out:
        Path(args.out).write_text(json.dumps(report.rows, indent=1))
    print(f"\n{report.failed} failed" if report.failed else "\nall checks passed")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
