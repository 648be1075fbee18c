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

KV groups (engine.kv_groups): a request has a table per group. A sliding group's table releases
the blocks wholly before the window of the next query (`allocate_slots(..., start=)`): their
entries become NULL_BLOCK, a leading run the manager counts per group (`released`). The prefix
cache keys each group's blocks apart (group 0 under the block's hash, the Redis directory's; the
others under a hash derived from it), and a cached prefix of k blocks is used only when every
full group holds its k blocks and every sliding group the blocks the window of position
k * block_size reads. A KV transfer lists, block index by block index, each group's entry the
receiver needs (`transfer_entries`).

Engine thread only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_hash import BlockHasher, salt_bytes
from engine.block_pool import BlockPool
from engine.kv_groups import NULL_BLOCK, KVGroups, dense
from engine.request import Request


@dataclass
class _Tables:
    """A request's tables: one per KV group, of equal length (block index i of each covers the
    same tokens); the first released[g] entries of group g are NULL_BLOCK (held by no one)."""

    blocks: list[list[int]]
    released: list[int]

    def __len__(self) -> int:
        """Block indices covered (a cached prefix's length in blocks)."""
        return len(self.blocks[0])

    def live(self, g: int) -> list[int]:
        return self.blocks[g][self.released[g]:]

    def shared(self, num_blocks: int) -> "_Tables":
        """The first num_blocks entries of each group (entries only: references not taken)."""
        return _Tables([t[:num_blocks] for t in self.blocks],
                       [min(r, num_blocks) for r in self.released])


