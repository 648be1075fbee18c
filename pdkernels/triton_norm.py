"""RMSNorm, optionally fused with the residual add (Triton), beside its torch reference.

Contract. x [..., D] with one or two leading dims: [T, D] hidden states, or a [T, H, head_dim]
strided view (Qwen3's per-head q / k norm; read in place through its two row strides, last dim
contiguous); weight [D] in x's dtype. Rounding follows HF exactly in structure:
  with residual: s = (x + residual) added in fp32, rounded to x's dtype, written back into
                 residual IN PLACE; without: s = x;
  out = (weight * (s.float() * rsqrt(mean(s.float() ** 2) + eps)).to(dtype)), the product with
        weight rounded to dtype (exact in fp32 before that rounding).
out is a new contiguous tensor of x's shape. Each program normalizes a few rows of one
power-of-two block >= D (D up to 16384).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_D = 16384


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_rows, n_inner, eps,
                     stride_x0, stride_x1, stride_r0, stride_r1,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                     HAS_RES: tl.constexpr):
    """Rows pid * BLOCK_R ...: row r is x[r // n_inner, r % n_inner, :]."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)               # [BLOCK_R]
    rows64 = rows.to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (d < D)[None, :]                       # [BLOCK_R, BLOCK_D]
    i0 = rows64 // n_inner
    i1 = rows64 % n_inner
    x_off = (i0 * stride_x0 + i1 * stride_x1)[:, None] + d[None, :]
    x = tl.load(x_ptr + x_off, mask=mask, other=0.0)
    ty = x.dtype
    s = x.to(tl.float32)
    if HAS_RES:
        r_off = (i0 * stride_r0 + i1 * stride_r1)[:, None] + d[None, :]
        r = tl.load(res_ptr + r_off, mask=mask, other=0.0).to(tl.float32)
        summed = (s + r).to(ty)
        tl.store(res_ptr + r_off, summed, mask=mask)
        s = summed.to(tl.float32)
    var = tl.sum(s * s, 1) / D                                               # [BLOCK_R]
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    w = tl.load(w_ptr + d, mask=d < D, other=0.0).to(tl.float32)
    y = (s * rstd[:, None]).to(ty).to(tl.float32) * w[None, :]
    tl.store(out_ptr + rows64[:, None] * D + d[None, :], y.to(ty), mask=mask)


def _row_strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(n_rows, n_inner, stride0, stride1) of a 2-D or 3-D tensor's rows."""
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)


def rms_norm(x, weight, eps, residual=None):
    """RMSNorm of x's last dim; with residual, of x + residual (residual updated in place to it).
    Returns out, or (out, residual) when residual is given."""
    assert x.dim() in (2, 3), f"x must be [T, D] or [T, H, D], got {tuple(x.shape)}"
    assert x.stride(-1) == 1, "x needs a contiguous last dim"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    d = x.shape[-1]
    assert weight.shape == (d,) and weight.dtype == x.dtype and weight.is_contiguous(), \
        f"weight {tuple(weight.shape)} {weight.dtype} for x [..., {d}] {x.dtype}"
    assert d <= MAX_D, f"D {d} > {MAX_D}"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and \
            residual.stride(-1) == 1, \
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)}"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_rows, n_inner, sx0, sx1 = _row_strides(x)
    if n_rows == 0:
        return out if residual is None else (out, residual)
    _, _, sr0, sr1 = _row_strides(residual) if residual is not None else (0, 0, 0, 0)
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(16, 2048 // block_d))
    warps = 4 if block_d * block_r <= 2048 else (8 if block_d <= 4096 else 16)
    _rms_norm_kernel[(triton.cdiv(n_rows, block_r),)](
        x, residual if residual is not None else x, weight, out, n_rows, n_inner, eps,
        sx0, sx1, sr0, sr1, D=d, BLOCK_D=block_d, BLOCK_R=block_r,
        HAS_RES=residual is not None, num_warps=warps)
    return out if residual is None else (out, residual)


def rms_norm_ref(x, weight, eps, residual=None):
    """The same in torch, HF's sequence of roundings."""
    if residual is not None:
        s = (x.float() + residual.float()).to(x.dtype)
        residual.copy_(s)
    else:
        s = x
    sf = s.float()
    normed = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    out = (weight * normed.to(x.dtype)).contiguous()
    return out if residual is None else (out, residual)
