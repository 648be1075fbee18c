"""What `python -m pdkernels.aot` compiles: every Triton kernel's wrapper called as the engine
calls it, on CPU tensors of real model shapes (torch.empty: nothing is read, written or run).

An entry of ENTRIES maps a name to a function (shape, dtype, matrix) -> iterator of
(params, call): `params` labels the table's rows, `call()` runs the public wrapper once. Every
launch a call makes is compiled; identical launches (signature, constexprs, alignment, options)
once. Launch parameters (constexprs, block sizes, warps, stages, splits) come from the wrappers
and the planners the engine runs (attention_tile_shape, num_splits_for, the quantized linear's
plan), never from numbers repeated here: the entries only choose shapes, as the engine's layers
would pass them (q / k / v as views of the fused projection, the backend's split scratch).

Adding a kernel: write a function like the ones below that builds the tensors the engine passes
and calls the wrapper, and add it to ENTRIES. A wrapper must not query a device (take SM counts
as an argument, as num_splits_for and quant_linear do).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

import torch

from pdkernels import triton_activation, triton_attention, triton_kv_store, triton_norm
from pdkernels.triton_attention import MAX_SPLITS
from pdkernels import triton_lora, triton_moe, triton_quant_linear

NUM_SMS = 132          # H100 / H200: the split-KV and split-K counts the runtime picks there
MAX_SEQS = 256         # decode batch sizes whose split counts are compiled; staged rows
NUM_BLOCKS = 64        # KV pool and block-table width (not a launch parameter)

Call = Callable[[], object]


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    group: int          # the scale group of its 4- and 8-bit checkpoints (divides every K)


SMOLLM2_135M = ModelShape("135M", 576, 9, 3, 64, 1536, group=64)      # the default model
LLAMA_8B = ModelShape("8B", 4096, 32, 8, 128, 14336, group=128)


@dataclass(frozen=True)
class MoeShape:
    """A sparse MoE layer: each token goes to `topk` of `experts` MLPs of `intermediate`."""

    name: str
    hidden: int
    intermediate: int   # per expert (moe_intermediate_size)
    experts: int
    topk: int


QWEN3_30B_A3B = MoeShape("30B-A3B", 2048, 768, experts=128, topk=8)


@dataclass(frozen=True)
class Matrix:
    """The launch space compiled: shapes x dtypes x the runtime sizes that change a launch."""

    shapes: tuple[ModelShape, ...]
    dtypes: tuple[torch.dtype, ...]
    block_sizes: tuple[int, ...]      # KV block sizes (any power of two is allowed)
    rows: tuple[int, ...]             # tokens of a step (M); Triton specializes 1 and x % 16
    query_lens: tuple[int, ...]       # longest query of a step: 1 decode, <= 33 verification
    schemes: tuple[str, ...]          # quantized weights, names of SCHEMES
    moe: tuple[MoeShape, ...] = (QWEN3_30B_A3B,)   # MoE layers, compiled at every step size


FULL = Matrix((SMOLLM2_135M, LLAMA_8B), (torch.bfloat16, torch.float16, torch.float32),
              (8, 16, 32, 64, 128), (1, 2, 8, 16, 17, 32, 33, 64, 100, 256, 512, 2048),
              (1, 2, 4, 8, 17, 33, 512), ("int8", "int8 group", "int4", "int4 zp", "int4 group",
                                          "int4 group zp"))
QUICK = Matrix((SMOLLM2_135M, LLAMA_8B), (torch.bfloat16, torch.float16), (16,),
               (1, 2, 16, 32, 64, 2048), (1, 2, 17, 512), ("int8", "int4 group zp"))


def _phase(q_len: int) -> str:
    return "decode" if q_len == 1 else f"verify q{q_len}" if q_len <= 33 else f"prefill q{q_len}"


def _fused_qkv(shape: ModelShape, tokens: int, dtype):
    """q [T, H, D], k, v [T, KVH, D]: views of one qkv projection output, as the model splits
    it."""
    h, kvh, d = shape.heads, shape.kv_heads, shape.head_dim
    qkv = torch.empty(tokens, (h + 2 * kvh) * d, dtype=dtype)
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    return q.view(tokens, h, d), k.view(tokens, kvh, d), v.view(tokens, kvh, d)


# ---------------------------------------------------------------------------------------------
# Attention (engine.attention.triton_backend)


def _attend(shape: ModelShape, dtype, block_size: int, q_len: int, num_splits: int,
            layer: bool = False) -> None:
    """One TritonBackend.forward attention launch for a step whose longest query is q_len
    (layer: with a sliding window, soft-capping and sinks, Gemma 2 / gpt-oss layers)."""
    i32 = torch.int32
    q, _, _ = _fused_qkv(shape, q_len, dtype)
    cache = torch.empty(2, NUM_BLOCKS, block_size, shape.kv_heads, shape.head_dim, dtype=dtype)
    block_m, _ = triton_attention.attention_tile_shape(shape.heads // shape.kv_heads, q_len)
    scratch = triton_attention.split_scratch(MAX_SEQS, shape.heads, shape.head_dim, MAX_SPLITS,
                                             "cpu")
    split = num_splits > 1
    triton_attention.paged_attention(
        q, cache[0], cache[1], torch.empty(q.shape, dtype=dtype),
        block_tables=torch.empty(MAX_SEQS, NUM_BLOCKS, dtype=i32),
        seq_lens=torch.empty(MAX_SEQS, dtype=i32),
        query_start_loc=torch.empty(MAX_SEQS + 1, dtype=i32),
        tile_seq=torch.empty(2 * MAX_SEQS, dtype=i32),
        tile_start=torch.empty(2 * MAX_SEQS, dtype=i32),
        num_tiles=1, block_m=block_m, scale=shape.head_dim ** -0.5, num_splits=num_splits,
        partial_out=scratch[0] if split else None, partial_lse=scratch[1] if split else None,
        **(dict(window=128, softcap=50.0, sinks=torch.empty(shape.heads)) if layer else {}))


def attention(shape: ModelShape, dtype, matrix: Matrix) -> Iterator[tuple[str, Call]]:
    """Paged attention of decode, verification and prefill steps, and the split-KV decodes
    (attention + merge) at each split count a decode batch of 1..MAX_SEQS gets."""
    splits: dict[int, int] = {}                          # split count -> first batch size
    for b in range(1, MAX_SEQS + 1):
        splits.setdefault(triton_attention.num_splits_for(b, shape.kv_heads, NUM_SMS,
                                                          MAX_SPLITS), b)
    for bs in matrix.block_sizes:
        for q_len in matrix.query_lens:
            yield f"{shape.name} bs{bs} {_phase(q_len)}", partial(_attend, shape, dtype, bs,
                                                                  q_len, 1)
        for n, b in splits.items():
            if n > 1:
                yield (f"{shape.name} bs{bs} decode x{b} {n} splits",
                       partial(_attend, shape, dtype, bs, 1, n))
    bs = matrix.block_sizes[0]           # a sliding, soft-capped layer with sinks
    for q_len in matrix.query_lens:
        yield (f"{shape.name} bs{bs} {_phase(q_len)} window+softcap+sinks",
               partial(_attend, shape, dtype, bs, q_len, 1, True))
    yield (f"{shape.name} bs{bs} decode 4 splits window+softcap+sinks",
           partial(_attend, shape, dtype, bs, 1, 4, True))


def _store(shape: ModelShape, dtype, block_size: int) -> None:
    tokens = 16
    q, k, v = _fused_qkv(shape, tokens, dtype)
    cache = torch.empty(2, NUM_BLOCKS, block_size, shape.kv_heads, shape.head_dim, dtype=dtype)
    cos = torch.empty(tokens, 1, shape.head_dim, dtype=dtype)          # RotaryEmbedding's layout
    sin = torch.empty(tokens, 1, shape.head_dim, dtype=dtype)
    triton_kv_store.store_kv(k, v, cache[0], cache[1], torch.empty(tokens, dtype=torch.int32),
                             q=q, cos=cos[:, 0], sin=sin[:, 0])


def store_kv(shape: ModelShape, dtype, matrix: Matrix) -> Iterator[tuple[str, Call]]:
    """The KV store fused with rotary (the only way the backend calls it)."""
    for bs in matrix.block_sizes:
        yield f"{shape.name} bs{bs} rotary", partial(_store, shape, dtype, bs)


# ---------------------------------------------------------------------------------------------
# Norms, activation (engine.layers.norm, engine.layers.activation)


def _norm(x_of: Callable[[], torch.Tensor], residual: bool) -> None:
    x = x_of()
    weight = torch.empty(x.shape[-1], dtype=x.dtype)
    triton_norm.rms_norm(x, weight, 1e-6, torch.empty_like(x) if residual else None)


def rms_norm(shape: ModelShape, dtype, matrix: Matrix) -> Iterator[tuple[str, Call]]:
    """Hidden-state norms (the first layer's alone, the others fused with the residual add) and
    Qwen3's per-head q / k norms on views of the fused projection."""
    for t in matrix.rows:
        hidden = partial(torch.empty, t, shape.hidden, dtype=dtype)
        yield f"{shape.name} [{t}, {shape.hidden}] + residual", partial(_norm, hidden, True)
        yield f"{shape.name} [{t}, {shape.hidden}]", partial(_norm, hidden, False)
        yield (f"{shape.name} q heads [{t}, {shape.heads}, {shape.head_dim}]",
               partial(_norm, lambda t=t: _fused_qkv(shape, t, dtype)[0], False))
        yield (f"{shape.name} k heads [{t}, {shape.kv_heads}, {shape.head_dim}]",
               partial(_norm, lambda t=t: _fused_qkv(shape, t, dtype)[1], False))


def silu_and_mul(shape: ModelShape, dtype, matrix: Matrix) -> Iterator[tuple[str, Call]]:
    """The MLP's activation on the fused gate/up output (rows only change the grid)."""
    x = partial(torch.empty, 16, 2 * shape.intermediate, dtype=dtype)
    yield (f"{shape.name} [T, 2 x {shape.intermediate}]",
           lambda: triton_activation.silu_and_mul(x()))


# ---------------------------------------------------------------------------------------------
# Quantized linear layers (engine.layers.linear, QuantizedMethod on CUDA)

# name -> (bits, grouped, zero points): int8 is --quantization int8 (per output channel);
# grouped 8- and 4-bit weights are GPTQ / AWQ / compressed-tensors checkpoints, zp asymmetric.
SCHEMES = {"int8": (8, False, False), "int8 group": (8, True, False),
           "int4": (4, False, False), "int4 zp": (4, False, True),
           "int4 group": (4, True, False), "int4 group zp": (4, True, True)}


def _projections(shape: ModelShape) -> list[tuple[str, int, int, bool]]:
    """(name, N, K, bias) of a decoder layer's linear layers; qkv with bias as Qwen2 has it."""
    h, kvh, d = shape.heads, shape.kv_heads, shape.head_dim
    hid, i = shape.hidden, shape.intermediate
    qkv = (h + 2 * kvh) * d
    return [("qkv", qkv, hid, False), ("qkv+bias", qkv, hid, True), ("o", hid, h * d, False),
            ("gate_up", 2 * i, hid, False), ("down", hid, i, False)]


def _quant(m: int, n: int, k: int, bias: bool, bits: int, group: int, zp: bool, dtype) -> None:
    groups = k // group if group else 1
    q = torch.empty(n, k if bits == 8 else (k + 1) // 2, dtype=torch.int8)
    scale = torch.empty(n, groups, dtype=torch.float32)
    triton_quant_linear.quant_linear(
        torch.empty(m, k, dtype=dtype), q, scale, torch.empty(n, dtype=dtype) if bias else None,
        offset=torch.empty(n, groups, dtype=torch.int8) if zp else None, bits=bits,
        num_sms=NUM_SMS)


def quant_linear(shape: ModelShape, dtype, matrix: Matrix) -> Iterator[tuple[str, Call]]:
    """Every projection of a layer at every step size, in each weight scheme."""
    for name in matrix.schemes:
        bits, grouped, zp = SCHEMES[name]
        group = shape.group if grouped else 0
        label = name.replace("group", f"g{group}")
        for proj, n, k, bias in _projections(shape):
            for m in matrix.rows:
                yield (f"{shape.name} {proj} {n}x{k} {label} M={m}",
                       partial(_quant, m, n, k, bias, bits, group, zp, dtype))


# ---------------------------------------------------------------------------------------------
# Mixture of experts (the MoE layer's fused_moe on CUDA)


def _moe(moe: MoeShape, tokens: int, dtype, ids_dtype=torch.int32, oss: bool = False) -> None:
    """One fused_moe call: the router's top-k ids spread over the experts (moe_align reads them
    on the host here, so they are real ids), the other tensors empty; `oss`: gpt-oss's expert
    biases and clamped SwiGLU."""
    ids = (torch.arange(tokens * moe.topk) % moe.experts).view(tokens, moe.topk).to(ids_dtype)
    extra = {}
    if oss:
        extra = dict(b13=torch.empty(moe.experts, 2 * moe.intermediate, dtype=dtype),
                     b2=torch.empty(moe.experts, moe.hidden, dtype=dtype),
                     activation="swiglu_limit")
    triton_moe.fused_moe(torch.empty(tokens, moe.hidden, dtype=dtype),
                         torch.empty(moe.experts, 2 * moe.intermediate, moe.hidden, dtype=dtype),
                         torch.empty(moe.experts, moe.hidden, moe.intermediate, dtype=dtype),
                         torch.empty(tokens, moe.topk, dtype=torch.float32),
                         ids, num_sms=NUM_SMS, **extra)


def fused_moe(shape: ModelShape, dtype, matrix: Matrix) -> Iterator[tuple[str, Call]]:
    """The matrix's MoE layers (not the dense models': they are compiled once, with its first
    dense shape) at every step size: decode-sized blocks and the prefill tiles; int32 ids, and
    int64 (torch.topk's) once."""
    if shape != matrix.shapes[0]:
        return
    for moe in matrix.moe:
        name = f"{moe.name} {moe.experts}x top-{moe.topk} {moe.hidden}->{moe.intermediate}"
        for t in matrix.rows:
            yield f"{name} T={t}", partial(_moe, moe, t, dtype)
        yield f"{name} T=1 int64 ids", partial(_moe, moe, 1, dtype, torch.int64)
        for t in (1, 256):
            yield f"{name} T={t} biases+clamped SwiGLU", partial(_moe, moe, t, dtype,
                                                                 torch.int32, True)


# ---------------------------------------------------------------------------------------------
# LoRA (engine.lora: the adapted projections with the Triton backend)

LORA_SLOTS, LORA_RANK = 4, 16      # the workers' --max-loras / --max-lora-rank defaults


def _lora(fan_in: int, outs: list[int], rows: int, dtype) -> None:
    x = torch.empty(rows, fan_in, dtype=dtype)
    y = torch.empty(rows, sum(outs), dtype=dtype)
    a = torch.empty(LORA_SLOTS, len(outs) * LORA_RANK, fan_in, dtype=dtype)
    b = [torch.empty(LORA_SLOTS, LORA_RANK, o, dtype=dtype) for o in outs]
    half = rows // 2                       # two adapters' segments (one when a single row)
    p = triton_lora.plan([(0, list(range(half))), (1, list(range(half, rows)))]
                         if half else [(0, [0])], torch.device("cpu"))
    triton_lora.lora_delta(y, x, a, b, p)


def lora(shape: ModelShape, dtype, matrix: Matrix) -> Iterator[tuple[str, Call]]:
    """Each adapted projection's shrink and expand (rank 16, 4 slots) at decode and prefill
    step sizes."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    for name, fan_in, outs in (("qkv", shape.hidden, [q, kv, kv]), ("o", q, [shape.hidden]),
                               ("gate_up", shape.hidden, [shape.intermediate] * 2),
                               ("down", shape.intermediate, [shape.hidden])):
        for rows in (1, 32, 512):
            yield (f"{shape.name} {name} T={rows}",
                   partial(_lora, fan_in, outs, rows, dtype))


# name -> cases; the table lists entries in this order.
ENTRIES: dict[str, Callable[[ModelShape, torch.dtype, Matrix], Iterator[tuple[str, Call]]]] = {
    "paged_attention": attention,
    "store_kv": store_kv,
    "rms_norm": rms_norm,
    "silu_and_mul": silu_and_mul,
    "quant_linear": quant_linear,
    "fused_moe": fused_moe,
    "lora": lora,
}
