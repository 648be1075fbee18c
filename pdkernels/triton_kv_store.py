"""Store a step's new K/V into their cache slots, optionally fused with rotary on k and q (Triton).

Contract. k, v [T, kv_heads, head_dim] (views of a fused qkv projection: last dim contiguous, any
token and head strides); k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim] (same
strides, contiguous last dim); slot_mapping [>= T] int32 or int64, flat slot = block_id *
block_size + offset, and a negative slot (-1) skips the row (padded rows of a CUDA-graph batch).

With cos / sin [T, head_dim] (HF layout cat(freqs, freqs): only the first half is read; strided
views allowed), rotary in the neox / rotate_half style, x * cos + rotate_half(x) * sin with
rotate_half(x) = cat(-x2, x1), is computed in fp32 and rounded to the tensor's dtype: applied to
k before it is stored and to q [T, num_heads, head_dim] IN PLACE on every row (slot -1 rows too).
Without cos / sin the rows are stored as they are and q is untouched.

One launch, one program per token; no allocation, no host sync (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_rows(ptr, stride_h, n_heads, c, s, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                 HEADS_PAD: tl.constexpr):
    """Rotary of one token's heads at ptr ([n_heads, 2 * HALF], head stride stride_h) with the
    token's cos / sin halves c, s [HALF_PAD] fp32: returns (r1, r2) fp32 [HEADS_PAD, HALF_PAD] and
    their offsets and mask."""
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HALF_PAD)
    off = h[:, None] * stride_h + d[None, :]
    mask = (h < n_heads)[:, None] & (d < HALF)[None, :]
    x1 = tl.load(ptr + off, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + off + HALF, mask=mask, other=0.0).to(tl.float32)
    r1 = x1 * c[None, :] - x2 * s[None, :]
    r2 = x2 * c[None, :] + x1 * s[None, :]
    return r1, r2, off, mask


@triton.jit
def _store_kv_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, q_ptr, cos_ptr, sin_ptr,
        n_kv_heads, n_heads, block_size,
        stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
        stride_qt, stride_qh, stride_cos, stride_sin,
        HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
        KV_HEADS_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, ROTARY: tl.constexpr):
    """Program t: token t's k (rotated when ROTARY) and v into slot_mapping[t]; q rotated in
    place."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, KV_HEADS_PAD)
    # keep [KV_HEADS_PAD]: a vector, since the interpreter rejects a scalar mask & a tensor one
    keep = (slot + h * 0) >= 0
    slot = tl.maximum(slot, 0)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    d = tl.arange(0, HEAD_PAD)
    full_mask = (h < n_kv_heads)[:, None] & (d < HEAD_DIM)[None, :]
    c_off = h[:, None] * stride_ch + d[None, :]                       # [KV_HEADS_PAD, HEAD_PAD]
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=full_mask)
    tl.store(vc_ptr + dst + c_off, v, mask=full_mask & keep[:, None])
    if ROTARY:
        dh = tl.arange(0, HALF_PAD)
        c = tl.load(cos_ptr + t * stride_cos + dh, mask=dh < HALF, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_sin + dh, mask=dh < HALF, other=0.0).to(tl.float32)
        r1, r2, off, mask = _rotate_rows(k_ptr + t * stride_kt, stride_kh, n_kv_heads, c, s,
                                         HALF, HALF_PAD, KV_HEADS_PAD)
        ty = kc_ptr.dtype.element_ty
        hk = tl.arange(0, KV_HEADS_PAD)
        rc_off = hk[:, None] * stride_ch + dh[None, :]
        tl.store(kc_ptr + dst + rc_off, r1.to(ty), mask=mask & keep[:, None])
        tl.store(kc_ptr + dst + rc_off + HALF, r2.to(ty), mask=mask & keep[:, None])
        q1, q2, q_off, q_mask = _rotate_rows(q_ptr + t * stride_qt, stride_qh, n_heads, c, s,
                                             HALF, HALF_PAD, HEADS_PAD)
        q_row = q_ptr + t * stride_qt
        tl.store(q_row + q_off, q1.to(q_ptr.dtype.element_ty), mask=q_mask)
        tl.store(q_row + q_off + HALF, q2.to(q_ptr.dtype.element_ty), mask=q_mask)
    else:
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=full_mask)
        tl.store(kc_ptr + dst + c_off, k, mask=full_mask & keep[:, None])


