"""The Redis prefix directory with a real redis-server: publishing, sequence gaps and resync,
expiry, and the gateway's prefix-aware choice of workers."""

from __future__ import annotations

import asyncio
import time
from collections import deque

import redis.asyncio as aioredis

from engine.block_hash import EVICTED, STORED, BlockHasher
from gateway.router import Router
from cluster.prefix_directory import (DirectoryPublisher, blocks_key, seq_key,
                                      tiered_prefix_blocks)
from tests.test_gateway_router import register, worker
from tests.waiting import wait_until_async


async def members(url: str, worker_id: str) -> set[int]:
    client = aioredis.from_url(url)
    try:
        return {int(x) for x in await client.smembers(blocks_key(worker_id))}
    finally:
        await client.aclose()


def test_entries_appear_and_disappear(redis_url):
    async def body():
        events: deque = deque()
        pub = DirectoryPublisher(redis_url, "p1", events, ttl_s=10)
        events.extend([(STORED, 1), (STORED, 2), (STORED, 3)])
        await pub.publish()                                   # first publish: a full resync
        first = await members(redis_url, "p1")
        events.extend([(EVICTED, 2), (STORED, 4), (STORED, 5), (EVICTED, 5)])
        await pub.publish()
        second = await members(redis_url, "p1")
        await pub.stop()                                      # clean shutdown removes them
        return first, second, await members(redis_url, "p1"), pub.seq

    first, second, after_stop, seq = asyncio.run(body())
    assert first == {1, 2, 3}
    assert second == {1, 3, 4}
    assert after_stop == set() and seq == 2


def test_a_sequence_gap_makes_the_worker_resync(redis_url):
    async def body():
        events: deque = deque([(STORED, 10), (STORED, 11)])
        pub = DirectoryPublisher(redis_url, "d1", events, ttl_s=10)
        await pub.publish()
        client = aioredis.from_url(redis_url)
        await client.srem(blocks_key("d1"), 11)               # an update got lost ...
        await client.set(seq_key("d1"), 0)                    # ... and the numbers show a gap
        events.append((STORED, 12))
        await pub.publish()
        after_gap = await members(redis_url, "d1")
        await client.flushall()                               # redis restarted empty
        events.append((STORED, 13))
        await pub.publish()
        after_restart = await members(redis_url, "d1")
        await client.aclose()
        await pub.stop()
        return after_gap, after_restart, pub.resyncs

    after_gap, after_restart, resyncs = asyncio.run(body())
    assert after_gap == {10, 11, 12}
    assert after_restart == {10, 11, 12, 13}
    assert resyncs == 3


def test_entries_of_a_silent_worker_expire(redis_url):
    async def body():
        pub = DirectoryPublisher(redis_url, "p9", deque([(STORED, 7)]), ttl_s=0.3)
        await pub.publish()
        present = await members(redis_url, "p9")

        async def expired() -> bool:                           # no refresh: the TTL lapses
            return not await members(redis_url, "p9")
        await wait_until_async(expired, 10, "the entries' TTL to lapse", interval_s=0.05)
        gone = await members(redis_url, "p9")
        pub._task = None
        await pub._client.aclose()
        return present, gone

    present, gone = asyncio.run(body())
    assert present == {7} and gone == set()


def test_lookup_counts_leading_blocks_only_pool_then_tiers(redis_url):
    async def body():
        client = aioredis.from_url(redis_url)
        await client.sadd(blocks_key("a"), 1, 2, 3)
        await client.sadd(blocks_key("b"), 1, 3)
        await client.sadd(blocks_key("d", "host"), 1, 3)        # pool, host, disk, gap
        await client.sadd(blocks_key("d"), 2)
        await client.sadd(blocks_key("d", "disk"), 3, 4, 6)
        got = await tiered_prefix_blocks(client, ["a", "b", "c", "d"], [1, 2, 3, 4, 5, 6])
        await client.aclose()
        return got

    z = {"pool": 0, "host": 0, "disk": 0}
    assert asyncio.run(body()) == {"a": dict(z, pool=3), "b": dict(z, pool=1), "c": z,
                                   "d": {"pool": 1, "host": 2, "disk": 1}}


