"""The KV cache manager: the one owner of block references above the block pool.

Every reference change of the pool happens here: requests' block tables (allocated, grown,
forked, freed), the prefix cache's hits, the extra references a forked choice's block copy holds
until it is done, and those a KV transfer holds (engine.kv_connector decides which, as a
`RefChange`; the scheduler hands the decision here). Nothing else calls the pool's
allocate/take/free (tests/test_kv_ownership.py checks it).

    scheduler ---- tables, prefix hits, forks ----------------> KVCacheManager --> BlockPool
    scheduler ---- KVConnector's RefChange (transfers) --------> apply()
    engine ------- take_copies() / copies_done() (forks) ------>
    offload tiers: a prefix that continues below the pool ------> restored into new blocks
                   (a restore in flight holds its blocks until it is finished)

Engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_hash import BlockHasher, salt_bytes
from engine.block_pool import BlockPool
from engine.request import Request


@dataclass
class RefChange:
    """References a KV transfer's decision asks for (engine.kv_connector), applied in this
    order by KVCacheManager.apply."""

    hold: list[int] = field(default_factory=list)      # one more reference each
    free_tables: list[str] = field(default_factory=list)   # requests whose tables go
    release: list[int] = field(default_factory=list)   # one reference back each

    def __bool__(self) -> bool:
        return bool(self.hold or self.free_tables or self.release)

    def __iadd__(self, other: "RefChange") -> "RefChange":
        self.hold += other.hold
        self.free_tables += other.free_tables
        self.release += other.release
        return self


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
        # each table's id for as long as it lives (a table only grows under it; a new table
        # of the same request, after preemption, gets a new one): attention backends keep
        # tables on the device by it (engine.attention.block_tables)
        self._table_ids: dict[str, int] = {}
        self._next_table_id = 0
        self._copies: list[tuple[int, int]] = []   # (src, dst) of forks, not copied yet
        self.query_tokens = 0       # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0         # of which found cached
        self.offload = None         # engine.kv_offload.KVOffload: the tiers below the pool
        self._restoring: dict[str, object] = {}   # request id -> its RestoreJob in flight

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def table_id(self, request_id: str) -> int | None:
        """The id of the request's table (None: it has none)."""
        return self._table_ids.get(request_id)

    def _new_table(self, request_id: str, blocks: list[int]) -> list[int]:
        self._tables[request_id] = blocks
        self._table_ids[request_id] = self._next_table_id
        self._next_table_id += 1
        return blocks

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        extra = self.blocks_needed(num_tokens) - len(self.block_table(request_id))
        return extra <= self.pool.num_free

    def allocate_slots(self, request_id: str, num_tokens: int,
                       prefix: list[int] | None = None) -> list[int] | None:
        """Grow the request's table to hold num_tokens tokens, starting a new table with the
        cached `prefix` blocks. Returns the new blocks, or None (and changes nothing) when the
        pool cannot supply them."""
        table = self._tables.get(request_id)
        if table is None:
            table = self._new_table(request_id, [])
        prefix = prefix or []
        if prefix and table:
            raise RuntimeError(f"request {request_id}: a cached prefix for a non-empty table")
        extra = self.blocks_needed(num_tokens) - len(table) - len(prefix)
        idle = sum(1 for b in prefix if self.pool.ref_count(b) == 0)   # taken off the free queue
        if max(extra, 0) + idle > self.pool.num_free:
            if not table:
                del self._tables[request_id], self._table_ids[request_id]
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
        for the copy (`take_copies` hands the pair out, `copies_done` gives the references back:
        until then neither block can go to anyone else, whatever happens to the two requests),
        or None (nothing changed) when no block is free."""
        parent = self._tables[parent_id]
        if child_id in self._tables:
            raise RuntimeError(f"request {child_id} already has blocks")
        if self.pool.num_free < 1 or len(parent) <= num_shared:
            return None
        shared = parent[:num_shared]
        self.pool.take(shared)
        (new,) = self.pool.allocate(1)
        self._new_table(child_id, shared + [new])
        src = parent[num_shared]
        self.pool.take([src, new])            # the copy's references
        self._copies.append((src, new))
        return src, new

    def share(self, parent_id: str, child_id: str, num_blocks: int) -> None:
        """A table for `child_id` of the parent's first `num_blocks` blocks, shared (one more
        reference each): a fork at a block boundary, where nothing needs copying."""
        if child_id in self._tables:
            raise RuntimeError(f"request {child_id} already has blocks")
        shared = self._tables[parent_id][:num_blocks]
        self.pool.take(shared)
        self._new_table(child_id, list(shared))

    @property
    def pending_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block pairs of forks still to be copied."""
        return list(self._copies)

    def take_copies(self) -> list[tuple[int, int]]:
        """The forks' block pairs to copy now (their references stay until copies_done)."""
        pairs, self._copies = self._copies, []
        return pairs

    def copies_done(self, pairs: list[tuple[int, int]]) -> None:
        """The copies of `pairs` are queued: the references held for them go back."""
        self.pool.free([b for pair in pairs for b in pair])

    def free(self, request_id: str) -> None:
        """The request's table goes (its blocks' references back, tail first), and a restore
        of its prefix in flight ends (waited for: what arrived intact stays cached)."""
        if request_id in self._restoring:
            self._finish_restore(request_id)
        table = self._tables.pop(request_id, None)
        self._table_ids.pop(request_id, None)
        if table:
            self.pool.free(table)

    def apply(self, change: RefChange) -> None:
        """Carry out a KV transfer's decision (engine.kv_connector)."""
        if change.hold:
            self.pool.take(change.hold)
        for request_id in change.free_tables:
            self.free(request_id)
        if change.release:
            self.pool.free(change.release)

    # ------------------------------------------------------------------ prefix cache
    def block_hashes(self, req: Request) -> list[int]:
        """The request's full-block hashes, extended to its current tokens."""
        assert self.hasher is not None
        return self.hasher.extend(req.block_hashes, req.all_token_ids, salt_bytes(req.cache_salt))

    def cached_prefix(self, req: Request, max_tokens: int) -> list[int] | None:
        """Blocks of the longest cached prefix of the request, covering at most max_tokens: the
        pool's, then those restored from the offload tiers into new blocks (cached and free,
        like any evictable cached block, until the caller takes them). None while such a
        restore is in flight (on CUDA its copies run beside the steps): ask again later; the
        call after it is done finds the restored blocks in the pool (and starts no other)."""
        if self.hasher is None:
            return []
        restore = self.offload is not None
        if req.request_id in self._restoring:
            if not self._restoring[req.request_id].done():
                return None
            self._finish_restore(req.request_id)
            restore = False
        hashes = self.block_hashes(req)
        tokens = req.all_token_ids
        bs = self.block_size
        limit = min(len(hashes), max_tokens // bs)
        out: list[int] = []
        for i in range(limit):
            b = self.pool.lookup(hashes[i], tokens[i * bs:(i + 1) * bs])
            if b is None:
                break
            out.append(b)
        if self.offload is not None and restore:
            for h in hashes[:len(out)]:
                self.offload.seen(h)
            if len(out) < limit and self._begin_restore(req.request_id, hashes[len(out):limit],
                                                        tokens, out):
                if not self._restoring[req.request_id].done():
                    return None
                return self.cached_prefix(req, max_tokens)   # done at once (CPUs)
        return out

    def _begin_restore(self, request_id: str, hashes: list[int], tokens,
                       found: list[int]) -> bool:
        """Start restoring blocks len(found), len(found)+1, ... of a prompt (`hashes` theirs)
        from the offload tiers, as far as they continue there and the pool has free blocks to
        put them in; the blocks `found` in the pool are held meanwhile. -> whether one began
        (its job in `_restoring`)."""
        bs, start = self.block_size, len(found)
        chunks = [tuple(tokens[(start + j) * bs:(start + j + 1) * bs]) for j in range(len(hashes))]
        run = self.offload.find_run(hashes, chunks)[:self.pool.num_free]
        if not run:
            return False
        self.pool.take(found)           # the blocks found must not be handed to the restore
        blocks = self.pool.allocate(len(run))       # may evict (and store) others
        job = self.offload.begin_restore(run, blocks)
        job.held, job.chunks = list(found), chunks
        self._restoring[request_id] = job
        return True

    def _finish_restore(self, request_id: str) -> None:
        """The request's restore (waited for if need be): the blocks that arrived intact are
        registered in the prefix cache; the job's blocks and those it held go back."""
        job = self._restoring.pop(request_id)
        good = self.offload.finish_restore(job)
        for (h, *_), b, toks in zip(job.copied[:good], job.block_ids, job.chunks):
            self.pool.cache(b, h, toks)
            self.offload.seen(h)
        self.pool.free(job.block_ids)
        self.pool.free(job.held)

    def restores_in_flight(self) -> bool:
        """Whether a restore's copies are still running (one that is done waits for its
        request to ask again: it is no work for the engine loop)."""
        return any(not job.done() for job in self._restoring.values())

    def wait_restore(self) -> None:
        """Block until the oldest restore in flight is done (a step with nothing else to do)."""
        for job in self._restoring.values():
            if not job.done():
                job.wait()
                return

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
            if self.offload is not None:
                self.offload.seen(hashes[i])
        req.num_cached_blocks = full

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks
