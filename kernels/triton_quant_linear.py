"""Integer-weight linear layers (Triton), beside their torch reference: weight-only int8 per
output channel (--quantization int8) and weights with group scales (pre-quantized 4- and 8-bit
checkpoints: GPTQ, AWQ, compressed-tensors; their values held as int8).

Contract. x [M, K] (fp32, fp16 or bf16; last dim contiguous), q [N, K] int8 (contiguous), scale
[N] or [N, 1] (per channel) or [N, K / G] (groups of G, G a multiple of 16), fp32; bias [N] or
None -> y [M, N] in x's dtype = x @ (q * scale).T + bias, accumulated in fp32. The int8 tile of
q is widened to x's dtype in registers (exact: |q| <= 127) and fed to `tl.dot`, so the weight is
read from memory as int8: a quarter of fp32's bytes, half of bf16's. A per-channel scale is
applied once per output after the K loop; group scales once per K tile (a tile lies in one
group: BLOCK_K divides G). One program per (BLOCK_M x BLOCK_N) tile of y; BLOCK_M follows M
(decode batches are small), BLOCK_N is fixed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _quant_linear_kernel(x_ptr, q_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K, stride_x, stride_y,
                         GROUPS, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (row tile, column tile). GROUP 0: one scale per output channel."""
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
            part = tl.dot(x, q.to(x.dtype), input_precision="ieee")
        else:
            part = tl.dot(x, q.to(x.dtype))
        if GROUP == 0:
            acc += part
        else:
            s = tl.load(scale_ptr + cols.to(tl.int64) * GROUPS + k0 // GROUP, mask=cols < N,
                        other=0.0)
            acc += part * s[None, :]
    out = acc
    if GROUP == 0:
        out = acc * tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :],
             out.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def _group_of(scale: torch.Tensor, n: int, k: int) -> int:
    """0 for a per-channel scale, else the group size its shape says."""
    if scale.dim() == 1 or scale.shape[1] == 1:
        assert scale.shape[0] == n, f"scale: [{n}] or [{n}, 1], got {tuple(scale.shape)}"
        return 0
    groups = scale.shape[1]
    assert scale.shape == (n, groups) and k % groups == 0, f"scale [{n}, K / G], got {scale.shape}"
    group = k // groups
    assert group % 16 == 0, f"group size {group} is not a multiple of 16"
    return group


def quant_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ (q * scale).T (+ bias) for x [..., K]: a new [..., N] tensor in x's dtype."""
    k = x.shape[-1]
    n = q.shape[0]
    assert q.dtype == torch.int8 and q.shape == (n, k) and q.is_contiguous(), "q: int8 [N, K]"
    assert scale.dtype == torch.float32 and scale.is_contiguous(), "scale: contiguous fp32"
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), x.dtype
    group = _group_of(scale, n, k)
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m and n:
        block_m = max(16, min(64, triton.next_power_of_2(m)))     # tl.dot needs >= 16
        block_k = min(BLOCK_K, group & -group) if group else BLOCK_K   # a power of two
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, BLOCK_N))
        _quant_linear_kernel[grid](x2, q, scale, bias if bias is not None else scale, y, m, n, k,
                                   x2.stride(0), y.stride(0), k // group if group else 1,
                                   GROUP=group, HAS_BIAS=bias is not None,
                                   IEEE=x.dtype == torch.float32, BLOCK_M=block_m,
                                   BLOCK_N=BLOCK_N, BLOCK_K=block_k, num_warps=4)
    return y.view(*x.shape[:-1], n)


def quant_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same in torch, in fp32, rounded to x's dtype: dequantize, then matmul."""
    s = scale.float().reshape(q.shape[0], -1)
    w = q.float() * s.repeat_interleave(q.shape[1] // s.shape[1], dim=1)
    y = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)