def _check(k, v, k_cache, v_cache, slot_mapping, q, cos, sin) -> None:
    assert k.dim() == 3 and k.shape == v.shape, f"k {tuple(k.shape)}, v {tuple(v.shape)}"
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k and v need a contiguous last dim"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, \
        f"k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, \
        "k_cache and v_cache need the same strides and a contiguous last dim"
    assert k_cache.shape[2:] == k.shape[1:], \
        f"cache heads/dim {tuple(k_cache.shape[2:])} vs k {tuple(k.shape[1:])}"
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, \
        f"dtypes: k {k.dtype}, v {v.dtype}, cache {k_cache.dtype}/{v_cache.dtype}"
    assert slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.dim() == 1 and \
        slot_mapping.numel() >= k.shape[0] and slot_mapping.stride(0) == 1, \
        f"slot_mapping [>= {k.shape[0]}] int32/int64, got {tuple(slot_mapping.shape)} " \
        f"{slot_mapping.dtype}"
    assert (cos is None) == (sin is None) and (cos is None or q is not None), \
        "rotary needs cos, sin and q together"
    if cos is not None:
        t, _, head_dim = k.shape
        assert head_dim % 2 == 0, f"rotary needs an even head_dim, got {head_dim}"
        assert q.dim() == 3 and q.shape[0] == t and q.shape[2] == head_dim and q.stride(-1) == 1, \
            f"q {tuple(q.shape)} (contiguous last dim) for k {tuple(k.shape)}"
        assert q.dtype == k.dtype, f"q {q.dtype}, k {k.dtype}"
        for name, x in (("cos", cos), ("sin", sin)):
            assert x.dim() == 2 and x.shape[0] >= t and x.shape[1] == head_dim and \
                x.stride(1) == 1, \
                f"{name} {tuple(x.shape)} must be [T, {head_dim}] with a contiguous last dim"


def store_kv(k, v, k_cache, v_cache, slot_mapping, *, q=None, cos=None, sin=None) -> None:
    """k, v into the cache slots of slot_mapping (negative: skipped); with cos / sin, rotary on k
    first and on q in place."""
    _check(k, v, k_cache, v_cache, slot_mapping, q, cos, sin)
    t, kv_heads, head_dim = k.shape
    if t == 0:
        return
    rotary = cos is not None
    if not rotary:
        q, cos, sin = k, k, k                                   # unused pointers
    num_heads = q.shape[1]
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, q, cos, sin,
        kv_heads, num_heads, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        q.stride(0), q.stride(1), cos.stride(0), sin.stride(0),
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim), HALF=head_dim // 2,
        HALF_PAD=triton.next_power_of_2(max(head_dim // 2, 1)),
        KV_HEADS_PAD=triton.next_power_of_2(kv_heads), HEADS_PAD=triton.next_power_of_2(num_heads),
        ROTARY=rotary, num_warps=4)


def _rotary_ref(x, cos, sin):
    """x [T, heads, D] rotated in fp32 with the full cos / sin [T, D], in x's dtype."""
    xf = x.float()
    half = x.shape[-1] // 2
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None].float() + rot * sin[:, None].float()).to(x.dtype)


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping, *, q=None, cos=None, sin=None) -> None:
    """The same in torch: rotary in fp32 then cast, rows put by (block, offset), -1 skipped."""
    t = k.shape[0]
    if cos is not None:
        k = _rotary_ref(k, cos[:t], sin[:t])
        q.copy_(_rotary_ref(q, cos[:t], sin[:t]))
    slots = slot_mapping[:t].long()
    keep = slots >= 0
    block_size = k_cache.shape[1]
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    k_cache[blocks, offsets] = k[keep]
    v_cache[blocks, offsets] = v[keep]
