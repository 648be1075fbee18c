"""Paged attention over a ragged batch in one launch per layer (Triton), beside its torch reference.

Contract. One layer's KV cache is k_cache, v_cache [num_blocks, block_size, kv_heads, head_dim]
(usually the views cache[0], cache[1] of one [2, ...] tensor; any strides with a contiguous last
dim, the same strides for both). A step's batch holds B sequences: sequence i owns rows
query_start_loc[i] : query_start_loc[i + 1] of q (q_len_i new tokens) and has seq_lens[i] tokens
of context, the new ones included, whose K/V are already in the cache. Query j of sequence i sits
at position seq_lens[i] - q_len_i + j and attends the keys at positions <= its own (causal), read
in place through block_tables[i] (entry pos // block_size, slot pos % block_size). Prompt chunks,
chunks after cached context, decodes and speculative verification mix freely in one batch.
A sequence with seq_lens[i] == 0 (a padding row of a CUDA-graph batch) gets zeros, reads no KV.

A layer may add (engine.config.LayerAttention): `window` > 0, a query attends only its last
`window` positions (tiles before the window are not visited); `softcap` > 0, each score s (scaled)
becomes softcap * tanh(s / softcap); `sinks` [num_heads] fp32, a logit per head that joins each
row's softmax and has no value (in split-KV, split 0 adds it).

Work decomposition. The host plans "tiles" (plan_tiles): one sequence x up to block_q consecutive
queries x one kv head; the tile's rows (block_m, a power of two >= 16) pack (query, head of the kv
group) pairs, so the qpk query heads of a kv head share every K/V tile loaded. A tile visits only
the KV tiles its last query needs (BLOCK_N keys each, gathered token by token through the block
table, so any power-of-two block_size works). Softmax is online, in fp32, with exp2.

Split-KV (num_splits > 1, for decode batches too small to fill the GPU): split s of a tile takes a
contiguous share of its KV tiles and writes a normalized partial output and its log-sum-exp
(natural log; -inf when the split had no keys) to scratch from split_scratch; a second kernel
merges the splits into out weighting each by exp(lse - max lse).

Everything is capturable in a CUDA graph: no host syncs, no allocation when scratch is passed,
grids from python ints only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
BLOCK_N = 64          # keys per KV tile (fp16/bf16)
BLOCK_N_FP32 = 32     # keys per KV tile for fp32 caches (twice the bytes per key)


# ---------------------------------------------------------------------------------------------
# Host-side planning


def attention_tile_shape(num_queries_per_kv: int, max_query_len: int) -> tuple[int, int]:
    """(block_m, block_q): rows of a tile (a power of two >= 16) and queries per tile
    (block_m // qpk). The smallest block_m that holds qpk * max_query_len rows, capped at 128:
    16 for decodes, 32-128 for verification (all its queries share one pass over the context),
    128 for prompt chunks."""
    assert num_queries_per_kv >= 1 and max_query_len >= 0, (num_queries_per_kv, max_query_len)
    rows = num_queries_per_kv * max(max_query_len, 1)
    block_m = 16
    while block_m < rows and block_m < 128:
        block_m *= 2
    block_m = max(block_m, triton.next_power_of_2(num_queries_per_kv))
    return block_m, block_m // num_queries_per_kv


def plan_tiles(q_lens: list[int], block_q: int) -> tuple[list[int], list[int]]:
    """Per tile: its sequence index and its first query (offset within the sequence). Sequences with
    q_len 0 get no tile. A sequence's tiles are listed last queries first: they attend the most
    keys, so the longest programs start first."""
    assert block_q >= 1, block_q
    tile_seq: list[int] = []
    tile_start: list[int] = []
    for i, n in enumerate(q_lens):
        for start in reversed(range(0, n, block_q)):
            tile_seq.append(i)
            tile_start.append(start)
    return tile_seq, tile_start


MAX_SPLITS = 16     # most KV splits of a decode (the backend's split scratch holds them)


def num_splits_for(num_seqs: int, num_kv_heads: int, num_sms: int,
                   max_splits: int = MAX_SPLITS) -> int:
    """KV splits for a decode batch: 1 when num_seqs * num_kv_heads programs already give ~2 per SM,
    else enough splits to reach that, at most max_splits."""
    programs = max(num_seqs * num_kv_heads, 1)
    target = 2 * num_sms
    if programs >= target:
        return 1
    return max(1, min(max_splits, -(-target // programs)))


def split_scratch(max_tokens: int, num_heads: int, head_dim: int, max_splits: int,
                  device) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial_out [max_tokens, num_heads, max_splits, head_dim] fp32,
    partial_lse [max_tokens, num_heads, max_splits] fp32): scratch for split-KV, allocated once."""
    partial_out = torch.empty(max_tokens, num_heads, max_splits, head_dim, dtype=torch.float32,
                              device=device)
    partial_lse = torch.empty(max_tokens, num_heads, max_splits, dtype=torch.float32,
                              device=device)
    return partial_out, partial_lse


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b accumulated in fp32; exact fp32 products (no tf32) when IEEE."""
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _attend_kv(acc, m_i, l_i, q, pos, seq, kvh, t_lo, t_hi, kv_end,
               k_ptr, v_ptr, bt_ptr, stride_bt, stride_kb, stride_ks, stride_kh, scale_log2,
               window, softcap,
               HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr, SLIDING: tl.constexpr,
               SOFTCAP: tl.constexpr):
    """Online softmax of q [BLOCK_M, HEAD_PAD] over KV tiles t_lo..t_hi-1 of one sequence's kv head.
    acc [BLOCK_M, HEAD_PAD], m_i / l_i [BLOCK_M] (log2 domain); pos [BLOCK_M]: the rows'
    positions. Keys past kv_end are never loaded (nor their block-table entries). SLIDING: keys
    at or before pos - window are masked; SOFTCAP: scores soft-capped (scale_log2 is then the
    natural scale, the log2 factor applied after the cap)."""
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    for t in range(t_lo, t_hi):
        n = t * BLOCK_N + tl.arange(0, BLOCK_N)                                  # [BLOCK_N]
        n_ok = n < kv_end
        blk = tl.load(bt_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
        off = blk.to(tl.int64) * stride_kb + (n % BLOCK_SIZE) * stride_ks + kvh * stride_kh
        kt = tl.load(k_ptr + off[None, :] + d[:, None],                    # [HEAD_PAD, BLOCK_N]
                     mask=d_ok[:, None] & n_ok[None, :], other=0.0)
        s = _dot(q, kt, IEEE) * scale_log2                                 # [BLOCK_M, BLOCK_N]
        if SOFTCAP:               # cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0)) * 1.4426950408889634
        seen = (n[None, :] <= pos[:, None]) & n_ok[None, :]
        if SLIDING:
            seen = seen & (n[None, :] > pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + off[:, None] + d[None, :],                     # [BLOCK_N, HEAD_PAD]
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
        bt_ptr, seq_lens_ptr, qsl_ptr, tile_seq_ptr, tile_start_ptr, scale_log2,
        window, softcap, sinks_ptr,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
        stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_bt,
        QPK: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        SPLIT: tl.constexpr, IEEE: tl.constexpr, SLIDING: tl.constexpr = False,
        SOFTCAP: tl.constexpr = False, SINKS: tl.constexpr = False):
    """Program (tile, kv head, split). Writes out rows (normalized, out's dtype) or, when SPLIT,
    its split's normalized partial rows and their log-sum-exp."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    q_first = tl.load(tile_start_ptr + tile)
    tok0 = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - tok0
    context = tl.load(seq_lens_ptr + seq) - q_len             # keys before the first new query

    rows = tl.arange(0, BLOCK_M)
    qi = q_first + rows // QPK                                # query index within the sequence
    head = kvh * QPK + rows % QPK
    row_ok = (rows < BLOCK_Q * QPK) & (qi < q_len)
    pos = context + qi                                        # [BLOCK_M] absolute positions
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    tok = (tok0 + qi).to(tl.int64)
    io_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=io_mask, other=0.0)                      # [BLOCK_M, HEAD_PAD]

    kv_end = tl.maximum(context + tl.minimum(q_first + BLOCK_Q, q_len), 0)
    first_tile = 0
    if SLIDING:                    # the tile's first query sees nothing before its window
        first_tile = tl.maximum(context + q_first - window + 1, 0) // BLOCK_N
    n_tiles = tl.cdiv(kv_end, BLOCK_N) - first_tile
    per_split = tl.cdiv(n_tiles, tl.num_programs(2))
    t_lo = first_tile + split * per_split
    t_hi = tl.minimum(t_lo + per_split, first_tile + n_tiles)

    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_kv(acc, m_i, l_i, q, pos, seq, kvh, t_lo, t_hi, kv_end,
                               k_ptr, v_ptr, bt_ptr, stride_bt, stride_kb, stride_ks, stride_kh,
                               scale_log2, window, softcap, HEAD_DIM, HEAD_PAD, BLOCK_N,
                               BLOCK_SIZE, IEEE, SLIDING, SOFTCAP)
    if SINKS:                     # the head's sink logit joins the softmax once (split 0)
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")) * 1.4426950408889634
        sink = tl.where(split == 0, sink, float("-inf"))
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        m_i = m_new

    has = l_i > 0.0                                           # rows that saw at least one key
    acc = acc / tl.where(has, l_i, 1.0)[:, None]
    o_off = tok[:, None] * stride_ot + head[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=io_mask)
    if SPLIT:
        lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453,
                       float("-inf"))
        tl.store(lse_ptr + tok * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(part_ptr, lse_ptr, out_ptr, num_splits,
                         stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                         stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """Program (token, head): out = sum_s w_s * partial_s / sum_s w_s, w_s = exp(lse_s - max lse);
    zeros when no split saw a key."""
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < num_splits
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_DIM
    lse = tl.load(lse_ptr + tok * stride_lt + head * stride_lh + s, mask=s_ok,
                  other=float("-inf"))                        # [SPLITS_PAD]
    m = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp(lse - tl.where(m > float("-inf"), m, 0.0)), 0.0)
    part = tl.load(part_ptr + tok * stride_pt + head * stride_ph + s[:, None] * stride_ps
                   + d[None, :], mask=(w > 0.0)[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)    # [HEAD_PAD]
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d_ok)


# ---------------------------------------------------------------------------------------------
# Launch wrappers


def _check_attention_args(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
                          tile_seq, tile_start, num_tiles, block_m) -> None:
    assert q.dim() == 3 and out.shape == q.shape, f"q {tuple(q.shape)}, out {tuple(out.shape)}"
    assert q.stride(-1) == 1, "q needs a contiguous last dim"
    assert out.is_contiguous(), "out must be contiguous"
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, \
        f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must match, 4-D"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1, \
        "k_cache and v_cache need the same strides and a contiguous last dim"
    assert q.dtype == out.dtype == k_cache.dtype == v_cache.dtype, \
        f"dtypes differ: q {q.dtype}, out {out.dtype}, cache {k_cache.dtype}/{v_cache.dtype}"
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), q.dtype
    _, block_size, kv_heads, head_dim = k_cache.shape
    num_heads = q.shape[1]
    assert q.shape[2] == head_dim and head_dim % 2 == 0, f"head_dim {q.shape[2]} vs {head_dim}"
    assert num_heads % kv_heads == 0, f"{num_heads} heads over {kv_heads} kv heads"
    assert block_size & (block_size - 1) == 0, f"block_size {block_size} not a power of two"
    qpk = num_heads // kv_heads
    assert block_m >= 16 and block_m & (block_m - 1) == 0 and block_m >= qpk, \
        f"block_m {block_m}: a power of two >= 16 and >= {qpk} queries per kv head"
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc), ("tile_seq", tile_seq),
                    ("tile_start", tile_start)):
        assert t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}"
        assert t.device == q.device, f"{name} on {t.device}, q on {q.device}"
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1, \
        f"block_tables must be [B_cap, max_blocks] with contiguous rows, got {block_tables.shape}"
    assert tile_seq.numel() >= num_tiles and tile_start.numel() >= num_tiles, \
        f"{num_tiles} tiles, tile_seq {tile_seq.numel()}, tile_start {tile_start.numel()}"


