"""Attention over the paged KV cache (pure torch; Triton kernels slot in behind the same calls).

A step's batch is ragged: B sequences, each contributing q_len_i new tokens, concatenated into
T = sum(q_len_i) rows with no padding. `AttentionMetadata` describes that batch once per step and
is passed explicitly to every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    """Shapes: T = new tokens in the step, B = sequences in the step.

    slot_mapping:     [T] long, flat slot (block_id * block_size + offset) each new token's KV goes to
    query_start_loc:  B + 1 ints, sequence i owns rows [query_start_loc[i], query_start_loc[i+1])
    seq_lens:         B ints, context length of sequence i after this step (cached + new)
    block_tables:     B long tensors, the blocks of sequence i in order
    """

    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[torch.Tensor]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def store_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write new K/V rows into one layer's cache.

    cache: [2, num_blocks, block_size, kv_heads, head_dim]; k, v: [T, kv_heads, head_dim].
    """
    kv_heads, head_dim = k.shape[1], k.shape[2]
    cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, k)
    cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)


def gather_kv(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> tuple[torch.Tensor, ...]:
    """K and V of the first `length` tokens of a sequence: two [length, kv_heads, head_dim]."""
    _, _, block_size, kv_heads, head_dim = cache.shape
    n = -(-length // block_size)
    k = torch.index_select(cache[0], 0, blocks[:n]).view(-1, kv_heads, head_dim)[:length]
    v = torch.index_select(cache[1], 0, blocks[:n]).view(-1, kv_heads, head_dim)[:length]
    return k, v


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole context.

    q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] (already stored in `cache`).
    Returns [T, heads, head_dim].
    """
    out = torch.empty_like(q)
    qsl = meta.query_start_loc
    for i, seq_len in enumerate(meta.seq_lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == seq_len:       # nothing cached before: attend over the step's own rows
            ks, vs = k[start:end], v[start:end]
        else:
            ks, vs = gather_kv(cache, meta.block_tables[i], seq_len)
        out[start:end] = _attend(q[start:end], ks, vs, scale)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [q_len, heads, d]; k, v: [kv_len, kv_heads, d]; queries are the last q_len positions."""
    q_len, kv_len = q.shape[0], k.shape[0]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))   # [1, heads, len, d]
    if q_len == 1:
        o = F.scaled_dot_product_attention(qh, kh, vh, scale=scale, enable_gqa=True)
    elif q_len == kv_len:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:  # a chunk after cached context: query i sits at position kv_len - q_len + i
        pos_q = torch.arange(kv_len - q_len, kv_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= pos_q[:, None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)                                  # [q_len, heads, d]
