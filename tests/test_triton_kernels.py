"""The Triton kernels (pdkernels/triton_*.py) against their torch references.

The device comes from PDSERVE_TEST_DEVICE (default cpu: the Triton interpreter, which conftest.py
turns on; tiny shapes, fp32 and fp16). On cuda bf16 is tested too. Unused cache slots hold NaN
and unused block-table entries -1 or 2**30, so a kernel reading what it must not fails loudly.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pdkernels.triton_activation import silu_and_mul, silu_and_mul_ref
from pdkernels.triton_attention import (attention_tile_shape, num_splits_for, paged_attention,
                                      paged_attention_ref, plan_tiles, split_scratch)
from pdkernels.triton_kv_store import store_kv, store_kv_ref
from pdkernels.triton_norm import rms_norm, rms_norm_ref

DEVICE = os.environ.get("PDSERVE_TEST_DEVICE", "cpu")
if DEVICE.startswith("cuda") and not torch.cuda.is_available():
    pytest.skip(f"PDSERVE_TEST_DEVICE={DEVICE} but CUDA is unavailable", allow_module_level=True)
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.startswith("cuda") else [])
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}   # atol == rtol
ULP = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}    # ~one rounding step
GARBAGE = 2 ** 30

# (q_len, seq_len): a fresh prompt chunk, a chunk after cached context crossing blocks, decodes,
# a sequence with no queries this step, a verification-like query after long context, a padding
# row (q_len 1, nothing cached).
MIXED = [(20, 20), (13, 50), (1, 45), (0, 30), (1, 1), (5, 150), (1, 0)]
DECODES = [(1, 150), (1, 7), (3, 90), (1, 0), (1, 64)]


def _close(actual, expected, dtype, tol=None):
    tol = TOL[dtype] if tol is None else tol
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _rounded_like(actual, expected, dtype):
    """Within one rounding step of the reference and, in 16-bit dtypes, bit-exact on >= 98% of
    the elements (fp32 math differs in the last bits; a missing or extra rounding to the dtype
    flips about a quarter of them)."""
    _close(actual, expected, dtype, tol=ULP[dtype])
    if dtype != torch.float32:
        inexact = (actual != expected).float().mean().item()
        assert inexact <= 0.02, f"{inexact:.1%} of the elements differ from the reference"


# ---------------------------------------------------------------------------------------------
# Paged attention


def make_batch(specs, kv_heads, qpk, head_dim, block_size, dtype, seed=0):
    """A ragged batch over a NaN-filled paged cache: each sequence's tokens on scattered blocks.
    Returns a dict of the kernel's inputs plus the dense per-sequence K/V for cross-checks."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-length // block_size) for _, length in specs]
    num_blocks = sum(need) + 4
    cache = torch.full((2, num_blocks, block_size, kv_heads, head_dim), float("nan"))
    flat = cache.view(2, num_blocks * block_size, kv_heads, head_dim)
    perm = torch.randperm(num_blocks, generator=g)
    b_cap, max_blocks = len(specs) + 2, max(need) + 3
    garbage = torch.where(torch.rand(b_cap, max_blocks, generator=g) < 0.5, -1, GARBAGE)
    tables = garbage.to(torch.int32)
    dense, used = [], 0
    for i, (_, length) in enumerate(specs):
        ids = perm[used:used + need[i]]
        used += need[i]
        tables[i, :need[i]] = ids.to(torch.int32)
        pos = torch.arange(length)
        kv = torch.randn(2, length, kv_heads, head_dim, generator=g)
        flat[:, ids[pos // block_size] * block_size + pos % block_size] = kv
        dense.append(kv.to(dtype).float())
    q_lens = [n for n, _ in specs]
    t, heads = sum(q_lens), kv_heads * qpk
    fused = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    qsl = torch.full((b_cap + 1,), GARBAGE, dtype=torch.int32)
    qsl[:len(specs) + 1] = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist())
    seq_lens = torch.full((b_cap,), GARBAGE, dtype=torch.int32)
    seq_lens[:len(specs)] = torch.tensor([length for _, length in specs])
    dev = DEVICE
    return dict(q=fused[:, :heads * head_dim].view(t, heads, head_dim).to(dev),
                cache=cache.to(dtype).to(dev), block_tables=tables.to(dev),
                seq_lens=seq_lens.to(dev), query_start_loc=qsl.to(dev), q_lens=q_lens,
                dense=dense, scale=head_dim ** -0.5)


def attention_kwargs(b, block_m=None):
    """paged_attention's keyword arguments for batch b: tiles planned on the host, padded with
    garbage."""
    q, cache = b["q"], b["cache"]
    qpk = q.shape[1] // cache.shape[3]
    if block_m is None:
        block_m, block_q = attention_tile_shape(qpk, max(b["q_lens"]))
    else:
        block_q = block_m // qpk
    tile_seq, tile_start = plan_tiles(b["q_lens"], block_q)
    pad = [GARBAGE] * 3
    return dict(block_tables=b["block_tables"], seq_lens=b["seq_lens"],
                query_start_loc=b["query_start_loc"],
                tile_seq=torch.tensor(tile_seq + pad, dtype=torch.int32, device=q.device),
                tile_start=torch.tensor(tile_start + pad, dtype=torch.int32, device=q.device),
                num_tiles=len(tile_seq), block_m=block_m, scale=b["scale"])


def run_attention(b, block_m=None, num_splits=1, scratch=None):
    """The kernel on batch b into a NaN-filled out."""
    q, cache = b["q"], b["cache"]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    partial_out, partial_lse = scratch if scratch is not None else (None, None)
    paged_attention(q, cache[0], cache[1], out, **attention_kwargs(b, block_m),
                    num_splits=num_splits, partial_out=partial_out, partial_lse=partial_lse)
    return out


def reference(b):
    cache = b["cache"]
    return paged_attention_ref(b["q"], cache[0], cache[1], b["block_tables"], b["seq_lens"],
                               b["query_start_loc"], b["scale"])


def padding_rows(b):
    """Rows of q that belong to sequences with seq_len 0."""
    qsl, lens = b["query_start_loc"].tolist(), b["seq_lens"].tolist()
    return [r for i in range(len(b["q_lens"])) if lens[i] == 0 for r in range(qsl[i], qsl[i + 1])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,qpk,head_dim,block_size", [
    (2, 1, 64, 16), (2, 3, 40, 4), (1, 4, 32, 8)])
