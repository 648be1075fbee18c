"""Worker discovery with a real redis-server: layout refusal, least-loaded choice, Redis loss."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest
import redis.asyncio as aioredis

from gateway.errors import GatewayError
from gateway.router import Router
from cluster.registry import KEY_PREFIX, WorkerInfo

BASE = WorkerInfo(id="w", role="decode", address="127.0.0.1:1", model="m", block_size=16,
                  hash_seed=0, dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8,
                  total_blocks=100)


def worker(id: str, role: str, started_at: float, **layout) -> WorkerInfo:
    port = 40000 + sum(map(ord, id))
    return dataclasses.replace(BASE, id=id, role=role, address=f"127.0.0.1:{port}",
                               started_at=started_at, **layout)


async def register(url: str, *workers: WorkerInfo) -> None:
    client = aioredis.from_url(url)
    for w in workers:
        await client.hset(KEY_PREFIX + w.id, mapping=w.to_redis())
    await client.aclose()


async def _with_router(url: str, body):
    router = Router(url, poll_s=0.05)
    try:
        return await body(router)
    finally:
        await router.stop()


def test_refuses_workers_with_another_layout(redis_url, caplog):
    async def body(router):
        await register(redis_url, worker("d1", "decode", 1.0), worker("p1", "prefill", 2.0),
                       worker("p2", "prefill", 3.0, block_size=32),
                       worker("d2", "decode", 4.0, dtype="bfloat16"))
        with caplog.at_level(logging.WARNING, logger="gateway.router"):
            await router.refresh()
            await router.refresh()
        return router

    router = asyncio.run(_with_router(redis_url, body))
    assert [w.id for w in router.workers("decode")] == ["d1"]
    assert [w.id for w in router.workers("prefill")] == ["p1"]
    assert [w.id for w in router.refused()] == ["d2", "p2"]
    assert router.counts() == {"prefill": 1, "decode": 1, "refused": 2}
    refusals = [r.getMessage() for r in caplog.records if "refusing worker" in r.getMessage()]
    assert len(refusals) == 2  # once per worker, not once per poll
    assert any("p2" in m and "32" in m for m in refusals)


def test_picks_least_loaded_then_round_robin(redis_url):
    async def body(router):
        await register(redis_url, worker("d1", "decode", 1.0), worker("d2", "decode", 2.0),
                       worker("p1", "prefill", 3.0))
        await router.start()
        first = [router.pick("decode").id for _ in range(4)]
        p, d = await router.pick_pair()
        with router.track(p, d):
            busy = d.id
            assert router.in_flight(busy) == 1
            during = {router.pick("decode").id for _ in range(3)}
        return first, busy, during, router.in_flight(busy)

    first, busy, during, after = asyncio.run(_with_router(redis_url, body))
    assert first == ["d1", "d2", "d1", "d2"]
    assert during == {"d1", "d2"} - {busy}
    assert after == 0


def test_no_worker_is_a_clear_503(redis_url):
    async def body(router):
        await register(redis_url, worker("p1", "prefill", 1.0))
        with pytest.raises(GatewayError) as info:
            await router.pick_pair()  # reads redis itself: nothing was polled before
        assert router.counts()["prefill"] == 1
        return info.value

    err = asyncio.run(_with_router(redis_url, body))
    assert err.status == 503 and "no decode worker is available" in err.message


def test_keeps_last_known_workers_when_redis_goes_away(private_redis, caplog):
    async def body(router):
        await register(private_redis.url, worker("d1", "decode", 1.0),
                       worker("p1", "prefill", 2.0))
        await router.refresh()
        private_redis.stop()
        with caplog.at_level(logging.WARNING, logger="gateway.router"):
            for _ in range(4):                  # the discovery loop's polls, one by one
                await router.refresh()
        return router.counts()

    counts = asyncio.run(_with_router(private_redis.url, body))
    assert counts == {"prefill": 1, "decode": 1, "refused": 0}
    warnings = [r for r in caplog.records if "cannot read workers" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize("outage", ["seen", "between_polls"])
def test_workers_known_before_a_redis_restart_stay_while_they_register_again(
        private_redis, outage, caplog):
    """Redis restarts empty; the workers register again one by one within a heartbeat. One that
    has not yet is still routed to, whether the gateway saw Redis down or the restart fell
    between two polls; once the grace ends the registry's list is the truth again."""
    d1, p1, p2 = worker("d1", "decode", 1.0), worker("p1", "prefill", 2.0), \
        worker("p2", "prefill", 3.0)

    async def body(router):
        router.rejoin_grace_s = 1.0
        await register(private_redis.url, d1, p1, p2)
        await router.refresh()
        caplog.set_level(logging.WARNING, logger="gateway.router")
        if outage == "seen":
            private_redis.stop()
            await router.refresh()
            private_redis.start()
        else:
            private_redis.flush()
            await router.refresh()              # empty: held, the grace starts
        await register(private_redis.url, p1)   # one worker is back, d1 and p2 not yet
        await router.refresh()
        during = router.counts(), router.pick("decode").id
        await asyncio.sleep(1.1)
        await router.refresh()
        return during, router.counts()

    (during, picked), after = asyncio.run(_with_router(private_redis.url, body))
    assert during == {"prefill": 2, "decode": 1, "refused": 0} and picked == "d1"
    assert after == {"prefill": 1, "decode": 0, "refused": 0}
    assert any("keeping the last known workers" in r.getMessage() for r in caplog.records)


