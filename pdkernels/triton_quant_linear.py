"""Integer-weight linear layers (Triton), beside their torch reference: weight-only int8 per
output channel (--quantization int8) and 4- or 8-bit weights with group scales (pre-quantized
checkpoints: GPTQ, AWQ, compressed-tensors).

Contract. x [M, K] (fp32, fp16 or bf16; last dim contiguous); weights in one of two layouts:
- bits 8: q [N, K] int8, W[n, k] = q[n, k] * scale;
- bits 4: q [N, ceil(K / 2)] int8 from `pack_int4`, two signed nibbles per byte (k = 2j in the low
  nibble, 2j + 1 in the high one), plus an optional offset [N, groups] int8 added back to each
  nibble of its group: W[n, k] = (nibble[n, k] + offset[n, g]) * scale. The offset lets values
  minus zero points of asymmetric checkpoints (AWQ, GPTQ with zeros), which span [-15, 15] but
  only 16 consecutive values per group, be held in 4 bits.
scale [N] or [N, 1] (per channel) or [N, K / G] (groups of G: a multiple of 16, of 32 for 4 bits)
fp32; bias [N] or None. y [M, N] in x's dtype = x @ W.T + bias, accumulated in fp32.

The weight is read from memory as it is stored (half of bf16's bytes for int8, a quarter for
int4) and widened in registers: exact, |values| <= 127. A per-channel scale is applied once per
output, group scales once per K tile (a tile lies in one group: BLOCK_K divides G).

Work decomposition (`plan`, from M, N, K alone). Programs are (row tile, column tile, K split).
- M == 1 (decode at batch 1): a GEMV, products and sums in fp32 on the CUDA cores (a tensor-core
  tile would be 15/16 padding): each (column, K lane) keeps its own sum over the program's K
  range, and the lanes are reduced once at its end.
- M <= 16: one BLOCK_M 16 row tile into `tl.dot`.
- larger M (prefill): BLOCK_M up to 64 into `tl.dot`.
Column tiles alone give N / 64 programs (64 for N = 4096 on 132 SMs), so at decode the K range
is split until the grid reaches WAVES programs per SM, the tiles shrinking first where K has too
few of them; prefill splits only when its tiles would not cover every SM once. Each split writes
its partial sums, in fp32, to a scratch [split, M, N]; a second kernel adds them in split order,
adds the bias and rounds to y. Two-stage rather than atomic adds: the output is the same from
run to run (atomic fp32 adds land in any order), and the launches are as many (atomics need the
buffer zeroed first and a cast after it for 16-bit outputs). The scratch is split * M * N * 4
bytes: ~3% of the weight's bytes for an 8B model's projections at batch 1, more for small ones.

Tuned tiles. For 2..16 rows (decode batches) the tile and split may come from a table
measured on the device (`quant_linear_tuned.json` beside this file: device name -> "rows
bucket,N,K,group,bits" -> [block_n, block_k, split]); `tune` measures it (`make gpu-check`'s
tune row prints the entries). Shapes not in the table take the rule above.

Capturable in a CUDA graph: no host syncs; the grid and scratch size follow the shapes only.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import triton
import triton.language as tl

H200_SMS = 132        # SMs assumed off a GPU (the interpreter, ahead-of-time compiles)
WAVES = 4             # programs per SM a split aims for
MAX_SPLIT = 32
DECODE_ROWS = 16      # up to this many rows: one BLOCK_M 16 tile (1 row: the GEMV)
MIN_BLOCK = 32        # tiles shrink to this in N and K before splitting further
REDUCE_BLOCK = 256
NUM_WARPS = 4
TUNED_FILE = Path(__file__).with_name("quant_linear_tuned.json")


# ---------------------------------------------------------------------------------------------
# Host-side planning


@dataclass(frozen=True)
class Plan:
    """How one quant_linear call is launched: tiles, K split and which inner product."""

    block_m: int
    block_n: int
    block_k: int          # weights (not bytes) per K tile, a power of two
    split: int            # K ranges, reduced by a second kernel when > 1
    k_split: int          # K per split, a multiple of block_k
    gemv: bool            # block_m 1: fp32 products and sums instead of tl.dot

    def grid(self, m: int, n: int) -> tuple[int, int, int]:
        return triton.cdiv(m, self.block_m), triton.cdiv(n, self.block_n), self.split

    def programs(self, m: int, n: int) -> int:
        a, b, c = self.grid(m, n)
        return a * b * c


def tune_key(m: int, n: int, k: int, group: int, bits: int) -> str:
    """The tuned table's key: rows rounded up to a power of two (2..16), the shape, the scheme."""
    return f"{triton.next_power_of_2(m)},{n},{k},{group},{bits}"


