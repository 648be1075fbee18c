"""`make gpu-check` (`python3 -m pdserve.gpucheck`): the GPU path, checked and measured on one GPU.

Needs only torch, triton, transformers, numpy and pytest (no Redis, no web stack, no model
files: random weights, no network). The rows that use gRPC need the generated proto code: carry
proto/pdserve_pb2.py and proto/pdserve_pb2_grpc.py (made by `python -m proto.build`) to the
device, generated for its protobuf and grpcio; without them, or for other versions, those rows
say why they skip. Each group of sections (GROUPS, in the order that learns the most first:
versions, decode and prefill, memory, KV, MoE, sampler, TP, tuned tiles, then the kernel and
parity tests, which mostly compile and run at once) runs in its own process with its own
timeout, cut to what
`--deadline` leaves (450 s by default: one short run on a borrowed GPU); each row is appended
to `--out` as a JSON line when measured, so a killed run keeps what it finished. Prints one
summary table:

  env          versions of torch, triton, transformers, grpcio, protobuf, numpy; the device;
               whether the generated gRPC code can be used here
  kernels      every Triton kernel test on the device (tests/test_triton_kernels.py,
               tests/test_triton_quant_linear.py and tests/test_triton_moe.py: fp32, fp16, bf16)
               and the engine through the triton backend (tests/test_triton_engine.py)
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
  tune         the quantized linear's tile and split per 8B projection shape at 8 and 16 rows,
               int8 and int4 (pdkernels.triton_quant_linear.tune): time against the rule's, and
               the entries to commit to pdkernels/quant_linear_tuned.json
  moe          the fused MoE kernel (pdkernels.triton_moe) at Qwen3-30B-A3B's MoE layer (2048 ->
               768, 128 experts, top-8) in bf16 at T = 1, 16 and 256: output against its torch
               reference, time per call in a CUDA graph and eager, bandwidth and FLOP/s against
               the roofline (weight bytes of the experts hit / copy bandwidth, or FLOPs / matmul
               peak)
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
  kv offload   an 8B-shaped pool's blocks stored into the host tier and restored, against a
               plain page-locked copy (target >= 70% each way), and restores racing compute on
               another stream, every checksum compared (pdserve.gpucheck_offload)

The sections live here (kernels, parity, memory, tp, sampler), in pdserve.gpucheck_perf (decode,
prefill, int8, int4, moe), pdserve.gpucheck_kv (kv transfer) and pdserve.gpucheck_offload (kv
offload); none needs the web stack, Redis or
NIXL. Targets: decode within 1.5x of the floor at batch 1 and 64, prefill at >= 40% of the matmul
peak. Exit status 0 when every row passes. `--quick` runs tiny shapes (any device; on CPUs with
TRITON_INTERPRET=1): a smoke test of this script, with no targets.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.gpucheck_device import release, sync, timed
from pdserve.gpucheck_perf import TINY_DECODE, decode_and_prefill, moe_kernel, quant_tune

ROOT = Path(__file__).resolve().parent.parent

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
    # a sliding layer (window 8, under a block: released blocks and KV groups on the device)
    # and a global one, soft-capped scores and logits
    "gemma2": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], sliding_window=8,
                   layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=32,
                   attn_logit_softcapping=20.0, final_logit_softcapping=30.0,
                   hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
}


@dataclass
class Report:
    rows: list[tuple[str, str, str, str, bool | None]] = field(default_factory=list)
    out: Path | None = None        # each row appended here as a JSON line when measured

    def add(self, section: str, item: str, result: str, target: str = "",
            ok: bool | None = None) -> None:
        self.rows.append((section, item, result, target, ok))
        if self.out is not None:
            with open(self.out, "a") as f:
                f.write(json.dumps([section, item, result, target, ok]) + "\n")
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


# ---------------------------------------------------------------------------- kernel tests
def kernel_tests(report: Report, device: str) -> None:
    """The kernel and engine tests on the device, summarized per test function."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        env = dict(os.environ, PDSERVE_TEST_DEVICE=device)
        env.pop("TRITON_INTERPRET", None)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               f"--junitxml={xml}", "tests/test_triton_kernels.py",
               "tests/test_triton_quant_linear.py", "tests/test_triton_moe.py",
               "tests/test_triton_engine.py"]
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
            release(device)


