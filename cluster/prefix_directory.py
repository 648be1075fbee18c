"""The prefix directory in Redis: which worker holds which KV blocks (by block hash).

Layout in Redis::

    pdserve:blocks:<worker_id>     set     block hashes (decimal) cached on that worker
    pdserve:blockseq:<worker_id>   string  sequence number of the last batch applied
    pdserve:tierblocks:<tier>:<worker_id>, pdserve:tierblockseq:<tier>:<worker_id>
                                           the same for the worker's KV offload tiers
                                           (engine.kv_offload: tier "host" or "disk")

Both keys carry the worker registration's TTL and are refreshed by every publish, so the entries
of a worker that dies disappear with its registration.

Workers publish what their block pool reports (engine.block_pool events: stored / evicted) in
batches. Each batch carries the next sequence number and is applied by a Lua script only if the
stored number is exactly one less; otherwise (a batch was lost, Redis restarted or the keys
expired) the script refuses it and the worker resyncs: it replaces the set with its full list and
restarts the sequence. The publisher never blocks the worker: Redis being down is logged once and
the next successful publish resyncs.

The gateway asks, for one prompt's block hashes, how long a leading run each worker holds
(SMISMEMBER, one pipelined round trip for all workers), in its pool and then in its tiers
(`tiered_prefix_blocks`). Torch-free.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Iterable

import redis.asyncio as aioredis

from engine.block_hash import STORED
from cluster.registry import RedisPeriodic, RedisSettings

log = logging.getLogger(__name__)

BLOCKS_PREFIX = "pdserve:blocks:"
SEQ_PREFIX = "pdserve:blockseq:"
TIER_BLOCKS_PREFIX = "pdserve:tierblocks:"
TIER_SEQ_PREFIX = "pdserve:tierblockseq:"
TIERS = ("host", "disk")          # engine.kv_offload's tiers, dearest to restore last

# KEYS: set, seq. ARGV: seq, ttl_ms, number of stored hashes, stored..., evicted...
_APPLY = """
local cur = redis.call('GET', KEYS[2])
if (not cur) or (tonumber(cur) + 1 ~= tonumber(ARGV[1])) then return 0 end
local n = tonumber(ARGV[3])
for i = 4, 3 + n do redis.call('SADD', KEYS[1], ARGV[i]) end
for i = 4 + n, #ARGV do redis.call('SREM', KEYS[1], ARGV[i]) end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""


def blocks_key(worker_id: str, tier: str = "") -> str:
    return f"{TIER_BLOCKS_PREFIX}{tier}:{worker_id}" if tier else BLOCKS_PREFIX + worker_id


def seq_key(worker_id: str, tier: str = "") -> str:
    return f"{TIER_SEQ_PREFIX}{tier}:{worker_id}" if tier else SEQ_PREFIX + worker_id


class DirectoryPublisher(RedisPeriodic):
    """Mirrors one worker's cached block hashes into Redis (`tier`: those of one of its KV
    offload tiers; "": its pool's).

    `events` is the block pool's event deque (appended by the engine thread, drained here).
    Call `start()` in the worker's loop and `stop()` at shutdown (which removes this worker's
    entries); `publish()` runs one round (tests call it directly).
    """

    what = "prefix directory"

    def __init__(self, redis_url: str, worker_id: str, events: deque, ttl_s: float = 10.0,
                 interval_s: float = 0.25, chunk: int = 4096,
                 redis_settings: RedisSettings = RedisSettings(), tier: str = "") -> None:
        super().__init__(redis_url, interval_s, redis_settings)
        self.worker_id = worker_id
        self.tier = tier
        self._keys = [blocks_key(worker_id, tier), seq_key(worker_id, tier)]
        if tier:
            self.what = f"prefix directory ({tier} tier)"
        self.events = events
        self.ttl_ms = int(ttl_s * 1000)
        self.refresh_s = ttl_s / 4
        self.chunk = chunk
        self.mirror: set[int] = set()        # every hash stored and not evicted, as drained
        self.seq = 0
        self.resyncs = 0
        self._need_resync = True
        self._last_write = 0.0
        self._apply = self._client.register_script(_APPLY)

    def own_keys(self) -> list[str]:
        return list(self._keys)

    def _drain(self) -> tuple[list[int], list[int]]:
        """Fold the pending events into the mirror; the net additions and removals."""
        added: set[int] = set()
        removed: set[int] = set()
        while self.events:
            kind, h = self.events.popleft()
            if kind == STORED:
                self.mirror.add(h)
                added.add(h)
                removed.discard(h)
            else:
                self.mirror.discard(h)
                removed.add(h)
                added.discard(h)
        return sorted(added), sorted(removed)

    async def publish(self) -> None:
        """Send the pending changes (or refresh the TTL when due); resync on a gap."""
        added, removed = self._drain()
        due = time.monotonic() - self._last_write >= self.refresh_s
        if not (added or removed or due or self._need_resync):
            return
        try:
            if not self._need_resync:
                ok = await self._apply(keys=list(self._keys),
                                       args=[self.seq + 1, self.ttl_ms, len(added), *added,
                                             *removed])
                if ok:
                    self.seq += 1
                else:
                    log.info("prefix directory: sequence gap for %s at %d; resyncing %d blocks",
                             self.worker_id, self.seq + 1, len(self.mirror))
                    self._need_resync = True
            if self._need_resync:
                await self._resync()
            self._last_write = time.monotonic()
        except (aioredis.RedisError, OSError):
            self._need_resync = True         # some changes may be lost: resync when back
            raise

    async def _resync(self) -> None:
        hashes = sorted(self.mirror)
        self.seq += 1
        async with self._client.pipeline(transaction=True) as pipe:
            blocks, seq = self._keys
            pipe.delete(blocks)
            for i in range(0, len(hashes), self.chunk):
                pipe.sadd(blocks, *hashes[i:i + self.chunk])
            pipe.pexpire(blocks, self.ttl_ms)
            pipe.set(seq, self.seq, px=self.ttl_ms)
            await pipe.execute()
        self._need_resync = False
        self.resyncs += 1

    tick = publish


async def tiered_prefix_blocks(client: aioredis.Redis, worker_ids: Iterable[str],
                               hashes: list[int]) -> dict[str, dict[str, int]]:
    """worker id -> {"pool": n, "host": n, "disk": n}: the leading run of `hashes` the
    directory lists for that worker, each block counted where it is cheapest to get (the pool,
    then the host tier, then the disk tier). One pipelined round trip."""
    ids = list(worker_ids)
    places = ("pool", *TIERS)
    if not hashes or not ids:
        return {w: dict.fromkeys(places, 0) for w in ids}
    async with client.pipeline(transaction=False) as pipe:
        for w in ids:
            for tier in ("", *TIERS):
                pipe.smismember(blocks_key(w, tier), hashes)
        results = await pipe.execute()
    out = {}
    for i, w in enumerate(ids):
        flags = results[i * len(places):(i + 1) * len(places)]
        counts = dict.fromkeys(places, 0)
        for j in range(len(hashes)):
            where = next((p for p, f in zip(places, flags) if f[j]), None)
            if where is None:
                break
            counts[where] += 1
        out[w] = counts
    return out


async def directory_sizes(client: aioredis.Redis, worker_ids: Iterable[str]) -> dict[str, int]:
    ids = list(worker_ids)
    async with client.pipeline(transaction=False) as pipe:
        for w in ids:
            pipe.scard(blocks_key(w))
        return dict(zip(ids, await pipe.execute()))


__all__ = ("DirectoryPublisher", "tiered_prefix_blocks",
           "directory_sizes", "blocks_key", "seq_key", "TIERS")