def test_avoids_unreachable_workers_while_others_exist(redis_url):
    async def body(router):
        await register(redis_url, worker("d1", "decode", 1.0), worker("d2", "decode", 2.0))
        await router.refresh()
        d1, d2 = router.workers("decode")
        router.mark_unreachable(d1)
        only_d2 = {router.pick("decode").id for _ in range(4)}
        router.mark_unreachable(d2)
        both = {router.pick("decode").id for _ in range(4)}
        return only_d2, both

    only_d2, both = asyncio.run(_with_router(redis_url, body))
    assert only_d2 == {"d2"}
    assert both == {"d1", "d2"}  # all avoided: fall back to every registered worker


def test_prefill_queue_counts_survive_prompts_with_nothing_to_compute():
    """Fully cached prompts queue 0 tokens; releasing tickets in any order never fails and the
    counts return to 0 (a KeyError here once broke streams under load)."""
    router = Router("redis://127.0.0.1:1/0")
    p = worker("p1", "prefill", 1.0)
    a, b, c = (router.enqueue_prefill(p, n) for n in (0, 0, 5))
    assert (router.queued_tokens("p1"), router.queued_prompts("p1")) == (5, 3)
    c.release()
    assert (router.queued_tokens("p1"), router.queued_prompts("p1")) == (0, 2)
    a.release()
    b.release()
    assert (router.queued_tokens("p1"), router.queued_prompts("p1")) == (0, 0)


def test_conditional_disaggregation_balances_prompts_between_the_roles():
    # the balance rule on the router's queue counts: a burst of 256-token prompts with the
    # defaults (queue 4, share 0.75) sends three in seven to the decode worker, none while the
    # prefill worker has fewer than 4 outstanding, none over the size limit or when turned off
    from types import SimpleNamespace
    from gateway.pipeline import Pipeline, PipelineConfig

    async def body():
        router = Router("redis://127.0.0.1:1", poll_s=0.05)
        p, d = worker("p", "prefill", 1.0), worker("d", "decode", 2.0)

        def local(cfg, n=256):
            return Pipeline._prefill_locally(SimpleNamespace(config=cfg, router=router), p, d, n)

        cfg, places = PipelineConfig(), []
        for _ in range(70):
            here = local(cfg)
            router.enqueue_prefill(d if here else p, 256)
            places.append("d" if here else "p")
        assert places[:4] == ["p"] * 4 and places.count("d") == 30
        assert not local(cfg, n=cfg.local_prefill_max_tokens + 1) and not local(cfg, n=0)
        assert not local(PipelineConfig(local_prefill_max_tokens=0))
        assert local(PipelineConfig(local_prefill_queue=0))     # every prompt up to the size
        assert not local(PipelineConfig(local_prefill_share=0))
        await router.stop()

    asyncio.run(body())