# ---------------------------------------------------------------------------- memory sizing
def memory_sizing(report: Report, device: str) -> None:
    import torch

    from engine.config import EngineConfig, ModelConfig, kv_bytes_per_block
    from engine.model_runner import ModelRunner

    release(device)
    mc = ModelConfig(**TINY_DECODE)
    cfg = EngineConfig(device=device, dtype="bfloat16", compute_dtype="bfloat16",
                       gpu_memory_utilization=0.3, max_model_len=2048, max_num_seqs=16,
                       max_num_batched_tokens=512)
    runner = ModelRunner(None, mc, cfg, random_weights=True)
    sync(runner.device)
    total = torch.cuda.mem_get_info(runner.device)[1]
    used = torch.cuda.memory_reserved(runner.device)
    kv = runner.num_blocks * kv_bytes_per_block(mc, cfg)
    ok = runner.num_blocks > 0 and kv <= 0.3 * total and used <= 0.3 * total * 1.02
    report.add("memory", "KV pool from --gpu-memory-utilization 0.3",
               f"{runner.num_blocks} blocks = {runner.num_blocks * 16} tokens, KV "
               f"{kv / 2**30:.1f} GiB, torch holds {used / 2**30:.1f} of {total / 2**30:.0f} GiB",
               "<= 0.3 of the device", ok)
    del runner
    release(device)


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
            release(device)
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
    t_plain = timed(lambda: sample(logits, [], [], rows=plain), *((1, 1) if quick else (10, 2)))
    t_proc = timed(lambda: sample(logits, [], [], rows=specs, eos_token_ids=eos),
                    *((1, 1) if quick else (10, 2)))
    report.add("sampler", f"time at {rows} rows", f"top-p only {t_plain * 1e3:.2f} ms, with "
               f"every processing {t_proc * 1e3:.2f} ms (host staging included)")


# The sections in the order that learns the most first: what the machine has, the 8B-shaped
# decode and prefill rows (with int8 and int4 beside them: one process, the bf16 steps are their
# baseline), memory sizing, the KV paths, the MoE kernel, the sampler, TP, then the kernel and
# parity tests (mostly Triton's compiles: the two run at once). Each group is one subprocess
# with its own timeout: name -> (sections, seconds).
GROUPS = {
    "env": (("env",), 60),
    "perf": (("decode", "int8", "int4"), 200),
    "memory": (("memory",), 60),
    "kv": (("kv",), 90),
    "offload": (("offload",), 90),
    "moe": (("moe",), 90),
    "sampler": (("sampler",), 60),
    "tp": (("tp",), 90),
    "tune": (("tune",), 60),
    "kernels": (("kernels",), 360),
    "parity": (("parity",), 240),
}
SECTIONS = [name for sections, _ in GROUPS.values() for name in sections]
TOGETHER = ("kernels", "parity")          # started at once: they mostly compile


def env_rows(report: Report, device: str) -> None:
    """Versions, the device, and whether the generated gRPC code can be used here."""
    import torch
    import triton

    from pdserve.gpucheck_kv import proto_unavailable

    versions = [f"torch {torch.__version__}", f"triton {triton.__version__}"]
    for mod in ("transformers", "grpc", "google.protobuf", "numpy"):
        try:
            m = __import__(mod, fromlist=["__version__"])
            versions.append(f"{mod.split('.')[-1]} {getattr(m, '__version__', '?')}")
        except ImportError:
            versions.append(f"{mod.split('.')[-1]} missing")
    report.add("env", "versions", ", ".join(versions), "", True)
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        report.add("env", "device", f"{props.name}, {props.total_memory / 2**30:.0f} GiB, "
                   f"{props.multi_processor_count} SMs, sm_{props.major}{props.minor}", "", True)
    why = proto_unavailable()
    report.add("env", "grpc proto code", "importable" if why is None else f"skipped: {why}")


def _run_group(group: str, args, report: Report) -> None:
    """One group's sections in this process (the child of main's subprocess)."""
    import torch

    from pdserve import gpucheck_kv, gpucheck_offload

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        report.add(group, "error", "no CUDA device visible to torch", "", False)
        return
    steps: dict = {}            # bf16 decode steps, for the int8 rows
    perf = decode_and_prefill
    runs = {
        "env": [lambda: env_rows(report, args.device)],
        "kernels": [lambda: kernel_tests(report, args.device)] if not args.quick else [],
        "parity": [lambda: parity(report, args.device, args.families.split(","), args.quick)],
        "memory": [lambda: memory_sizing(report, args.device)] if cuda else [],
        "decode": [lambda: perf(report, args.device, args.quick, steps)],
        "int8": [lambda: perf(report, args.device, args.quick, steps, "int8")],
        "int4": [lambda: perf(report, args.device, args.quick, steps, "w4a16")],
        "moe": [lambda: moe_kernel(report, args.device, args.quick)] if cuda else [],
        "tune": [lambda: quant_tune(report, args.device, args.quick)] if cuda else [],
        "tp": [lambda: tensor_parallel(report, args.device, args.quick)] if cuda else [],
        "sampler": [lambda: sampler_check(report, args.device, args.quick)],
        "kv": [lambda: gpucheck_kv.kv_roundtrip(report, args.device),
               lambda: gpucheck_kv.run(report, args.device, args.quick)],
        "offload": [lambda: gpucheck_offload.run(report, args.device, args.quick)],
    }
    skip = set(filter(None, args.skip.split(",")))
    for section in GROUPS[group][0]:
        if section in skip:
            continue
        for run in runs[section]:
            try:
                run()
            except Exception as exc:            # a broken section is a failed row
                import traceback
                traceback.print_exc()
                report.add(section, "error", f"{type(exc).__name__}: {exc}"[:300], "", False)