def paged_attention(q, k_cache, v_cache, out, *, block_tables, seq_lens, query_start_loc,
                    tile_seq, tile_start, num_tiles: int, block_m: int, scale: float,
                    num_splits: int = 1, partial_out=None, partial_lse=None, window: int = 0,
                    softcap: float = 0.0, sinks=None) -> None:
    """Causal paged attention of the ragged batch, written into out [T, num_heads, head_dim].

    q [T, num_heads, head_dim] (last dim contiguous); k_cache, v_cache [num_blocks, block_size,
    kv_heads, head_dim]; block_tables [B_cap, max_blocks], seq_lens [B_cap],
    query_start_loc [B_cap + 1], tile_seq / tile_start [>= num_tiles]: all int32 on q's device.
    The tiles (plan_tiles with attention_tile_shape's block_q for this block_m) must cover every
    row of out. num_splits > 1 needs partial_out / partial_lse from split_scratch (allocated here
    when omitted, which breaks CUDA-graph capture). window, softcap, sinks ([num_heads] fp32 on
    q's device): what the module docstring says."""
    if sinks is not None:
        assert sinks.dtype == torch.float32 and sinks.shape == (q.shape[1],) and \
            sinks.device == q.device, f"sinks: fp32 [{q.shape[1]}] on q's device"
    _check_attention_args(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
                          tile_seq, tile_start, num_tiles, block_m)
    if num_tiles == 0:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    qpk = num_heads // kv_heads
    split = num_splits > 1
    if split:
        if partial_out is None or partial_lse is None:
            partial_out, partial_lse = split_scratch(q.shape[0], num_heads, head_dim, num_splits,
                                                     q.device)
        _check_scratch(q, partial_out, partial_lse, num_splits)
        dst, lse = partial_out, partial_lse
        d_strides = (dst.stride(0), dst.stride(1), dst.stride(2))
        l_strides = (lse.stride(0), lse.stride(1))
    else:
        dst, lse = out, out                                  # lse unused without splits
        d_strides = (out.stride(0), out.stride(1), 0)
        l_strides = (0, 0)
    fp32 = q.dtype == torch.float32
    _paged_attention_kernel[(num_tiles, kv_heads, num_splits)](
        q, k_cache, v_cache, dst, lse,
        block_tables, seq_lens, query_start_loc, tile_seq, tile_start,
        scale if softcap else scale * LOG2E, window, float(softcap),
        sinks if sinks is not None else seq_lens,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        *d_strides, *l_strides, block_tables.stride(0),
        QPK=qpk, HEAD_DIM=head_dim, HEAD_PAD=max(triton.next_power_of_2(head_dim), 16),
        BLOCK_M=block_m, BLOCK_Q=block_m // qpk, BLOCK_N=BLOCK_N_FP32 if fp32 else BLOCK_N,
        BLOCK_SIZE=block_size, SPLIT=split, IEEE=fp32, SLIDING=window > 0,
        SOFTCAP=softcap > 0, SINKS=sinks is not None,
        num_warps=4 if block_m <= 64 else 8, num_stages=2 if fp32 else 3)
    if split:
        merge_splits(partial_out, partial_lse, out, num_splits)


def _check_scratch(q, partial_out, partial_lse, num_splits: int) -> None:
    t, num_heads, head_dim = q.shape
    assert partial_out.dtype == partial_lse.dtype == torch.float32, "split scratch must be fp32"
    assert partial_out.dim() == 4 and partial_out.shape[0] >= t and \
        partial_out.shape[1] == num_heads and partial_out.shape[3] == head_dim and \
        partial_out.stride(3) == 1, \
        f"partial_out {tuple(partial_out.shape)} for q {tuple(q.shape)} (split_scratch's layout)"
    assert partial_lse.dim() == 3 and partial_lse.shape[:2] == partial_out.shape[:2] and \
        partial_lse.stride(2) == 1, f"partial_lse {tuple(partial_lse.shape)}"
    assert num_splits <= partial_out.shape[2] and num_splits <= partial_lse.shape[2], \
        f"{num_splits} splits, scratch holds {partial_out.shape[2]}"


def merge_splits(partial_out, partial_lse, out, num_splits: int) -> None:
    """out [T, num_heads, head_dim] = the lse-weighted merge of the first num_splits partials."""
    t, num_heads, head_dim = out.shape
    _merge_splits_kernel[(t, num_heads)](
        partial_out, partial_lse, out, num_splits,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_PAD=triton.next_power_of_2(head_dim),
        SPLITS_PAD=max(triton.next_power_of_2(num_splits), 2), num_warps=1 if head_dim <= 64 else 2)