def _split_plan(block_m: int, block_n: int, block_k: int, k: int, split: int, gemv: bool
                ) -> Plan:
    k_tiles = max(1, triton.cdiv(k, block_k))
    per = triton.cdiv(k_tiles, max(1, min(split, k_tiles)))
    return Plan(block_m, block_n, block_k, triton.cdiv(k_tiles, per), per * block_k, gemv)


def plan(m: int, n: int, k: int, group: int = 0, num_sms: int = H200_SMS,
         tuned: dict[str, list[int]] | None = None, bits: int = 8) -> Plan:
    """Tiles and split for x [m, k] @ W [n, k].T with scale groups of `group` (0: per channel).
    Decode (m <= DECODE_ROWS): the K range is cut so the grid reaches WAVES * num_sms programs,
    tiles shrinking to MIN_BLOCK in N, then K, where K has too few tiles for that; at most
    MAX_SPLIT splits. Prefill: no split once the (row, column) tiles cover every SM, else the
    same rule. 2..16 rows take `tuned`'s entry for the shape where it has one."""
    gemv = m <= 1
    decode = m <= DECODE_ROWS
    if decode and not gemv and tuned:
        entry = tuned.get(tune_key(m, n, k, group, bits))
        if entry is not None:
            block_n, block_k, split = entry
            return _split_plan(16, block_n, block_k, k, split, False)
    block_m = 1 if gemv else 16 if decode else min(64, triton.next_power_of_2(m))
    block_n = 64
    block_k = 128 if decode else 64
    if group:
        block_k = min(block_k, group & -group)           # a power of two dividing G
    rows = triton.cdiv(m, block_m)
    if not decode and rows * triton.cdiv(n, block_n) >= num_sms:
        return Plan(block_m, block_n, block_k, 1, max(k, 1), gemv)
    target = WAVES * num_sms
    while True:
        tiles = rows * triton.cdiv(n, block_n)
        k_tiles = max(1, triton.cdiv(k, block_k))
        if tiles * min(k_tiles, MAX_SPLIT) >= target:
            break
        if block_n > MIN_BLOCK:
            block_n //= 2
        elif block_k > MIN_BLOCK:
            block_k //= 2
        else:
            break
    split = max(1, min(k_tiles, MAX_SPLIT, triton.cdiv(target, tiles)))
    return _split_plan(block_m, block_n, block_k, k, split, gemv)


@functools.lru_cache(maxsize=None)
def tuned_tiles(device_name: str) -> dict[str, list[int]]:
    """The tuned table's entries for a device (empty: none measured)."""
    if not TUNED_FILE.exists():
        return {}
    return json.loads(TUNED_FILE.read_text()).get(device_name, {})


