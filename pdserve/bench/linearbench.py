"""`pdserve linearbench`: the CPU linear layers of one decode step, per backend and row count.

A model's linear layers (from its config.json; random fp32 weights, so no weights are read) are
built once per backend: our kernel (pdkernels/cpu_linear.py: its AVX2 build, and its AVX-512
build where the CPU has AVX-512F), oneDNN's packed linear and torch's nn.Linear. For each row
count (the tokens of a step: 1 for a plain decode, 1 + k for a sequence verifying k proposals),
every layer's projections run in model order, followed by the lm_head, as a forward pass calls
them: each weight is read from memory once per pass (the model is far larger than the caches),
so one row measures memory bandwidth and many rows the FMA units. The best of --repeat passes
is reported, with GFLOPS and the speed-up over nn.Linear.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import TYPE_CHECKING

from cluster.paths import default_model_dir, resolve_model
from pdserve.flags import DefaultsFormatter

if TYPE_CHECKING:
    import torch
    from torch import nn

    from engine.config import ModelConfig
    from engine.layers.linear import LinearMethod


def layer_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of one decoder layer's projections, as engine.models fuses
    them: qkv, o, gate_up, down."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [(q + 2 * kv, cfg.hidden_size), (cfg.hidden_size, q),
            (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]


def backends(device: torch.device) -> dict[str, LinearMethod]:
    import torch

    from engine.layers.linear import (AmxMethod, Avx2Method, Avx512Method, DenseMethod,
                                      OneDnnMethod, onednn_available)
    from pdkernels import cpu_linear

    out: dict[str, LinearMethod] = {}
    if cpu_linear.available():
        out["avx2"] = Avx2Method()
    if cpu_linear.available_avx512():
        out["avx512"] = Avx512Method()
    if cpu_linear.available_amx():
        out["amx"] = AmxMethod()
    if onednn_available(device, torch.float32):
        out["onednn"] = OneDnnMethod()
    out["torch"] = DenseMethod()
    return out


def build(shapes: list[tuple[int, int]], method: LinearMethod, seed: int) -> list[nn.Module]:
    import torch

    from engine.layers.linear import packed_copy

    gen = torch.Generator().manual_seed(seed)
    return [packed_copy(torch.randn(n, k, generator=gen) * k ** -0.5, method) for n, k in shapes]


def time_pass(mods: list[nn.Module], rows: int, repeat: int) -> float:
    import torch

    inputs = {m_in: torch.randn(rows, m_in) for m_in in {m.in_features for m in mods}}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeat):
            t0 = time.perf_counter()
            for m in mods:
                m(inputs[m.in_features])
            best = min(best, time.perf_counter() - t0)
    return best


def run(args) -> dict:
    import torch

    from engine.config import ModelConfig

    torch.set_num_threads(args.threads)
    cfg = ModelConfig.from_dir(resolve_model(args.model))
    layers = cfg.num_layers if args.layers <= 0 else min(args.layers, cfg.num_layers)
    shapes = layer_shapes(cfg) * layers + [(cfg.vocab_size, cfg.hidden_size)]
    rows = [int(r) for r in args.rows.split(",")]
    flops_per_row = sum(2 * n * k for n, k in shapes)
    mib = sum(n * k for n, k in shapes) * 4 / 2**20
    print(f"{layers} layers x {len(layer_shapes(cfg))} projections + lm_head: {mib:.0f} MiB of "
          f"fp32 weights, {flops_per_row / 1e6:.0f} MFLOP per row; {args.threads} thread(s)")
    found = backends(torch.device("cpu"))
    names = [b for b in args.backends.split(",") if b in found]
    missing = [b for b in args.backends.split(",") if b not in found]
    if missing:
        print(f"not available on this host: {', '.join(missing)}")
    results: dict[str, dict[int, float]] = {}
    for name in names:
        mods = build(shapes, found[name], args.seed)
        time_pass(mods, 1, 1)                      # first touch of the weights
        results[name] = {r: time_pass(mods, r, args.repeat) for r in rows}
        del mods
    head = f"{'rows':>5}" + "".join(f" {n + ' ms':>11} {'GFLOPS':>7}" for n in names)
    if "torch" in names and len(names) > 1:
        head += "".join(f" {n + '/torch':>12}" for n in names if n != "torch")
    print(head)
    for r in rows:
        line = f"{r:>5}"
        for n in names:
            s = results[n][r]
            line += f" {s * 1e3:>11.1f} {flops_per_row * r / s / 1e9:>7.1f}"
        if "torch" in names and len(names) > 1:
            line += "".join(f" {results['torch'][r] / results[n][r]:>11.2f}x"
                            for n in names if n != "torch")
        print(line)
    out = {"model": dataclasses.asdict(cfg), "layers": layers,
           "threads": args.threads, "mib": mib, "flops_per_row": flops_per_row,
           "seconds": {n: {str(r): s for r, s in res.items()} for n, res in results.items()}}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


def register(sub) -> None:
    p = sub.add_parser(
        "linearbench", help="CPU linear layers of one forward pass: our kernel, oneDNN, torch",
        formatter_class=DefaultsFormatter,
        description="Time a model's linear layers (its config's shapes, random fp32 weights) in "
                    "model order, as one forward pass runs them, for each row count and backend: "
                    "avx2 (our kernel), avx512 (its AVX-512 build), amx (fp32 as three bf16 "
                    "products on AMX tiles), onednn (packed), torch (nn.Linear).")
    p.add_argument("--model", default=None,
                   help=f"model folder whose config.json gives the shapes "
                        f"(default: {default_model_dir()})")
    p.add_argument("--rows", default="1,2,5,9,17,32,128", help="comma list of row counts")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--layers", type=int, default=0, help="decoder layers to include (0: all)")
    p.add_argument("--backends", default="avx2,avx512,amx,onednn,torch",
                   help="comma list (those this host cannot run are left out)")
    p.add_argument("--repeat", type=int, default=5, help="passes per point; the best is kept")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--out", default=None, help="JSON file for the figures")
    p.set_defaults(target="pdserve.bench.linearbench:main")


def main(args) -> int:
    run(args)
    return 0
