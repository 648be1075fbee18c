"""Weight-only int8 linear layer (Triton), beside its torch reference.

Contract. x [M, K] (fp32, fp16 or bf16; last dim contiguous), q [N, K] int8 (contiguous), scale
[N] fp32, bias [N] or None -> y [M, N] in x's dtype = (x @ q.T) * scale + bias, accumulated in
fp32. The int8 tile of q is widened to x's dtype in registers (exact: |q| <= 127) and fed to
`tl.dot`, so the weight is read from memory as int8: a quarter of fp32's bytes, half of bf16's.
The scale is applied once per output after the K loop. One program per (BLOCK_M x BLOCK_N) tile
of y; BLOCK_M follows M (decode batches are small), BLOCK_N and BLOCK_K are fixed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _int8_linear_kernel(x_ptr, q_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K, stride_x, stride_y,
                        HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row tile, column tile)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + kk[None, :],
                    mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
        q = tl.load(q_ptr + cols[None, :].to(tl.int64) * K + kk[:, None],
                    mask=(cols[None, :] < N) & (kk[:, None] < K), other=0)    # [BLOCK_K, BLOCK_N]
        if IEEE:                                   # fp32 x: exact products, no tf32
            acc += tl.dot(x, q.to(x.dtype), input_precision="ieee")
        else:
            acc += tl.dot(x, q.to(x.dtype))
    scale = tl.load(scale_ptr + cols, mask=cols < N, other=0.0)
    out = acc * scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :],
             out.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """(x @ q.T) * scale (+ bias) for x [..., K]: a new [..., N] tensor in x's dtype."""
    k = x.shape[-1]
    n = q.shape[0]
    assert q.dtype == torch.int8 and q.shape == (n, k) and q.is_contiguous(), "q: int8 [N, K]"
    assert scale.dtype == torch.float32 and scale.shape == (n,), "scale: fp32 [N]"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        block_m = max(16, min(64, triton.next_power_of_2(m)))     # tl.dot needs >= 16
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
        _int8_linear_kernel[grid](x2, q, scale, bias if bias is not None else scale, y, m, n, k,
                                  x2.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                                  IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                                  num_warps=4)
    return y.view(*x.shape[:-1], n)


def int8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same in torch, in fp32, rounded to x's dtype: dequantize, then matmul."""
    w = q.float() * scale.float()[:, None]
    y = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)
