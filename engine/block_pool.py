"""Paged KV cache bookkeeping: the block pool (mechanism) and per-request block tables.

Layout of the KV pool (one tensor, allocated once)::

    kv[layer, k_or_v, block_id, slot, kv_head, head_dim]

    request r, block_size 4, 10 tokens computed:
        block_table(r) = [7, 2, 9]
        token t lives at block_table[t // 4], slot t % 4
        tokens:  0 1 2 3 | 4 5 6 7 | 8 9 . .
        blocks:  [  7   ] [  2    ] [ 9    ]   (2 free slots in block 9)

Blocks are freed tail first, so the blocks of a finished request that are reused last are its
first ones (the ones most likely to be shared by a later request with the same prefix).
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    """Owns the block ids: reference counts and the free queue. Knows nothing of requests."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref[b] = 1
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go back, tail first."""
        for b in reversed(block_ids):
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.append(b)


class KVCacheManager:
    """Per-request block tables on top of a BlockPool."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._tables: dict[str, list[int]] = {}

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        extra = self.blocks_needed(num_tokens) - len(self.block_table(request_id))
        return extra <= self.pool.num_free

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold num_tokens tokens. Returns the new blocks, or None
        (and allocates nothing) when the pool cannot supply them."""
        table = self._tables.setdefault(request_id, [])
        extra = self.blocks_needed(num_tokens) - len(table)
        if extra <= 0:
            return []
        if extra > self.pool.num_free:
            if not table:
                del self._tables[request_id]
            return None
        new = self.pool.allocate(extra)
        table.extend(new)
        return new

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(table)

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks
