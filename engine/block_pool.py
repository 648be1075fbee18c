"""Paged KV cache bookkeeping: the block pool (mechanism) and per-request block tables.

Layout of the KV pool (one tensor, allocated once)::

    kv[layer, k_or_v, block_id, slot, kv_head, head_dim]

    request r, block_size 4, 10 tokens computed:
        block_table(r) = [7, 2, 9]
        token t lives at block_table[t // 4], slot t % 4
        tokens:  0 1 2 3 | 4 5 6 7 | 8 9 . .
        blocks:  [  7   ] [  2    ] [ 9    ]   (2 free slots in block 9)

Prefix cache: once a block is full and its KV computed, it is registered under its chained hash
(engine.block_hash). A later request whose prompt starts with the same blocks takes them (the
reference count goes up) instead of computing them. A block whose count drops to zero goes to the
tail of the free queue but stays findable by its hash until the pool hands it out again, which
takes blocks from the head: least recently freed first. A request frees its blocks tail first, so
its last blocks are evicted before its first ones (the ones most likely to be shared). Each
registration and eviction is recorded as an event for the Redis prefix directory.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence

from engine.block_hash import EVICTED, STORED, BlockHasher, salt_bytes
from engine.request import Request


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    """Owns the block ids: reference counts, the free (LRU) queue, and the hash -> block map.
    Knows nothing of requests."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: list[int | None] = [None] * num_blocks
        self._tokens_of: list[tuple[int, ...] | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}                 # block hash -> block id
        # (STORED | EVICTED, hash), appended here and drained by the directory publisher
        # (another thread: deque append/popleft are atomic).
        self.events: deque[tuple[str, int]] = deque()
        self.evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks no request references (cached ones among them stay findable until reused)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._evict(b)
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go back, tail first."""
        for b in reversed(block_ids):
            if self._ref[b] <= 0:
                raise RuntimeError(f"block {b} freed twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: int, tokens: Sequence[int]) -> int | None:
        """The cached block holding exactly these tokens under this hash, or None."""
        b = self._cached.get(block_hash)
        if b is None or self._tokens_of[b] != tuple(tokens):
            return None
        return b

    def take(self, block_ids: list[int]) -> None:
        """Add a reference to each (cached) block, taking it off the free queue if needed."""
        for b in block_ids:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def cache(self, block_id: int, block_hash: int, tokens: Sequence[int]) -> None:
        """Register a full, computed block. A hash already held by another block keeps that one
        (two requests computed the same prefix at once; this block stays private)."""
        if self._hash_of[block_id] is not None or block_hash in self._cached:
            return
        self._hash_of[block_id] = block_hash
        self._tokens_of[block_id] = tuple(tokens)
        self._cached[block_hash] = block_id
        self.events.append((STORED, block_hash))

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    def _evict(self, b: int) -> None:
        h = self._hash_of[b]
        if h is None:
            return
        self._hash_of[b] = self._tokens_of[b] = None
        del self._cached[h]
        self.evictions += 1
        self.events.append((EVICTED, h))


class KVCacheManager:
    """Per-request block tables on top of a BlockPool, and the prefix cache's lookups.

    With a `hasher`, full computed blocks are registered in the pool's cache and a new request's
    longest cached prefix is reused; without one (--no-prefix-cache) nothing is shared.
    """

    def __init__(self, pool: BlockPool, block_size: int, hasher: BlockHasher | None = None) -> None:
        if hasher is not None and hasher.block_size != block_size:
            raise ValueError("the block hasher's block size differs from the pool's")
        self.pool = pool
        self.block_size = block_size
        self.hasher = hasher
        self._tables: dict[str, list[int]] = {}
        self.query_tokens = 0       # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0         # of which found cached

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        extra = self.blocks_needed(num_tokens) - len(self.block_table(request_id))
        return extra <= self.pool.num_free

    def allocate_slots(self, request_id: str, num_tokens: int,
                       prefix: list[int] | None = None) -> list[int] | None:
        """Grow the request's table to hold num_tokens tokens, starting a new table with the
        cached `prefix` blocks. Returns the new blocks, or None (and changes nothing) when the
        pool cannot supply them."""
        table = self._tables.setdefault(request_id, [])
        prefix = prefix or []
        if prefix and table:
            raise RuntimeError(f"request {request_id}: a cached prefix for a non-empty table")
        extra = self.blocks_needed(num_tokens) - len(table) - len(prefix)
        idle = sum(1 for b in prefix if self.pool.ref_count(b) == 0)   # taken off the free queue
        if max(extra, 0) + idle > self.pool.num_free:
            if not table:
                del self._tables[request_id]
            return None
        self.pool.take(prefix)
        table.extend(prefix)
        new = self.pool.allocate(extra) if extra > 0 else []
        table.extend(new)
        return new

    def fork(self, parent_id: str, child_id: str, num_shared: int) -> tuple[int, int] | None:
        """A table for `child_id`: the parent's first `num_shared` blocks (shared: one more
        reference each) and a new block for the parent's next one, to be filled by copying it.
        Returns (the parent's block, the new block) to copy, each with one more reference held
        for the copy (give them back with `pool.free` once it is done: until then neither can
        go to anyone else, whatever happens to the two requests), or None (nothing changed)
        when no block is free."""
        parent = self._tables[parent_id]
        if child_id in self._tables:
            raise RuntimeError(f"request {child_id} already has blocks")
        if self.pool.num_free < 1 or len(parent) <= num_shared:
            return None
        shared = parent[:num_shared]
        self.pool.take(shared)
        (new,) = self.pool.allocate(1)
        self._tables[child_id] = shared + [new]
        src = parent[num_shared]
        self.pool.take([src, new])            # the copy's references
        return src, new

    def free(self, request_id: str) -> None:
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.free(table)

    # ------------------------------------------------------------------ prefix cache
    def block_hashes(self, req: Request) -> list[int]:
        """The request's full-block hashes, extended to its current tokens."""
        assert self.hasher is not None
        return self.hasher.extend(req.block_hashes, req.all_token_ids, salt_bytes(req.cache_salt))

    def cached_prefix(self, req: Request, max_tokens: int) -> list[int]:
        """Blocks of the longest cached prefix of the request, covering at most max_tokens."""
        if self.hasher is None:
            return []
        hashes = self.block_hashes(req)
        tokens = req.all_token_ids
        bs = self.block_size
        out: list[int] = []
        for i in range(min(len(hashes), max_tokens // bs)):
            b = self.pool.lookup(hashes[i], tokens[i * bs:(i + 1) * bs])
            if b is None:
                break
            out.append(b)
        return out

    def count_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit_tokens

    def cache_computed_blocks(self, req: Request) -> None:
        """Register the request's blocks that are full and computed and not registered yet."""
        if self.hasher is None:
            return
        table = self._tables.get(req.request_id, [])
        full = min(req.num_computed_tokens // self.block_size, len(table))
        if full <= req.num_cached_blocks:
            return
        hashes = self.block_hashes(req)
        tokens = req.all_token_ids
        bs = self.block_size
        for i in range(req.num_cached_blocks, full):
            self.pool.cache(table[i], hashes[i], tokens[i * bs:(i + 1) * bs])
        req.num_cached_blocks = full

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks
