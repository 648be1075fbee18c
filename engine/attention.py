"""Attention over the paged KV cache (pure torch; Triton kernels slot in behind the same calls).

A step's batch is ragged: B sequences, each contributing q_len_i new tokens, concatenated into
T = sum(q_len_i) rows with no padding. `AttentionMetadata` describes that batch once per step and
is passed explicitly to every layer.

Two groups are attended differently:
  * decode rows (q_len 1): all at once, one gather of their context slots and one SDPA call over
    a [B_dec, heads, 1, L_max] problem with a padding mask (L_max: the longest context);
  * prefill chunks (q_len > 1): one SDPA call per sequence (causal, offset by cached context).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class DecodeGroup:
    """rows: [Bd] long, rows of the step's T that are single-token decodes;
    blocks: [Bd, nb_max] long, each sequence's block table padded with block 0;
    mask: [Bd, 1, 1, nb_max * block_size] bool, True where the position is real."""

    rows: torch.Tensor
    blocks: torch.Tensor
    mask: torch.Tensor


@dataclass(frozen=True)
class AttentionMetadata:
    """Shapes: T = new tokens in the step, B = sequences in the step.

    slot_mapping:     [T] long, flat slot (block_id * block_size + offset) each new token's KV goes to
    query_start_loc:  B + 1 ints, sequence i owns rows [query_start_loc[i], query_start_loc[i+1])
    seq_lens:         B ints, context length of sequence i after this step (cached + new)
    block_tables:     B long tensors, the blocks of sequence i in order
    prefill_seqs:     indices i of sequences with more than one new token
    decode:           the single-token sequences, batched (None if there are none)
    """

    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[torch.Tensor]
    prefill_seqs: list[int]
    decode: DecodeGroup | None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def build(cls, tables: list[list[int]], starts: list[int], q_lens: list[int],
              block_size: int, device: torch.device) -> "AttentionMetadata":
        """tables: each sequence's blocks; starts: its cached tokens; q_lens: its new tokens."""
        slots, qsl, seq_lens, prefill, dec_rows, dec_seqs = [], [0], [], [], [], []
        for i, (table, start, n) in enumerate(zip(tables, starts, q_lens)):
            slots.extend(table[p // block_size] * block_size + p % block_size
                         for p in range(start, start + n))
            if n == 1:
                dec_rows.append(qsl[-1])
                dec_seqs.append(i)
            else:
                prefill.append(i)
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
        decode = None
        if dec_rows:
            nb = max(-(-seq_lens[i] // block_size) for i in dec_seqs)
            padded = torch.zeros(len(dec_seqs), nb, dtype=torch.long)
            for j, i in enumerate(dec_seqs):
                used = -(-seq_lens[i] // block_size)
                padded[j, :used] = torch.tensor(tables[i][:used], dtype=torch.long)
            lens = torch.tensor([seq_lens[i] for i in dec_seqs])
            mask = torch.arange(nb * block_size)[None, :] < lens[:, None]   # [Bd, nb * bs]
            decode = DecodeGroup(torch.tensor(dec_rows, dtype=torch.long, device=device),
                                 padded.to(device), mask[:, None, None, :].to(device))
        chunked = set(prefill)
        all_tables = [torch.tensor(tables[i], dtype=torch.long, device=device)
                      if i in chunked else None for i in range(len(tables))]
        return cls(torch.tensor(slots, dtype=torch.long, device=device), qsl, seq_lens,
                   all_tables, prefill, decode)


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
    if meta.decode is not None:
        out[meta.decode.rows] = _decode_attention(q, cache, meta.decode, scale)
    qsl = meta.query_start_loc
    for i in meta.prefill_seqs:
        start, end, seq_len = qsl[i], qsl[i + 1], meta.seq_lens[i]
        if end - start == seq_len:       # nothing cached before: attend over the step's own rows
            ks, vs = k[start:end], v[start:end]
        else:
            ks, vs = gather_kv(cache, meta.block_tables[i], seq_len)
        out[start:end] = _attend(q[start:end], ks, vs, scale)
    return out


def _decode_attention(q: torch.Tensor, cache: torch.Tensor, group: DecodeGroup,
                      scale: float) -> torch.Tensor:
    """One query per sequence over its padded context. Returns [Bd, heads, head_dim]."""
    _, _, block_size, kv_heads, head_dim = cache.shape
    bd, nb = group.blocks.shape
    flat = group.blocks.view(-1)
    k = cache[0].index_select(0, flat)                                    # [Bd*nb, bs, KVH, D]
    v = cache[1].index_select(0, flat)
    k = k.view(bd, nb * block_size, kv_heads, head_dim).transpose(1, 2)   # [Bd, KVH, L, D]
    v = v.view(bd, nb * block_size, kv_heads, head_dim).transpose(1, 2)
    qd = q[group.rows].unsqueeze(2)                                       # [Bd, H, 1, D]
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=group.mask, scale=scale,
                                       enable_gqa=True)                   # [Bd, H, 1, D]
    return o.squeeze(2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [q_len, heads, d]; k, v: [kv_len, kv_heads, d]; queries are the last q_len positions."""
    q_len, kv_len = q.shape[0], k.shape[0]
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))   # [1, heads, len, d]
    if q_len == kv_len:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:  # a chunk after cached context: query i sits at position kv_len - q_len + i
        pos_q = torch.arange(kv_len - q_len, kv_len, device=q.device)
        mask = torch.arange(kv_len, device=q.device)[None, :] <= pos_q[:, None]
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)                                  # [q_len, heads, d]
