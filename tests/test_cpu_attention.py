"""The AVX2 paged-attention kernel (pdkernels/cpu_attention.py) against the torch reference, on
ragged batches of decodes and short queries after cached context, and the torch backend using
it for those sequences."""

from __future__ import annotations

import pytest
import torch

from pdkernels import cpu_attention
from pdkernels.triton_attention import paged_attention_ref

pytestmark = pytest.mark.skipif(not cpu_attention.available(),
                                reason="the kernel targets x86 CPUs whose best ISA is AVX2")


def batch(seqs, heads, kv_heads, dim, bs, seed=0, num_blocks=96):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, bs, kv_heads, dim, generator=g)
    v = torch.randn(num_blocks, bs, kv_heads, dim, generator=g)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-(c + n) // bs) for c, n in seqs) + 2
    tables = torch.full((len(seqs), width), 10**6, dtype=torch.int32)   # crash if read
    starts, lens, qlens, t = [], [], [], 0
    for i, (cached, new) in enumerate(seqs):
        used = -(-(cached + new) // bs)
        tables[i, :used] = torch.tensor([perm.pop() for _ in range(used)], dtype=torch.int32)
        starts.append(t)
        lens.append(cached + new)
        qlens.append(new)
        t += new
    q = torch.randn(t, heads, dim, generator=g)
    ints = [torch.tensor(x, dtype=torch.int32) for x in (lens, starts, qlens)]
    return q, k, v, tables, ints, torch.tensor(starts + [t], dtype=torch.int32)


@pytest.mark.parametrize("heads,kv_heads,dim,bs", [(9, 3, 64, 16), (32, 8, 128, 16),
                                                    (4, 4, 16, 4), (6, 2, 32, 32)])
def test_kernel_matches_the_reference(heads, kv_heads, dim, bs):
    seqs = [(40, 1), (0, 1), (15, 1), (33, 5), (100, 17), (3, 33), (bs - 1, 1)]
    q, k, v, tables, (lens, starts, qlens), qsl = batch(seqs, heads, kv_heads, dim, bs)
    out = torch.full_like(q, float("nan"))
    cpu_attention.paged_attention(q, k, v, out, tables, lens, starts, qlens, dim ** -0.5)
    want = paged_attention_ref(q, k, v, tables, lens, qsl, dim ** -0.5)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("window,softcap,sinks", [(20, 0.0, False), (0, 1.5, False),
                                                  (0, 0.0, True), (9, 2.0, True)])
def test_sliding_window_softcap_and_sinks_match_the_reference(window, softcap, sinks):
    """A layer's window (the blocks wholly before every row's window are not read: their table
    entries would crash), soft-capped scores, a sink logit per head."""
    heads, kv_heads, dim, bs = 6, 2, 32, 4
    seqs = [(40, 1), (0, 1), (15, 1), (33, 5), (100, 17), (3, 14)]
    q, k, v, tables, (lens, starts, qlens), qsl = batch(seqs, heads, kv_heads, dim, bs)
    g = torch.Generator().manual_seed(3)
    sink = torch.randn(heads, generator=g) * 2 if sinks else None
    extra = dict(window=window, softcap=softcap, sinks=sink)
    want = paged_attention_ref(q, k, v, tables, lens, qsl, dim ** -0.5, **extra)
    if window:
        for i, (cached, _) in enumerate(seqs):        # before the first query's window: unread
            tables[i, :max(cached - window + 1, 0) // bs] = 10**6
    out = torch.full_like(q, float("nan"))
    cpu_attention.paged_attention(q, k, v, out, tables, lens, starts, qlens, dim ** -0.5,
                                  **extra)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)


def test_strided_q_and_cache_views_and_only_listed_sequences():
    seqs = [(20, 1), (7, 3)]
    q, k, v, tables, (lens, starts, qlens), qsl = batch(seqs, 6, 2, 32, 8)
    fused = torch.randn(q.shape[0], 10, 32)                    # q as a view of a wider tensor
    fused[:, :6] = q
    cache = torch.stack([k, v])                                # [2, N, bs, kvh, d] as the pool
    out = torch.zeros_like(q)
    # only the second sequence: the first one's rows stay untouched
    cpu_attention.paged_attention(fused[:, :6], cache[0], cache[1], out, tables[1:].contiguous(),
                                  lens[1:].contiguous(), starts[1:].contiguous(),
                                  qlens[1:].contiguous(), 0.2)
    want = paged_attention_ref(q, k, v, tables, lens, qsl, 0.2)
    torch.testing.assert_close(out[1:], want[1:], rtol=2e-5, atol=2e-5)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_unsupported_shapes_are_refused():
    assert not cpu_attention.supports(20, 16, torch.float32)     # head_dim % 8
    assert not cpu_attention.supports(64, 128, torch.float32)    # block larger than handled
    assert not cpu_attention.supports(64, 16, torch.bfloat16)
    q, k, v, tables, ints, _ = batch([(3, 1)], 2, 1, 16, 4)
    with pytest.raises(ValueError, match="int32"):
        cpu_attention.paged_attention(q, k, v, q.clone(), tables.long(), *ints, 1.0)