def test_attention_mixed_batch(dtype, kv_heads, qpk, head_dim, block_size):
    b = make_batch(MIXED, kv_heads, qpk, head_dim, block_size, dtype)
    out = run_attention(b)
    assert not out.isnan().any(), "a row was left unwritten or read garbage"
    _close(out, reference(b), dtype)
    assert (out[padding_rows(b)] == 0).all(), "padding rows (seq_len 0) must be exactly zero"


@pytest.mark.parametrize("block_m", [16, 32, 128])
def test_attention_tile_sizes(block_m):
    """Any block_m >= qpk serves any batch: prompts then span several tiles."""
    dtype = torch.float32
    b = make_batch(MIXED, 2, 3, 64, 8, dtype, seed=1)
    _close(run_attention(b, block_m=block_m), reference(b), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_split_kv_matches_unsplit(dtype):
    b = make_batch(DECODES, 2, 4, 64, 16, dtype, seed=2)
    base = run_attention(b)
    _close(base, reference(b), dtype)
    scratch = split_scratch(len(b["q"]) + 3, b["q"].shape[1], 64, 8, b["q"].device)
    for num_splits in (1, 2, 3, 8):
        out = run_attention(b, num_splits=num_splits, scratch=scratch)
        _close(out, base, dtype, tol=ULP[dtype])
        assert (out[padding_rows(b)] == 0).all()


@pytest.mark.parametrize("dtype,window,softcap,sinks", [
    (torch.float32, 40, 0.0, False), (torch.float32, 0, 1.5, False),
    (torch.float32, 0, 0.0, True), *[(d, 9, 2.0, True) for d in DTYPES]])
def test_attention_sliding_softcap_sinks(dtype, window, softcap, sinks):
    """A layer's window (tiles before it skipped), soft-capped scores and per-head sinks against
    the reference, unsplit and split (split 0 adds the sink once), on mixed batches and decodes
    whose contexts run far past the window."""
    for specs, splits in ((MIXED, (1, 3)), (DECODES, (1, 2, 8))):
        b = make_batch(specs, 2, 3, 40, 8, dtype, seed=4)
        heads = b["q"].shape[1]
        g = torch.Generator().manual_seed(5)
        extra = dict(window=window, softcap=softcap,
                     sinks=(torch.randn(heads, generator=g) * 2).to(b["q"].device)
                     if sinks else None)
        cache = b["cache"]
        want = paged_attention_ref(b["q"], cache[0], cache[1], b["block_tables"],
                                   b["seq_lens"], b["query_start_loc"], b["scale"], **extra)
        for num_splits in splits:
            out = torch.full(b["q"].shape, float("nan"), dtype=dtype, device=b["q"].device)
            paged_attention(b["q"], cache[0], cache[1], out, **attention_kwargs(b),
                            num_splits=num_splits, **extra)
            assert not out.isnan().any()
            _close(out, want, dtype)
            assert (out[padding_rows(b)] == 0).all()


def test_attention_split_kv_mixed_batch():
    """Splits also serve prompt chunks (odd head_dim, block_size 4), without scratch passed."""
    b = make_batch(MIXED, 1, 3, 40, 4, torch.float32, seed=3)
    _close(run_attention(b, num_splits=3), reference(b), torch.float32)


@pytest.mark.parametrize("qpk", [1, 3])
def test_attention_ref_matches_dense(qpk):
    """The reference against SDPA on each sequence's dense K/V with an explicit causal mask."""
    b = make_batch(MIXED, 2, qpk, 16, 4, torch.float32, seed=4)
    ref = reference(b).cpu()
    q, qsl = b["q"].cpu(), b["query_start_loc"].tolist()
    for i, (n, length) in enumerate(MIXED):
        rows = slice(qsl[i], qsl[i] + n)
        if n == 0 or length == 0:
            assert (ref[rows] == 0).all()
            continue
        k, v = (x.transpose(0, 1)[None] for x in b["dense"][i])                 # [1, kvh, L, D]
        mask = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
        want = F.scaled_dot_product_attention(q[rows].transpose(0, 1)[None].float(), k, v,
                                              attn_mask=mask, scale=b["scale"], enable_gqa=True)
        _close(ref[rows], want[0].transpose(0, 1), torch.float32)


def test_tile_planning():
    assert attention_tile_shape(4, 1) == (16, 4)
    assert attention_tile_shape(3, 1) == (16, 5)
    assert attention_tile_shape(1, 1) == (16, 16)
    assert attention_tile_shape(4, 5) == (32, 8)
    assert attention_tile_shape(3, 2048) == (128, 42)
    assert attention_tile_shape(32, 1) == (32, 1)
    seqs, starts = plan_tiles([5, 0, 1, 11], 4)
    assert sorted(zip(seqs, starts)) == [(0, 0), (0, 4), (2, 0), (3, 0), (3, 4), (3, 8)]
    assert plan_tiles([], 4) == ([], [])
    assert num_splits_for(64, 8, 132) == 1
    assert num_splits_for(1, 8, 132) == 16
    assert num_splits_for(4, 8, 132) == 9
    assert num_splits_for(1, 8, 132, max_splits=4) == 4
    po, pl = split_scratch(6, 4, 40, 3, "cpu")
    assert po.shape == (6, 4, 3, 40) and pl.shape == (6, 4, 3) and po.dtype == torch.float32


def test_attention_rejects_bad_arguments():
    b = make_batch(DECODES, 2, 2, 16, 4, torch.float32)
    with pytest.raises(AssertionError, match="int32"):
        b["seq_lens"] = b["seq_lens"].long()
        run_attention(b)
    b = make_batch(DECODES, 2, 2, 16, 4, torch.float32)
    with pytest.raises(AssertionError, match="block_m"):
        run_attention(b, block_m=24)


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="CUDA graphs need a GPU")
def test_kernels_capture_in_cuda_graph():
    """Split-KV attention (scratch passed), the KV store with rotary, the norm and the activation
    captured in one CUDA graph and replayed give the references' results."""
    dtype = torch.float16
    b = make_batch(DECODES, 2, 4, 64, 16, dtype, seed=8)
    q, cache = b["q"], b["cache"]
    kw = attention_kwargs(b)
    scratch = split_scratch(len(q), q.shape[1], q.shape[2], 4, q.device)
    out = torch.empty_like(q)
    case = make_store_case(dtype, torch.int32, rotary=True)
    x = torch.randn(5, 64, device=DEVICE).to(dtype)
    w = torch.rand(64, device=DEVICE).to(dtype) + 0.5
    fused, store_cache = case["fused"].clone(), case["cache"].clone()
    want_fused, want_cache = _run_store(store_kv_ref, case, rotary=True)

    def step():
        paged_attention(q, cache[0], cache[1], out, **kw, num_splits=4,
                        partial_out=scratch[0], partial_lse=scratch[1])
        heads, kv_heads, d = case["q"].shape[1], case["k"].shape[1], case["k"].shape[2]
        store_kv(fused[:, heads * d:(heads + kv_heads) * d].view(-1, kv_heads, d),
                 fused[:, (heads + kv_heads) * d:].view(-1, kv_heads, d),
                 store_cache[0], store_cache[1], case["slots"],
                 q=fused[:, :heads * d].view(-1, heads, d), cos=case["cos"], sin=case["sin"])
        return rms_norm(x, w, 1e-6), silu_and_mul(x)

    _run_store(store_kv, case, rotary=True)                   # compiles every kernel first
    step()
    fused.copy_(case["fused"])
    store_cache.copy_(case["cache"])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, act = step()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    _close(out, reference(b), dtype)
    _rounded_like(store_cache, want_cache, dtype)
    _rounded_like(fused, want_fused, dtype)
    _rounded_like(normed, rms_norm_ref(x, w, 1e-6), dtype)
    _rounded_like(act, silu_and_mul_ref(x), dtype)


