"""Batched LoRA for the adapted projections (Triton), segmented by adapter as SGMV does, beside
engine.lora.layers.lora_delta (its torch reference).

Contract. x [T, in]; a [slots, S * R, in] (S shards' A side by side); b: S tensors [slots, R,
out_s] whose out_s tile y's columns; y [T, out] is updated in place: for each row of a slot,
y[row] += cat_s((x[row] @ a[slot]^T)[s * R:(s + 1) * R] @ b_s[slot]). Rows of no slot are not
touched. `plan(...)` groups a step's rows by slot once (LoRAPlan: perm, the rows slot by slot;
tiles of at most BLOCK_M of them, each of one slot). Two launches:

    shrink  (tiles x R-column blocks):       h[perm rows] = x[rows] @ a[slot]^T   (fp32 [T, S*R])
    expand  (tiles x out-column blocks x S): y[rows, cols of s] += h[rows, s] @ b_s[slot]

dtypes fp32 / fp16 / bf16, products accumulated in fp32 (fp32 exact: no tf32).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdkernels.triton_attention import _dot     # fp32 products exact (ieee) where asked

BLOCK_M = 16        # rows of a tile (tl.dot's least)
BLOCK_K = 64        # the input dim, per step of the shrink's loop
BLOCK_N = 64        # output columns of an expand program


@dataclass(frozen=True)
class LoRAPlan:
    """A step's rows by slot, on the device: perm [n] int32 (the rows of slot 0's tiles, then
    ...), tile_slot / tile_start / tile_end [tiles] int32 (a slice of perm, one slot each)."""

    perm: torch.Tensor
    tile_slot: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor

    @property
    def num_tiles(self) -> int:
        return self.tile_slot.shape[0]


def plan(segments: list[tuple[int, list[int]]], device: torch.device) -> LoRAPlan:
    """From (slot, rows) per slot used (engine.lora.layers.LoRABatch)."""
    perm, slots, starts, ends = [], [], [], []
    for slot, rows in segments:
        for i in range(0, len(rows), BLOCK_M):
            slots.append(slot)
            starts.append(len(perm) + i)
            ends.append(len(perm) + min(i + BLOCK_M, len(rows)))
        perm.extend(rows)

    def i32(v):
        return torch.tensor(v, dtype=torch.int32, device=device)
    return LoRAPlan(i32(perm), i32(slots), i32(starts), i32(ends))


@triton.jit
def _tile_rows(perm_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr, BLOCK_M: tl.constexpr):
    """The program's tile: its slot, its rows [BLOCK_M] (int64) and which of them are real."""
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    m = start + tl.arange(0, BLOCK_M)
    m_ok = m < end
    rows = tl.load(perm_ptr + m, mask=m_ok, other=0).to(tl.int64)
    return slot, rows, m_ok


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, h_ptr, perm_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
                   fan_in, width, stride_x, stride_as, stride_ar, stride_h,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   IEEE: tl.constexpr):
    """Program (tile, column block of S * R): h[rows, cols] = x[rows] @ a[slot, cols]^T."""
    slot, rows, m_ok = _tile_rows(perm_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
                                  BLOCK_M)
    cols = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    c_ok = cols < width
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, fan_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < fan_in
        xk = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :],
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)            # [M, K]
        ak = tl.load(a_ptr + slot * stride_as + cols[None, :] * stride_ar + k[:, None],
                     mask=c_ok[None, :] & k_ok[:, None], other=0.0)            # [K, R]
        acc += _dot(xk, ak, IEEE)
    tl.store(h_ptr + rows[:, None] * stride_h + cols[None, :], acc,
             mask=m_ok[:, None] & c_ok[None, :])


@triton.jit
def _expand_kernel(h_ptr, b_ptr, y_ptr, perm_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
                   rank, out_s, h_col0, y_col0, stride_h, stride_bs, stride_br, stride_y,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                   IEEE: tl.constexpr):
    """Program (tile, column block of the shard): y[rows, y_col0 + n] += h[rows, h_col0 + r]
    @ b[slot, r, n]."""
    slot, rows, m_ok = _tile_rows(perm_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
                                  BLOCK_M)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < rank
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < out_s
    hk = tl.load(h_ptr + rows[:, None] * stride_h + h_col0 + r[None, :],
                 mask=m_ok[:, None] & r_ok[None, :], other=0.0)                 # [M, R] fp32
    bk = tl.load(b_ptr + slot * stride_bs + r[:, None] * stride_br + n[None, :],
                 mask=r_ok[:, None] & n_ok[None, :], other=0.0)                 # [R, N]
    d = _dot(hk.to(bk.dtype), bk, IEEE)
    ptrs = y_ptr + rows[:, None] * stride_y + y_col0 + n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, (y.to(tl.float32) + d).to(y.dtype), mask=mask)


def lora_delta(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: list[torch.Tensor],
               p: LoRAPlan, reduce=None) -> None:
    """y += the plan's rows' LoRA products (see the module docstring), in place. `reduce`
    (tensor parallelism, a row-parallel layer): sums the shrink's h over the ranks first."""
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous()
    assert all(bs.is_contiguous() for bs in b)
    slots, width, fan_in = a.shape
    rank = b[0].shape[1]
    if p.num_tiles == 0:
        return
    ieee = x.dtype == torch.float32
    h = torch.zeros(x.shape[0], width, dtype=torch.float32, device=x.device)
    block_r = max(16, triton.next_power_of_2(min(width, 64)))
    _shrink_kernel[(p.num_tiles, triton.cdiv(width, block_r))](
        x, a, h, p.perm, p.tile_slot, p.tile_start, p.tile_end, fan_in, width, x.stride(0),
        a.stride(0), a.stride(1), h.stride(0), BLOCK_M=BLOCK_M, BLOCK_R=block_r,
        BLOCK_K=BLOCK_K, IEEE=ieee)
    if reduce is not None:
        h = reduce(h)
    rank_block = max(16, triton.next_power_of_2(rank))
    col = 0
    for s, bs in enumerate(b):
        out_s = bs.shape[2]
        _expand_kernel[(p.num_tiles, triton.cdiv(out_s, BLOCK_N))](
            h, bs, y, p.perm, p.tile_slot, p.tile_start, p.tile_end, rank, out_s, s * rank,
            col, h.stride(0), bs.stride(0), bs.stride(1), y.stride(0), BLOCK_M=BLOCK_M,
            BLOCK_R=rank_block, BLOCK_N=BLOCK_N, IEEE=ieee)
        col += out_s