def group_hash(block_hash: int, group: int) -> int:
    """A block's prefix-cache key in its group (group 0: the block hash itself)."""
    return block_hash if group == 0 else hash((block_hash, group))


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

    def __init__(self, pool: BlockPool, block_size: int, hasher: BlockHasher | None = None,
                 groups: KVGroups | None = None) -> None:
        if hasher is not None and hasher.block_size != block_size:
            raise ValueError("the block hasher's block size differs from the pool's")
        self.pool = pool
        self.block_size = block_size
        self.hasher = hasher
        self.groups = groups or dense(0)
        self.num_groups = self.groups.num_groups
        self._tables: dict[str, _Tables] = {}
        # each table's id for as long as it lives (a table only grows under it, or releases
        # entries no kernel reads any more; a new table of the same request, after
        # preemption, gets a new one): attention backends keep tables on the device by it
        # (engine.attention.block_tables)
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
        """The request's table of group 0 (every layer's, for a model of one group)."""
        t = self._tables.get(request_id)
        return t.blocks[0] if t is not None else []

    def group_tables(self, request_id: str) -> list[list[int]]:
        """The request's table of each group (released entries NULL_BLOCK)."""
        t = self._tables.get(request_id)
        return t.blocks if t is not None else [[] for _ in range(self.num_groups)]

    def held_blocks(self, request_id: str) -> int:
        """Blocks the request's tables hold, over every group."""
        t = self._tables.get(request_id)
        return 0 if t is None else sum(len(t.live(g)) for g in range(self.num_groups))

    def table_id(self, request_id: str) -> int | None:
        """The id of the request's table (None: it has none)."""
        return self._table_ids.get(request_id)

    def _new_table(self, request_id: str, tables: _Tables | None = None) -> _Tables:
        if tables is None:
            tables = _Tables([[] for _ in range(self.num_groups)], [0] * self.num_groups)
        self._tables[request_id] = tables
        self._table_ids[request_id] = self._next_table_id
        self._next_table_id += 1
        return tables

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        extra = self.blocks_needed(num_tokens) - len(self.block_table(request_id))
        return extra * self.num_groups <= self.pool.num_free

    def _release(self, t: _Tables, start: int, taken: bool = True) -> None:
        """Sliding groups: the entries no query at `start` or later reads go back (`taken`:
        the table holds references to them)."""
        for g, w in enumerate(self.groups.windows):
            if not w:
                continue
            first = min(self.groups.first_needed(g, start, self.block_size), len(t.blocks[g]))
            if first > t.released[g]:
                table = t.blocks[g]
                gone = table[t.released[g]:first]
                table[t.released[g]:first] = [NULL_BLOCK] * len(gone)
                t.released[g] = first
                if taken:
                    self.pool.free(gone)

    def allocate_slots(self, request_id: str, num_tokens: int,
                       prefix: "_Tables | None" = None,
                       start: int | None = None) -> list[int] | None:
        """Grow the request's tables to hold num_tokens tokens, starting new tables with the
        cached `prefix` (cached_prefix's tables). `start`: the position of the first query
        still to run (the tokens before it are computed, or arrive by a transfer): a sliding
        group releases what no query from there reads, and allocates nothing for it. Returns
        the new blocks, or None (and allocates nothing) when the pool cannot supply them."""
        t = self._tables.get(request_id)
        fresh = t is None
        if fresh:
            t = self._new_table(request_id)
        if prefix and (not fresh and t.blocks[0]):
            raise RuntimeError(f"request {request_id}: a cached prefix for a non-empty table")
        if prefix:
            t.blocks = [list(b) for b in prefix.blocks]
            t.released = list(prefix.released)
        if start is not None:
            self._release(t, start, taken=not prefix)   # a prefix's blocks: not taken yet
        need = self.blocks_needed(num_tokens)
        counts = []
        for g in range(self.num_groups):
            have = len(t.blocks[g])
            first = self.groups.first_needed(g, start, self.block_size) if start is not None else 0
            counts.append((max(need - have, 0), max(need - max(have, first), 0)))
        held = [b for g in range(self.num_groups) for b in t.live(g)] if prefix else []
        idle = sum(1 for b in held if self.pool.ref_count(b) == 0)   # taken off the free queue
        if sum(real for _, real in counts) + idle > self.pool.num_free:
            if fresh:
                del self._tables[request_id], self._table_ids[request_id]
            elif prefix:                     # an empty table stays empty
                t.blocks = [[] for _ in range(self.num_groups)]
                t.released = [0] * self.num_groups
            return None
        self.pool.take(held)
        new: list[int] = []
        for g, (extra, real) in enumerate(counts):
            if not extra:
                continue
            got = self.pool.allocate(real) if real else []
            if extra > real:                 # entries before the window: never held
                assert t.released[g] == len(t.blocks[g]), "released entries lead the table"
                t.released[g] += extra - real
                t.blocks[g].extend([NULL_BLOCK] * (extra - real))
            t.blocks[g].extend(got)
            new += got
        return new

    def fork(self, parent_id: str, child_id: str, num_shared: int
             ) -> list[tuple[int, int]] | None:
        """Tables for `child_id`: the parent's first `num_shared` entries of each group (shared:
        one more reference each) and a new block per group for the parent's next one, to be
        filled by copying it. Returns the (parent's block, new block) pairs to copy, each block
        with one more reference held for the copy (`take_copies` hands the pairs out,
        `copies_done` gives the references back: until then no such block can go to anyone
        else, whatever happens to the two requests), or None (nothing changed) when the
        blocks are not free."""
        parent = self._tables[parent_id]
        if child_id in self._tables:
            raise RuntimeError(f"request {child_id} already has blocks")
        if self.pool.num_free < self.num_groups or len(parent) <= num_shared:
            return None
        if any(r > num_shared for r in parent.released):
            raise RuntimeError(f"request {parent_id}: block {num_shared} was released")
        child = parent.shared(num_shared)
        new = self.pool.allocate(self.num_groups)
        pairs = []
        for g in range(self.num_groups):
            self.pool.take(child.live(g))
            src = parent.blocks[g][num_shared]
            child.blocks[g].append(new[g])
            self.pool.take([src, new[g]])            # the copy's references
            pairs.append((src, new[g]))
        self._new_table(child_id, child)
        self._copies += pairs
        return pairs

    def share(self, parent_id: str, child_id: str, num_blocks: int) -> None:
        """Tables for `child_id` of the parent's first `num_blocks` entries of each group,
        shared (one more reference each): a fork at a block boundary, where nothing needs
        copying."""
        if child_id in self._tables:
            raise RuntimeError(f"request {child_id} already has blocks")
        child = self._tables[parent_id].shared(num_blocks)
        for g in range(self.num_groups):
            self.pool.take(child.live(g))
        self._new_table(child_id, child)

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
        t = self._tables.pop(request_id, None)
        self._table_ids.pop(request_id, None)
        if t is not None:
            for g in range(self.num_groups):
                self.pool.free(t.live(g))

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
        salt = salt_bytes(req.cache_salt)
        if req.long_rope:           # KV of LongRoPE's long factors: not the short ones' blocks
            salt += b"\x00long-rope"
        if req.lora is not None:    # an adapter's KV is its own (its name and weights' digest)
            salt += b"\x00" + req.lora.key
        return self.hasher.extend(req.block_hashes, req.all_token_ids, salt)

    def cached_prefix(self, req: Request, max_tokens: int) -> "_Tables | list | None":
        """Tables of the longest cached prefix of the request, covering at most max_tokens
        (its len() in blocks; references not taken): the pool's, then those restored from the
        offload tiers into new blocks (cached and free, like any evictable cached block, until
        the caller takes them). None while such a restore is in flight (on CUDA its copies run
        beside the steps): ask again later; the call after it is done finds the restored
        blocks in the pool (and starts no other)."""
        if self.hasher is None:
            return []
        if self.num_groups > 1 or self.groups.sliding:
            return self._grouped_prefix(req, max_tokens)
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
        return _Tables([out], [0]) if out else []

    def _grouped_prefix(self, req: Request, max_tokens: int) -> "_Tables | list":
        """cached_prefix over KV groups: the longest k where every full group holds blocks
        0..k-1 and every sliding group the blocks the window of position k * block_size reads
        (the entries before those are released ones)."""
        hashes = self.block_hashes(req)
        tokens = req.all_token_ids
        bs, groups = self.block_size, self.groups
        found: dict[tuple[int, int], int | None] = {}

        def lookup(g: int, i: int) -> int | None:
            if (g, i) not in found:
                found[g, i] = self.pool.lookup(group_hash(hashes[i], g),
                                               tokens[i * bs:(i + 1) * bs])
            return found[g, i]

        k = min(len(hashes), max_tokens // bs)
        for g, w in enumerate(groups.windows):      # full groups: their longest run
            if not w:
                k = next((i for i in range(k) if lookup(g, i) is None), k)
        while k > 0:
            # the highest missing index a sliding group needs for a prefix of k blocks
            miss = max((i for g, w in enumerate(groups.windows) if w
                        for i in range(groups.first_needed(g, k * bs, bs), k)
                        if lookup(g, i) is None), default=None)
            if miss is None:
                break
            k = miss                       # prefixes reaching past it need it too
        if k == 0:
            return []
        blocks, released = [], []
        for g, w in enumerate(groups.windows):
            first = groups.first_needed(g, k * bs, bs) if w else 0
            blocks.append([NULL_BLOCK] * first + [lookup(g, i) for i in range(first, k)])
            released.append(first)
        return _Tables(blocks, released)

    def transfer_entries(self, request_id: str, lo: int, hi: int, num_tokens: int
                         ) -> list[int]:
        """The blocks a KV transfer of a num_tokens-token prompt moves for block indices
        [lo, hi), in transfer order: index by index, each group's entry the receiver reads
        (sliding groups: only those the window of the last prompt position reads, which a
        forked choice computes again). Both ends list the same entries: the sender from its
        tables, the receiver from its reservation."""
        t = self._tables[request_id]
        firsts = self._transfer_firsts(num_tokens)
        return [t.blocks[g][i] for i in range(lo, hi) for g in range(self.num_groups)
                if i >= firsts[g]]

    def transfer_count(self, lo: int, hi: int, num_tokens: int) -> int:
        """len(transfer_entries(...)) for any request."""
        return sum(max(hi - max(lo, first), 0) for first in self._transfer_firsts(num_tokens))

    def _transfer_firsts(self, num_tokens: int) -> list[int]:
        return [self.groups.first_needed(g, max(num_tokens - 1, 0), self.block_size)
                for g in range(self.num_groups)]

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
        t = self._tables.get(req.request_id)
        if t is None:
            return
        full = min(req.num_computed_tokens // self.block_size, len(t))
        if full <= req.num_cached_blocks:
            return
        hashes = self.block_hashes(req)
        tokens = req.all_token_ids
        bs = self.block_size
        for i in range(req.num_cached_blocks, full):
            chunk = tokens[i * bs:(i + 1) * bs]
            for g in range(self.num_groups):
                if i >= t.released[g]:
                    self.pool.cache(t.blocks[g][i], group_hash(hashes[i], g), chunk,
                                    publish=g == 0)
            if self.offload is not None:
                self.offload.seen(hashes[i])
        req.num_cached_blocks = full

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks
