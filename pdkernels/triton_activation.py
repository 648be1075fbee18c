"""SiLU-and-mul of a fused gate/up projection (Triton), beside its torch reference.

Contract. x [T, 2 * I] (gate columns first, then up; last dim contiguous, any row stride) ->
out [T, I] = silu(gate) * up, new and contiguous, rounded as HF does: silu computed in fp32 and
rounded to x's dtype, then multiplied by up in fp32 and rounded again. A 2-D grid (rows x column
blocks) covers any I.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_I = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, BLOCK: tl.constexpr):
    """Program (row, column block)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * inter + cols, out.to(gate.dtype), mask=mask)


def silu_and_mul(x):
    """silu(x[:, :I]) * x[:, I:] for x [T, 2 * I]: a new [T, I] tensor in x's dtype."""
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2 * I], got {tuple(x.shape)}"
    assert x.stride(1) == 1, "x needs a contiguous last dim"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    t, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty(t, inter, dtype=x.dtype, device=x.device)
    if t == 0 or inter == 0:
        return out
    block = min(BLOCK_I, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(t, triton.cdiv(inter, block))](
        x, out, inter, x.stride(0), BLOCK=block, num_warps=4)
    return out


def silu_and_mul_ref(x):
    """The same in torch: silu in fp32 rounded to x's dtype (what HF's act_fn(gate) yields), then
    the product in fp32 rounded (what HF's `* up` yields)."""
    inter = x.shape[1] // 2
    gate, up = x[:, :inter], x[:, inter:]
    act = torch.nn.functional.silu(gate.float()).to(x.dtype)
    return (act.float() * up.float()).to(x.dtype)