def _child(group: str, argv: list[str], rows: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve.gpucheck", *argv, "--group", group, "--out",
           str(rows)]
    return subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))


def _wait(group: str, proc: subprocess.Popen, limit: float, report: Report) -> None:
    try:
        code = proc.wait(timeout=max(limit, 1.0))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        report.add(group, "timeout", f"killed after {limit:.0f} s (its rows above were kept)",
                   "", False)
        return
    if code != 0:
        report.add(group, "exit", f"the section's process exited with {code}", "", False)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpucheck", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="torch device (cuda or cuda:N)")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes, no targets, no kernel tests (a smoke test; runs on CPUs "
                        "with TRITON_INTERPRET=1)")
    p.add_argument("--families", default="llama,qwen2,qwen3,gemma2",
                   help="parity model families")
    p.add_argument("--skip", default="", help="comma list of sections to skip: "
                   + ", ".join(SECTIONS))
    p.add_argument("--deadline", type=float, default=450.0, metavar="SECONDS",
                   help="the whole check's time: each group of sections runs in its own "
                        "process with its own timeout, cut to what is left; a group with no "
                        "time left is not started (rows say so)")
    p.add_argument("--out", default=None,
                   help="append each row here as a JSON line the moment it is measured (a "
                        "killed run keeps what it finished)")
    p.add_argument("--group", default=None, choices=sorted(GROUPS), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = _parser()
    args = p.parse_args(argv)
    unknown = set(filter(None, args.skip.split(","))) - set(SECTIONS)
    if unknown:
        p.error(f"--skip: unknown section(s) {', '.join(sorted(unknown))}; known: "
                f"{', '.join(SECTIONS)}")
    sys.path.insert(0, str(ROOT))
    if args.group is not None:                # a child: one group, rows appended to --out
        _run_group(args.group, args, Report(out=Path(args.out) if args.out else None))
        return 0
    rows = Path(args.out) if args.out else Path(tempfile.mkdtemp()) / "rows.jsonl"
    rows.parent.mkdir(parents=True, exist_ok=True)
    rows.write_text("")
    report = Report(out=rows)
    child_argv = _strip(argv, ("--out", "--deadline"))
    t0 = time.perf_counter()
    skip = set(filter(None, args.skip.split(",")))
    print(f"gpu-check on {args.device}: groups {', '.join(GROUPS)}; deadline "
          f"{args.deadline:.0f} s", flush=True)
    together: list[tuple[str, subprocess.Popen, float]] = []
    for group, (sections, limit) in GROUPS.items():
        if set(sections) <= skip:
            continue
        left = args.deadline - (time.perf_counter() - t0)
        if left < 5:
            report.add(group, "not run", f"the --deadline of {args.deadline:.0f} s was spent",
                       "", False)
            continue
        proc = _child(group, child_argv, rows)
        if group in TOGETHER:
            together.append((group, proc, min(limit, left)))
            continue
        _wait(group, proc, min(limit, left), report)
    started = time.perf_counter()
    for group, proc, limit in together:
        _wait(group, proc, limit - (time.perf_counter() - started), report)
    report.rows = [tuple(json.loads(line)) for line in rows.read_text().splitlines() if line]
    print(f"\ngpu-check summary ({args.device}, {time.perf_counter() - t0:.0f} s)\n")
    print(report.table())
    print(f"\n{report.failed} failed" if report.failed else "\nall checks passed")
    return 1 if report.failed else 0


def _strip(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv without `flags` and their values (either spelling)."""
    out, skip_next = [], False
    for a in argv:
        if skip_next:
            skip_next = False
            continue
        if a in flags:
            skip_next = True
            continue
        if any(a.startswith(f + "=") for f in flags):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
