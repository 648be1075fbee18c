"""KV block checksums: one definition for KV transfers (kvtransfer.integrity) and the KV offload
tiers (engine.kv_offload).

Checksum (`block_checksums`, `checksums`). A block's KV, every layer, K and V, is read as
integer words (int64 when a token's K or V row of one layer is a multiple of 8 bytes, else
int32 or int16, the widest that divides it); each row (one layer, K or V, one token slot) is
summed, and the row sums are combined with odd weights that depend on the row's position in the
block:

    checksum(block) = sum over rows r of (sum of r's words) * (2 * position(r) + 1)   (mod 2^64)

All of it is integer arithmetic modulo 2^64 (torch's int64 wraps on CPUs and CUDA alike, and
modular sums do not depend on the order of the reduction), so the same bytes give the same
checksum on any device, whatever its dtype (fp32, fp16, bf16 are just bytes here). What it
catches: any single flipped bit (a word changes by +-2^k, its row sum too, and an odd weight
keeps that change nonzero modulo 2^64); rows that landed at another row's place (a wrong layer,
K for V, a shifted token slot: their weights differ); a block that is another one (swapped
blocks, a stale block never overwritten, another request's block: different bytes). It is not a
cryptographic hash: someone who can write the pool can forge it. Cost: one read of the blocks
(the sums), nothing per word but an add; on CPUs the blocks are read in place, on devices
gathered in slices of at most GATHER_BYTES so the kernels stay few.
"""

from __future__ import annotations

import itertools
import math

import torch

GATHER_BYTES = 64 << 20     # device path: blocks gathered per slice


def _words(kv: torch.Tensor) -> torch.Tensor:
    """kv [layers, 2, blocks, block_size, kv_heads, head_dim] (contiguous) as integer words
    [layers, 2, blocks, block_size, words per row], without a copy."""
    layers, two, blocks, slots = kv.shape[:4]
    row = kv.reshape(layers, two, blocks, slots, -1).view(torch.uint8)
    for word in (torch.int64, torch.int32):
        if row.shape[-1] % word.itemsize == 0:
            return row.view(word)
    return row.view(torch.int16)           # KV dtypes have 2 or 4 bytes


def _weights(words: torch.Tensor) -> torch.Tensor:
    """Odd weights of the rows' positions in a block: int64 [layers, 2, 1, block_size]."""
    layers, two, _, slots = words.shape[:4]
    position = torch.arange(layers * two * slots, dtype=torch.int64, device=words.device)
    return (position * 2 + 1).view(layers, two, 1, slots)


def checksums(blocks: torch.Tensor) -> torch.Tensor:
    """The checksum of each of `blocks` [layers, 2, n, block_size, kv_heads, head_dim] (a
    gather, or received data): int64 [n] on their device (queued there, no sync)."""
    words = _words(blocks)
    rows = words.sum(-1, dtype=torch.int64)                # [layers, 2, n, block_size]
    return (rows * _weights(words)).sum(dim=(0, 1, 3))


def block_checksums(kv: torch.Tensor, block_ids) -> torch.Tensor:
    """The checksums of the pool's blocks `block_ids`: int64 [len(block_ids)] on kv's device,
    queued on its current stream behind what wrote them (no sync)."""
    ids = [int(b) for b in block_ids]
    if not ids:
        return torch.zeros(0, dtype=torch.int64, device=kv.device)
    if isinstance(kv, torch.Tensor) and kv.device.type == "cpu":
        # in place, a run of consecutive ids at a time (a view): a gather would be a second
        # pass over the blocks (a tensor-parallel pool, engine.parallel.ShardedKV, is gathered)
        words = _words(kv)
        weights = _weights(words)
        runs = [[b for _, b in run]
                for _, run in itertools.groupby(enumerate(ids), key=lambda t: t[1] - t[0])]
        return torch.cat([(words[:, :, run[0]:run[-1] + 1].sum(-1, dtype=torch.int64)
                           * weights).sum(dim=(0, 1, 3)) for run in runs])
    return gathered_checksums(kv, ids)


def gathered_checksums(kv: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """block_checksums on a device: the blocks gathered in slices of at most GATHER_BYTES, a
    few kernels per slice rather than a few per block."""
    per_block = kv.shape[0] * kv.shape[1] * math.prod(kv.shape[3:]) * kv.element_size()
    per = max(1, GATHER_BYTES // per_block)
    index = torch.tensor(block_ids, dtype=torch.long)
    if kv.device.type == "cuda":    # no sync of the device's queued work: page-locked ids
        index = index.pin_memory()
    index = index.to(kv.device, non_blocking=True)
    return torch.cat([checksums(kv.index_select(2, index[i:i + per]))
                      for i in range(0, len(block_ids), per)])