PROMPT = list(range(100, 164))                                  # 4 blocks of 16


async def _two_prefill_workers(url: str, router: Router) -> list[int]:
    """d1, p1, p2 registered and the router started; -> PROMPT's block hashes."""
    await register(url, worker("d1", "decode", 1.0), worker("p1", "prefill", 2.0),
                   worker("p2", "prefill", 3.0))
    await router.start()
    return BlockHasher(16, 0).hashes(PROMPT)


def test_routing_picks_the_worker_with_the_prefix_and_weighs_load(redis_url):
    prompt = PROMPT

    async def body(router: Router):
        hashes = await _two_prefill_workers(redis_url, router)
        client = aioredis.from_url(redis_url)
        await client.sadd(blocks_key("p2"), *hashes[:3])
        hit = await router.route(prompt)
        other = await router.route([1] * 64)                    # nothing cached: by load
        p2 = next(w for w in router.workers("prefill") if w.id == "p2")
        ticket = router.enqueue_prefill(p2, 200)                # p2 is busy: 16 + 200 > 64
        busy = await router.route(prompt)
        ticket.release()
        ticket.release()                                        # idempotent
        assert router.queued_tokens("p2") == 0 == router.queued_prompts("p2")
        await client.aclose()
        return hit, other, busy

    hit, other, busy = asyncio.run(_run(Router(redis_url, poll_s=0.05), body))
    assert (hit.prefill.id, hit.reason, hit.cached_tokens) == ("p2", "cached_prefix", 48)
    assert other.reason == "load" and other.cached_tokens == 0
    assert (busy.prefill.id, busy.reason) == ("p1", "load")


def test_routing_without_redis_falls_back_to_load(private_redis):
    url = private_redis.url

    async def body(router: Router):
        await register(url, worker("d1", "decode", 1.0), worker("p1", "prefill", 2.0))
        await router.start()
        private_redis.stop()
        t0 = time.monotonic()
        routes = [await router.route(list(range(64))) for _ in range(5)]
        return routes, time.monotonic() - t0

    routes, took = asyncio.run(_run(Router(url, poll_s=0.05), body))
    assert [r.reason for r in routes] == ["no_directory"] * 5
    assert {r.prefill.id for r in routes} == {"p1"} and took < 2.0


async def _run(router: Router, body):
    try:
        return await body(router)
    finally:
        await router.stop()


def test_tier_publishers_keep_their_own_sets_and_routing_weighs_the_tiers(redis_url):
    prompt = PROMPT

    async def body(router: Router):
        hashes = await _two_prefill_workers(redis_url, router)
        host = DirectoryPublisher(redis_url, "p1", deque((STORED, h) for h in hashes[:3]),
                                  ttl_s=10, tier="host")
        await host.publish()
        client = aioredis.from_url(redis_url)
        assert not await client.exists(blocks_key("p1"))        # the pool's set is apart
        in_host = await router.route(prompt)                    # p1's host tier beats nothing
        await client.sadd(blocks_key("p2"), *hashes[:3])
        in_pool = await router.route(prompt)                    # a pool hit beats a host hit
        host.events.append((EVICTED, hashes[0]))
        await host.publish()
        await client.srem(blocks_key("p2"), *hashes[:3])
        gone = await router.route(prompt)                       # the run starts at block 0
        await host.stop()
        await client.aclose()
        return in_host, in_pool, gone

    in_host, in_pool, gone = asyncio.run(_run(Router(redis_url, poll_s=0.05), body))
    assert (in_host.prefill.id, in_host.reason, in_host.cached_tokens) == ("p1", "cached_prefix",
                                                                          48)
    assert (in_pool.prefill.id, in_pool.cached_tokens) == ("p2", 48)
    assert gone.reason == "load" and gone.cached_tokens == 0
