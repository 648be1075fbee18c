"""The block pool: the mechanism of the paged KV cache (block ids, reference counts, the free
queue, the prefix cache's hash map). Requests' tables are the KV cache manager's
(engine.kv_cache_manager), the only code that changes references.

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
registration and eviction is recorded as an event for the Redis prefix directory, and an evicted
block is offered to `on_evict` (the KV offload tiers, engine.kv_offload) while its KV is intact.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Callable, Sequence

from engine.block_hash import EVICTED, STORED


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
        self._quiet: set[int] = set()       # cached blocks kept out of the events (KV groups)
        # (STORED | EVICTED, hash), appended here and drained by the directory publisher
        # (another thread: deque append/popleft are atomic).
        self.events: deque[tuple[str, int]] = deque()
        self.evictions = 0
        # [(block id, hash, tokens)] of the cached blocks one allocation hands out, before
        # their KV is overwritten
        self.on_evict: Callable[[list[tuple[int, int, tuple[int, ...]]]], None] | None = None

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
        out, evicted = [], []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            if self._hash_of[b] is not None:
                evicted.append((b, self._hash_of[b], self._tokens_of[b]))
                self._evict(b)
            self._ref[b] = 1
            out.append(b)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
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

    def cache(self, block_id: int, block_hash: int, tokens: Sequence[int],
              publish: bool = True) -> None:
        """Register a full, computed block. A hash already held by another block keeps that one
        (two requests computed the same prefix at once; this block stays private). Not
        `publish`ed: no event, now or at its eviction (a KV group's key other than the
        directory's)."""
        if self._hash_of[block_id] is not None or block_hash in self._cached:
            return
        self._hash_of[block_id] = block_hash
        self._tokens_of[block_id] = tuple(tokens)
        self._cached[block_hash] = block_id
        if publish:
            self.events.append((STORED, block_hash))
        else:
            self._quiet.add(block_id)

    def cached_hashes(self) -> list[int]:
        return list(self._cached)

    def cached_blocks(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(block id, hash, tokens) of every cached block, least recently freed first (blocks
        in use last)."""
        order = [b for b in self._free if self._hash_of[b] is not None]
        order += [b for b in self._cached.values() if self._ref[b] > 0]
        return [(b, self._hash_of[b], self._tokens_of[b]) for b in order]

    def _evict(self, b: int) -> None:
        h = self._hash_of[b]
        if h is None:
            return
        self._hash_of[b] = self._tokens_of[b] = None
        del self._cached[h]
        self.evictions += 1
        if b in self._quiet:
            self._quiet.discard(b)
        else:
            self.events.append((EVICTED, h))