# ---------------------------------------------------------------------------------------------
# KV store (+ rotary)


def make_store_case(dtype, slot_dtype, rotary, seed=0):
    """Strided q/k/v views of one fused projection, a NaN-free cache, slots with -1 holes."""
    g = torch.Generator().manual_seed(seed)
    t, t_cap, heads, kv_heads, d, bs, nb = 7, 10, 6, 2, 16, 4, 5
    fused = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q = fused[:, :heads * d].view(t, heads, d)
    k = fused[:, heads * d:(heads + kv_heads) * d].view(t, kv_heads, d)
    v = fused[:, (heads + kv_heads) * d:].view(t, kv_heads, d)
    cache = torch.randn(2, nb, bs, kv_heads, d, generator=g).to(dtype)
    slots = torch.randperm(nb * bs, generator=g)[:t_cap]
    slots[[1, 4]] = -1
    slots[t:] = GARBAGE                                       # beyond T: never read
    case = dict(fused=fused, q=q, k=k, v=v, cache=cache, slots=slots.to(slot_dtype))
    if rotary:
        freqs = torch.rand(t, d // 2, generator=g) * 20
        emb = torch.cat((freqs, freqs), dim=-1)
        wide = torch.zeros(t, 2 * d)                          # cos / sin as strided views
        wide[:, :d], wide[:, d:] = emb.cos(), emb.sin()
        wide = wide.to(dtype)
        case.update(cos=wide[:, :d], sin=wide[:, d:])
    return {k: (x.to(DEVICE) if torch.is_tensor(x) else x) for k, x in case.items()}


def _run_store(fn, case, rotary):
    fused = case["fused"].clone()
    heads, kv_heads, d = case["q"].shape[1], case["k"].shape[1], case["k"].shape[2]
    q = fused[:, :heads * d].view(-1, heads, d)
    k = fused[:, heads * d:(heads + kv_heads) * d].view(-1, kv_heads, d)
    v = fused[:, (heads + kv_heads) * d:].view(-1, kv_heads, d)
    cache = case["cache"].clone()
    extra = dict(q=q, cos=case["cos"], sin=case["sin"]) if rotary else {}
    fn(k, v, cache[0], cache[1], case["slots"], **extra)
    return fused, cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("rotary", [False, True])
def test_store_kv(dtype, slot_dtype, rotary):
    case = make_store_case(dtype, slot_dtype, rotary)
    fused, cache = _run_store(store_kv, case, rotary)
    want_fused, want_cache = _run_store(store_kv_ref, case, rotary)
    _rounded_like(cache, want_cache, dtype)
    _rounded_like(fused, want_fused, dtype)
    if not rotary:
        assert torch.equal(cache, want_cache) and torch.equal(fused, case["fused"])
    # Slots not written (the -1 rows') keep their old contents exactly.
    bs = cache.shape[2]
    written = torch.zeros(cache.shape[1] * bs, dtype=torch.bool, device=cache.device)
    slots = case["slots"][:len(case["k"])].long()
    written[slots[slots >= 0]] = True
    untouched = ~written.view(cache.shape[1], bs)
    assert torch.equal(cache[:, untouched], case["cache"][:, untouched])
    assert written.sum() == len(case["k"]) - 2
    if rotary:   # q rotated on every row, -1 rows included; k and v stayed where they were
        heads, d = case["q"].shape[1], case["q"].shape[2]
        assert not torch.equal(fused[:, :heads * d], case["fused"][:, :heads * d])
        assert torch.equal(fused[:, heads * d:], case["fused"][:, heads * d:])


# ---------------------------------------------------------------------------------------------
# RMSNorm and SiLU-and-mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [48, 4100])
def test_rms_norm_2d(dtype, d):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, d, generator=g).to(dtype).to(DEVICE)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype).to(DEVICE)
    res = torch.randn(9, d, generator=g).to(dtype).to(DEVICE)
    x0 = x.clone()
    _rounded_like(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6), dtype)
    res_k, res_r = res.clone(), res.clone()
    out, back = rms_norm(x, w, 1e-5, residual=res_k)
    want, _ = rms_norm_ref(x, w, 1e-5, residual=res_r)
    assert back is res_k and torch.equal(res_k, res_r), "residual must become x + residual"
    assert not torch.equal(res_k, res)
    _rounded_like(out, want, dtype)
    assert out.is_contiguous() and torch.equal(x, x0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_heads(dtype):
    """Per-head norm on q and k viewed out of one fused projection, no copy."""
    g = torch.Generator().manual_seed(6)
    t, heads, kv_heads, d = 5, 6, 2, 16
    fused = torch.randn(t, (heads + 2 * kv_heads) * d, generator=g).to(dtype).to(DEVICE)
    w = (torch.rand(d, generator=g) + 0.5).to(dtype).to(DEVICE)
    for lo, n in ((0, heads), (heads * d, kv_heads)):
        x = fused[:, lo:lo + n * d].view(t, n, d)
        assert not x.is_contiguous()
        out = rms_norm(x, w, 1e-6)
        assert out.shape == x.shape and out.is_contiguous()
        _rounded_like(out, rms_norm_ref(x, w, 1e-6), dtype)
        res = torch.randn(t, n, d, generator=g).to(dtype).to(DEVICE)
        res_r = res.clone()
        out, _ = rms_norm(x, w, 1e-6, residual=res)
        want, _ = rms_norm_ref(x, w, 1e-6, residual=res_r)
        assert torch.equal(res, res_r)
        _rounded_like(out, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(7)
    inter = 1500                                            # > one column block, not a multiple
    wide = (torch.randn(6, 2 * inter + 8, generator=g) * 4).to(dtype).to(DEVICE)
    x = wide[:, :2 * inter]                                 # strided rows
    out = silu_and_mul(x)
    assert out.shape == (6, inter) and out.is_contiguous()
    _rounded_like(out, silu_and_mul_ref(x), dtype)
    want = F.silu(x[:, :inter].float()) * x[:, inter:].float()
    _close(out, want, dtype, tol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_lora_matches_the_torch_reference(dtype):
    """Segmented LoRA (pdkernels.triton_lora) against engine.lora.layers.lora_delta: three
    adapters of a four-slot stack over rows in any order, one slot's rows past a tile, rows of
    the base model untouched, q/k/v-like shards of unequal widths, rank 8 in a 16-wide stack."""
    from engine.lora.layers import LoRABatch, lora_delta as reference
    from pdkernels import triton_lora

    g = torch.Generator().manual_seed(0)
    slots, rank, fan_in, outs = 4, 8, 40, [24, 8, 8]
    a = (torch.randn(slots, len(outs) * rank, fan_in, generator=g) * 0.3).to(dtype)
    b = [(torch.randn(slots, rank, o, generator=g) * 0.3).to(dtype) for o in outs]
    seq_slots, q_lens = [2, -1, 0, 2, 3], [3, 2, 1, 19, 4]
    t = sum(q_lens)
    x = torch.randn(t, fan_in, generator=g).to(dtype)
    y = torch.randn(t, sum(outs), generator=g).to(dtype)
    batch = LoRABatch.of(seq_slots, q_lens, torch.device("cpu"))
    want = y.float().clone()
    reference(want, x.float(), a.float(), [bs.float() for bs in b], batch)
    dev = torch.device(DEVICE)
    p = triton_lora.plan([(s, rows.tolist()) for s, rows in batch.segments], dev)
    got = y.to(dev).clone()
    triton_lora.lora_delta(got, x.to(dev), a.to(dev), [bs.to(dev) for bs in b], p)
    _close(got.cpu(), want, dtype, tol=TOL[dtype] * 10)
    assert torch.equal(got.cpu()[3:5], y[3:5])                  # the base model's rows