@functools.lru_cache(maxsize=None)
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def device_name(device: torch.device) -> str:
    """The tuned table's device key: the CUDA device's name, "cpu" elsewhere."""
    if device.type != "cuda":
        return device.type
    return _device_name(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms_of(device: torch.device) -> int:
    if device.type != "cuda":
        return H200_SMS
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def packable(k: int, groups: int) -> bool:
    """Whether 4-bit weights of K inputs in `groups` scale groups can be packed for the kernel
    (a 4-bit tile feeds tl.dot half its K: groups of a multiple of 32, or one per channel)."""
    return groups == 1 or (k % groups == 0 and (k // groups) % 32 == 0)


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _mac(x, w, IEEE: tl.constexpr):
    """x [BLOCK_M, T] @ w [BLOCK_N, T].T -> [BLOCK_M, BLOCK_N] fp32; w integer-valued."""
    if IEEE:                                     # fp32 x: exact products, no tf32
        part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
    else:
        part = tl.dot(x, tl.trans(w.to(x.dtype)))
    return part


@triton.jit
def _quant_linear_kernel(x_ptr, q_ptr, scale_ptr, offset_ptr, bias_ptr, y_ptr, part_ptr,
                         M, N, K, stride_x, stride_q, stride_y, GROUPS, K_SPLIT,
                         BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr,
                         HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, GEMV: tl.constexpr,
                         IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    """Program (row tile, column tile, K split): K in [split * K_SPLIT, +K_SPLIT). GROUP 0: one
    scale per output channel. SPLIT: fp32 partial sums to part [splits, M, N] (scaled, no
    bias), else y."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(2) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    row_ok = rows[:, None] < M
    col_ok = cols[:, None] < N
    x_row = x_ptr + rows[:, None].to(tl.int64) * stride_x
    q_row = q_ptr + cols[:, None].to(tl.int64) * stride_q
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # the GEMV keeps a sum per (column, K lane) across its K range and reduces the lanes once
    # at the end, not once per K tile
    lanes = tl.zeros((BLOCK_N, BLOCK_K) if GEMV else (1, 1), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        g = 0 if GROUP == 0 else k0 // GROUP
        kk = k0 + tl.arange(0, BLOCK_K)[None, :]
        x = tl.load(x_row + kk, mask=row_ok & (kk < K), other=0.0)            # [BM, BK]
        if BITS == 8:
            w = tl.load(q_row + kk, mask=col_ok & (kk < K), other=0)          # [BN, BK]
        else:
            jj = k0 // 2 + tl.arange(0, BLOCK_K // 2)[None, :]                # byte columns
            b = tl.load(q_row + jj, mask=col_ok & (2 * jj < K), other=0)      # [BN, BK / 2]
            lo = (b << 4).to(tl.int8) >> 4                                    # k = 2j
            hi = b >> 4                                                       # k = 2j + 1
            w = tl.interleave(lo, hi)                                         # [BN, BK]
            if HAS_OFFSET:
                w += tl.load(offset_ptr + cols[:, None].to(tl.int64) * GROUPS + g,
                             mask=col_ok, other=0)
        if GEMV:                                                              # x [1, BK]
            prod = w.to(tl.float32) * x.to(tl.float32)                        # [BN, BK]
            if GROUP != 0:
                s = tl.load(scale_ptr + cols.to(tl.int64) * GROUPS + g, mask=cols < N,
                            other=0.0)
                prod = prod * s[:, None]
            lanes += prod
        else:
            part = _mac(x, w, IEEE)
            if GROUP == 0:
                acc += part
            else:
                s = tl.load(scale_ptr + cols.to(tl.int64) * GROUPS + g, mask=cols < N,
                            other=0.0)
                acc += part * s[None, :]
    if GEMV:
        acc = tl.sum(lanes, axis=1)[None, :]
    if GROUP == 0:
        acc *= tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    out_mask = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT:
        at = (tl.program_id(2) * M + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(part_ptr + at, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _reduce_kernel(part_ptr, bias_ptr, y_ptr, M, N, stride_y, SPLITS,
                   HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y[i] = sum over s of part[s, i] in order s = 0, 1, ... (+ bias), i over M * N."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    ok = i < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLITS):
        acc += tl.load(part_ptr + s * M * N + i, mask=ok, other=0.0)
    row, col = i // N, i % N
    if HAS_BIAS:
        acc += tl.load(bias_ptr + col, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + col, acc.to(y_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# Wrappers


def _group_of(scale: torch.Tensor, n: int, k: int, bits: int) -> int:
    """0 for a per-channel scale, else the group size its shape says."""
    if scale.dim() == 1 or scale.shape[1] == 1:
        assert scale.shape[0] == n, f"scale: [{n}] or [{n}, 1], got {tuple(scale.shape)}"
        return 0
    groups = scale.shape[1]
    assert scale.shape == (n, groups) and k % groups == 0, f"scale [{n}, K / G], got {scale.shape}"
    group = k // groups
    assert group % (32 if bits == 4 else 16) == 0, f"group size {group} for {bits} bits"
    return group


def quant_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None, offset: torch.Tensor | None = None,
                 bits: int = 8, num_sms: int | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) for x [..., K], W given by (q, scale, offset, bits) as the module
    docstring says: a new [..., N] tensor in x's dtype."""
    k = x.shape[-1]
    n = q.shape[0]
    width = k if bits == 8 else (k + 1) // 2
    assert bits in (4, 8) and q.dtype == torch.int8 and q.shape == (n, width) \
        and q.is_contiguous(), f"q: int8 [N, {width}] for {bits} bits, got {tuple(q.shape)}"
    assert scale.dtype == torch.float32 and scale.is_contiguous(), "scale: contiguous fp32"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    assert offset is None or (bits == 4 and offset.dtype == torch.int8 and offset.is_contiguous()
                              and offset.numel() == scale.numel()), "offset: int8 like scale"
    group = _group_of(scale, n, k, bits)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if not (m and n):
        return y.view(*x.shape[:-1], n)
    p = plan(m, n, k, group, num_sms if num_sms is not None else num_sms_of(x.device),
             tuned_tiles(device_name(x.device)), bits)
    _launch(x2, q, scale, bias, offset, bits, group, y, p)
    return y.view(*x.shape[:-1], n)


def _launch(x2, q, scale, bias, offset, bits: int, group: int, y: torch.Tensor, p: Plan) -> None:
    m, k = x2.shape
    n = q.shape[0]
    part = (torch.empty(p.split, m, n, dtype=torch.float32, device=x2.device) if p.split > 1
            else y)
    has_bias = bias is not None
    _quant_linear_kernel[p.grid(m, n)](
        x2, q, scale, offset if offset is not None else q, bias if has_bias else scale, y, part,
        m, n, k, x2.stride(0), q.stride(0), y.stride(0), k // group if group else 1, p.k_split,
        BITS=bits, GROUP=group, HAS_OFFSET=offset is not None, HAS_BIAS=has_bias,
        SPLIT=p.split > 1, GEMV=p.gemv, IEEE=x2.dtype == torch.float32, BLOCK_M=p.block_m,
        BLOCK_N=p.block_n, BLOCK_K=p.block_k, num_warps=NUM_WARPS,
        num_stages=2 if p.block_m >= 32 else 3)
    if p.split > 1:
        _reduce_kernel[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            part, bias if has_bias else scale, y, m, n, y.stride(0), p.split, HAS_BIAS=has_bias,
            BLOCK=REDUCE_BLOCK, num_warps=NUM_WARPS)


TILES = [(bn, bk) for bn in (32, 64, 128) for bk in (64, 128, 256)]
SPLITS = (1, 2, 4, 8, 16)


def tune(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None,
         bits: int, time_of: Callable[[Callable[[], None]], float]
         ) -> tuple[str, list[int], float, float]:
    """The fastest (block_n, block_k, split) for x [2..16, K] against these weights, among
    TILES x SPLITS (tiles a group's K range divides), each checked against the rule's output;
    `time_of(fn)` times a call. Returns (tune_key, [block_n, block_k, split], its time, the
    rule's time)."""
    m, k = x.shape
    n = q.shape[0]
    group = _group_of(scale, n, k, bits)
    rule = plan(m, n, k, group, num_sms_of(x.device), None, bits)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    want = torch.empty_like(y)
    _launch(x, q, scale, None, offset, bits, group, want, rule)
    best = (time_of(lambda: _launch(x, q, scale, None, offset, bits, group, y, rule)),
            [rule.block_n, rule.block_k, rule.split])
    rule_time = best[0]
    for block_n, block_k in TILES:
        if group and group % block_k:
            continue
        for split in SPLITS:
            p = _split_plan(16, block_n, block_k, k, split, False)
            if p.split != split:
                continue
            t = time_of(lambda: _launch(x, q, scale, None, offset, bits, group, y, p))
            torch.testing.assert_close(y.float(), want.float(), atol=1e-2, rtol=1e-2)
            if t < best[0]:
                best = (t, [block_n, block_k, split])
    return tune_key(m, n, k, group, bits), best[1], best[0], rule_time


# ---------------------------------------------------------------------------------------------
# 4-bit packing and the torch reference


def pack_int4(q: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q int8 [N, K] -> (packed int8 [N, ceil(K / 2)], offset int8 [N, groups] or None).
    Within each of the `groups` groups of K / groups values of a row the values must span at
    most 16 consecutive integers; offset None when all lie in [-8, 7] (symmetric weights), else
    each group's offset is the one nearest 0 that brings its values into [-8, 7]."""
    n, k = q.shape
    assert q.dtype == torch.int8 and k % groups == 0, (q.dtype, k, groups)
    qg = q.to(torch.int16).view(n, groups, k // groups)
    lo, hi = qg.amin(dim=2), qg.amax(dim=2)                                   # [N, groups]
    if bool((hi - lo > 15).any()):
        raise ValueError(f"values span [{int(lo.min())}, {int(hi.max())}] with more than 16 "
                         "levels in a group: not 4-bit weights")
    offset = (hi - 7).clamp(min=0) + (lo + 8).clamp(max=0)                    # [N, groups]
    nib = (qg - offset[:, :, None]).view(n, k)                                # in [-8, 7]
    if k % 2:
        nib = torch.cat([nib, nib.new_zeros(n, 1)], dim=1)
    byte = (nib[:, 1::2] << 4) | (nib[:, 0::2] & 0xF)                         # [-128, 127]
    packed = byte.to(torch.int8).contiguous()
    return packed, (offset.to(torch.int8).contiguous() if bool(offset.any()) else None)


def unpack_int4(packed: torch.Tensor, k: int, offset: torch.Tensor | None = None
                ) -> torch.Tensor:
    """The inverse of pack_int4: int8 [N, k]."""
    b = packed.to(torch.int16)
    lo = ((b & 0xF) ^ 8) - 8
    hi = b >> 4
    q = torch.stack([lo, hi], dim=2).reshape(b.shape[0], -1)[:, :k]
    if offset is not None:
        q = q + offset.to(torch.int16).repeat_interleave(k // offset.shape[1], dim=1)
    return q.to(torch.int8)


def prepare(q: torch.Tensor, scale: torch.Tensor, bits: int = 8
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """A layer's q int8 [N, K] and scale [N, groups] of `bits`-bit weights -> (q, scale,
    offset, bits) as quant_linear takes them: 4-bit weights packed two per byte where the
    groups allow it (`packable`), anything else int8 as it is."""
    scale = scale.float().contiguous()
    if bits == 4 and packable(q.shape[1], scale.shape[1]):
        packed, offset = pack_int4(q.contiguous(), scale.shape[1])
        return packed, scale, offset, 4
    return q.contiguous(), scale, None, 8


def quant_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None, offset: torch.Tensor | None = None,
                     bits: int = 8) -> torch.Tensor:
    """The same in torch, in fp32, rounded to x's dtype: dequantize, then matmul."""
    k = x.shape[-1]
    if bits == 4:
        q = unpack_int4(q, k, offset)
    s = scale.float().reshape(q.shape[0], -1)
    w = q.float() * s.repeat_interleave(k // s.shape[1], dim=1)
    y = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)
