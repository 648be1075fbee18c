"""Worker registry in Redis: registration with a heartbeat TTL, discovery by the gateway.

Layout in Redis::

    pdserve:worker:<worker_id>   hash   id, role, address, model, block_size, hash_seed,
                                        dtype, num_layers, num_kv_heads, head_dim, total_blocks,
                                        running, waiting, free_blocks, started_at
                                 TTL    ttl_s, refreshed by every heartbeat

A worker whose process dies stops refreshing, and its key disappears after ttl_s seconds. The
gateway lists live workers with SCAN; it never needs a worker to say goodbye (it still does, on a
clean shutdown). Torch-free: the gateway imports this.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

KEY_PREFIX = "pdserve:worker:"
ROLES = ("prefill", "decode")


async def cancel_task(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait for it to end. The redis client can swallow a
    cancellation that lands while it handles a dropped connection, so cancel until it ends."""
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker tells the world about itself. Load fields are refreshed by each heartbeat."""

    id: str
    role: str
    address: str
    model: str
    block_size: int
    hash_seed: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    total_blocks: int
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    started_at: float = 0.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"worker role must be one of {ROLES}, got {self.role!r}")
        if ":" not in self.address:
            raise ValueError(f"worker address must be host:port, got {self.address!r}")

    def to_redis(self) -> dict[str, str]:
        return {k: str(v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_redis(cls, raw: dict) -> "WorkerInfo":
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        kw = {}
        for name, typ in fields.items():
            value = raw.get(name.encode(), raw.get(name))
            if value is None:
                continue
            if isinstance(value, bytes):
                value = value.decode()
            kw[name] = {"int": int, "float": float}.get(typ, str)(value)
        return cls(**kw)

    def layout_key(self) -> tuple:
        """Settings every worker of a deployment must share for KV to move between them."""
        return (self.model, self.block_size, self.hash_seed, self.dtype, self.num_layers,
                self.num_kv_heads, self.head_dim)


class RedisPeriodic:
    """A worker's background duty against Redis: `tick()` every interval_s from start() until
    stop(), which also deletes `own_keys()`. Redis being down is logged once (and once when it is
    back) and retried; it never stops the worker."""

    what = "redis"

    def __init__(self, redis_url: str, interval_s: float) -> None:
        self.redis_url = redis_url
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None
        self._client = aioredis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)

    async def tick(self) -> None:
        raise NotImplementedError

    def own_keys(self) -> list[str]:
        return []

    async def _loop(self) -> None:
        down = False
        while True:
            try:
                await self.tick()
                if down:
                    log.info("%s: redis at %s reachable again", self.what, self.redis_url)
                down = False
            except Exception as exc:  # redis down: keep serving, keep trying
                if not down:
                    log.warning("%s: cannot reach redis at %s (%s); retrying", self.what,
                                self.redis_url, exc)
                down = True
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        await cancel_task(self._task)
        try:
            if self.own_keys():
                await self._client.delete(*self.own_keys())
        except Exception:
            pass
        await self._client.aclose()


class WorkerRegistration(RedisPeriodic):
    """Keeps one worker's registration alive: call start(), then stop() on shutdown.

    `load` is a zero-argument callable returning (running, waiting, free_blocks); it is read at
    every heartbeat.
    """

    what = "worker registration"

    def __init__(self, redis_url: str, info: WorkerInfo, load=None, ttl_s: float = 10.0,
                 interval_s: float = 2.0) -> None:
        if interval_s >= ttl_s:
            raise ValueError("heartbeat interval must be shorter than the TTL")
        super().__init__(redis_url, interval_s)
        self.info = info
        self.load = load
        self.ttl_s = ttl_s

    @property
    def key(self) -> str:
        return KEY_PREFIX + self.info.id

    def own_keys(self) -> list[str]:
        return [self.key]

    async def beat(self) -> None:
        info = self.info
        if self.load is not None:
            running, waiting, free = self.load()
            info = dataclasses.replace(info, running=running, waiting=waiting, free_blocks=free)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.hset(self.key, mapping=info.to_redis())
            pipe.pexpire(self.key, int(self.ttl_s * 1000))
            await pipe.execute()

    tick = beat


async def list_workers(client: aioredis.Redis, role: str | None = None) -> list[WorkerInfo]:
    """All live workers (optionally of one role), sorted by id."""
    keys = [k async for k in client.scan_iter(match=KEY_PREFIX + "*", count=100)]
    if not keys:
        return []
    async with client.pipeline(transaction=False) as pipe:
        for k in keys:
            pipe.hgetall(k)
        raws = await pipe.execute()
    out = []
    for raw in raws:
        if not raw:
            continue
        try:
            w = WorkerInfo.from_redis(raw)
        except (TypeError, ValueError) as exc:
            log.warning("ignoring malformed worker entry: %s", exc)
            continue
        if role is None or w.role == role:
            out.append(w)
    return sorted(out, key=lambda w: w.id)