# ---------------------------------------------------------------------------------------------
# Reference


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                        window: int = 0, softcap: float = 0.0, sinks=None):
    """The same attention in plain torch, one sequence at a time, in fp32; returns q's dtype.
    Sequences are read until query_start_loc reaches T = q.shape[0]."""
    t, num_heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    qpk = num_heads // kv_heads
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    out = torch.zeros(t, num_heads, head_dim, dtype=torch.float32, device=q.device)
    i = 0
    while i < len(lens) and i + 1 < len(qsl) and qsl[i] < t:
        lo, hi, length = qsl[i], qsl[i + 1], lens[i]
        i += 1
        if hi == lo or length == 0:
            continue
        blocks = block_tables[i - 1, :-(-length // block_size)].long()
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:length].float()   # [L, kvh, D]
        v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:length].float()
        k = k.repeat_interleave(qpk, dim=1).transpose(0, 1)                     # [H, L, D]
        v = v.repeat_interleave(qpk, dim=1).transpose(0, 1)
        qs = q[lo:hi].float().transpose(0, 1)                                   # [H, n, D]
        scores = qs @ k.transpose(1, 2) * scale                                 # [H, n, L]
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        qpos = torch.arange(length - (hi - lo), length, device=q.device)
        keys = torch.arange(length, device=q.device)[None, :]
        allowed = keys <= qpos[:, None]
        if window:
            allowed &= keys > qpos[:, None] - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(-1, 1, 1).expand(-1, hi - lo, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[lo:hi] = (probs @ v).transpose(0, 1)
    return out.to(q.dtype)
