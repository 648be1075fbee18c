"""Paged attention against dense causal attention, on a ragged batch with single-token decodes,
short queries after cached context, a long chunk after cached context and a fresh prompt: with
one group per kind (accelerators) and with groups limited in size (CPUs), down to one sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdkernels import cpu_attention

from engine.attention.torch_backend import (MAX_GROUPED_QUERY, AttentionMetadata, group_tokens_for,
                              paged_attention, store_kv)

HEADS, KV_HEADS, DIM, BS = 6, 2, 8, 4


def dense(q, k, v, scale):
    """q: [n, H, D] for the last n positions of k, v: [L, KVH, D]; causal."""
    n, length = q.shape[0], k.shape[0]
    rep = HEADS // KV_HEADS
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    pos_q = torch.arange(length - n, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", F.softmax(scores, -1), v)


@pytest.mark.parametrize("limit,num_groups,kernel", [(None, 2, False), (40, 4, False),
                                                     (1, 5, False), (None, 0, True)],
                         ids=["unlimited", "limited", "one-each", "cpu-kernel"])
def test_every_path_matches_dense_causal_attention(limit, num_groups, kernel):
    if kernel and not cpu_attention.available():
        pytest.skip("the CPU attention kernel needs an AVX2 x86 CPU")
    g = torch.Generator().manual_seed(0)
    # (cached tokens, new tokens): decodes, grouped short queries of different lengths (padded),
    # a long chunk after cached context, a fresh prompt
    seqs = [(9, 1), (22, 1), (13, 5), (3, 2), (30, 9), (7, MAX_GROUPED_QUERY + 3), (0, 11)]
    num_blocks = 64
    cache = torch.zeros(2, num_blocks, BS, KV_HEADS, DIM)
    perm = torch.randperm(num_blocks - 1, generator=g).add(1).tolist()   # scattered blocks
    tables, full_k, full_v = [], [], []
    for cached, new in seqs:
        need = -(-(cached + new) // BS)
        tables.append([perm.pop() for _ in range(need)])
        full_k.append(torch.randn(cached + new, KV_HEADS, DIM, generator=g))
        full_v.append(torch.randn(cached + new, KV_HEADS, DIM, generator=g))
    # the cached part is already in the cache
    for (cached, _), table, k, v in zip(seqs, tables, full_k, full_v):
        if cached:
            slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(cached)])
            store_kv(cache, k[:cached], v[:cached], slots)
    meta = AttentionMetadata.build(tables, [c for c, _ in seqs], [n for _, n in seqs], BS,
                                   torch.device("cpu"), group_tokens=limit, kernel=kernel)
    # decodes: contexts 10 and 23; short queries: 18, 5 and 39 (padded to their group's longest)
    assert len(meta.groups) == num_groups and meta.one_by_one == [5, 6]
    assert (meta.kernel is not None) == kernel
    q = torch.randn(sum(n for _, n in seqs), HEADS, DIM, generator=g)
    k = torch.cat([k[c:] for (c, _), k in zip(seqs, full_k)])
    v = torch.cat([v[c:] for (c, _), v in zip(seqs, full_v)])
    store_kv(cache, k, v, meta.slot_mapping)
    out = paged_attention(q, k, v, cache, meta, DIM ** -0.5)
    for i, (cached, new) in enumerate(seqs):
        rows = slice(meta.query_start_loc[i], meta.query_start_loc[i + 1])
        want = dense(q[rows], full_k[i], full_v[i], DIM ** -0.5)
        torch.testing.assert_close(out[rows], want, atol=1e-5, rtol=1e-5,
                                   msg=f"sequence {i} ({cached} cached, {new} new)")


def test_cpu_groups_gather_about_two_mib_per_layer():
    pool = torch.zeros(1, 2, 1, BS, 3, 64)                 # fp32, 3 KV heads of 64
    assert group_tokens_for(pool) == (2 << 20) // (2 * 3 * 64 * 4)


def test_cpu_attention_choice_forces_a_path_or_says_why_it_cannot(monkeypatch):
    from engine.attention import torch_backend
    from engine.attention.torch_backend import use_cpu_kernel
    from pdkernels import cpu_build

    cpu = torch.device("cpu")
    assert use_cpu_kernel("sdpa", cpu, 64, 16, torch.float32) is False
    if cpu_attention.available():
        assert use_cpu_kernel("avx2", cpu, 64, 16, torch.float32) is True
        monkeypatch.setattr(cpu_build, "kernels_preferred", lambda: False)     # an AVX-512 host
        assert use_cpu_kernel("auto", cpu, 64, 16, torch.float32) is False
        monkeypatch.setattr(cpu_build, "kernels_preferred", lambda: True)
        assert use_cpu_kernel("auto", cpu, 64, 16, torch.float32) is True
        with pytest.raises(ValueError, match="--cpu-attention avx2: .*head_dim a multiple of 8"):
            use_cpu_kernel("avx2", cpu, 20, 16, torch.float32)
    with pytest.raises(ValueError, match="--cpu-attention avx2: .*CPUs only"):
        use_cpu_kernel("avx2", torch.device("meta"), 64, 16, torch.float32)
    with pytest.raises(ValueError, match="cpu_attention must be one of"):
        use_cpu_kernel("flash", cpu, 64, 16, torch.float32)
    monkeypatch.setattr(torch_backend.cpu_attention, "supports", lambda *a: False)
    monkeypatch.setattr(torch_backend.cpu_attention, "available", lambda: False)
    with pytest.raises(ValueError, match="AVX2 and FMA"):
        use_cpu_kernel("avx2", cpu, 64, 16, torch.float32)
    assert use_cpu_kernel("auto", cpu, 64, 16, torch.float32) is False
