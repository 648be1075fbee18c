"""Worker discovery and choice.

A background task polls the Redis registry (pdserve.registry.list_workers) every `poll_s`. If
Redis is unreachable the last known list stays in use (logged once, and once when it is back).

Layout check: every worker of a deployment must share `WorkerInfo.layout_key()` (model, block
size, hash seed, dtype, KV shape) for KV to move between them. The reference is the live worker
that registered first (smallest started_at, then id), so every gateway replica agrees on it
without coordination; workers that differ are refused with a warning naming both layouts.

Choice: per role, the worker with the fewest requests in flight from this gateway; ties are
broken round-robin; a worker found unreachable is avoided for a few seconds while others exist.
One grpc.aio channel is kept per worker address.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Iterator

import grpc
import redis.asyncio as aioredis

from gateway.errors import GatewayError
from pdserve.registry import ROLES, WorkerInfo, list_workers

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


def split_by_layout(workers: list[WorkerInfo]) -> tuple[list[WorkerInfo], list[WorkerInfo]]:
    """(accepted, refused): accepted share the layout of the earliest registered worker."""
    if not workers:
        return [], []
    reference = min(workers, key=lambda w: (w.started_at, w.id)).layout_key()
    accepted = [w for w in workers if w.layout_key() == reference]
    refused = [w for w in workers if w.layout_key() != reference]
    return accepted, refused


class Router:
    """Knows the live workers, picks a (prefill, decode) pair per request, owns the channels.

    Use: `await start()` in the serving loop, `pick_pair()` + `track()` per request,
    `await stop()` at shutdown. `refresh()` runs one poll (tests call it directly).
    """

    def __init__(self, redis_url: str, poll_s: float = 0.5) -> None:
        self.redis_url = redis_url
        self.poll_s = poll_s
        self._redis = aioredis.from_url(redis_url, socket_timeout=2.0,
                                        socket_connect_timeout=2.0)
        self._workers: dict[str, list[WorkerInfo]] = {role: [] for role in ROLES}
        self._refused: dict[str, WorkerInfo] = {}
        self._warned: set[tuple] = set()
        self._in_flight: dict[str, int] = {}       # worker id -> requests in flight
        self._busy_addresses: dict[str, int] = {}  # address -> requests in flight
        self._turn: dict[str, int] = {role: 0 for role in ROLES}
        self._avoid_until: dict[str, float] = {}   # worker id -> monotonic time
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._redis_down = False
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------ discovery
    async def refresh(self) -> None:
        """One poll of the registry. Keeps the previous list when Redis cannot be read."""
        try:
            workers = await list_workers(self._redis)
        except (aioredis.RedisError, OSError) as exc:
            if not self._redis_down:
                log.warning("cannot read workers from redis at %s (%s); keeping the last known "
                            "list of %d workers", self.redis_url, exc, self.num_workers())
            self._redis_down = True
            return
        if self._redis_down:
            log.info("redis at %s is reachable again", self.redis_url)
        self._redis_down = False
        self._apply(workers)
        await self._close_unused_channels()

    def _apply(self, workers: list[WorkerInfo]) -> None:
        accepted, refused = split_by_layout(workers)
        for w in refused:
            key = (w.id, w.layout_key())
            if key not in self._warned:
                self._warned.add(key)
                log.warning("refusing worker %s (%s at %s): its KV layout %s differs from the "
                            "deployment's %s; restart it with the same model, block size, hash "
                            "seed and dtype", w.id, w.role, w.address, w.layout_key(),
                            accepted[0].layout_key())
        self._refused = {w.id: w for w in refused}
        live = {w.id for w in workers}
        self._avoid_until = {k: v for k, v in self._avoid_until.items() if k in live}
        before = {w.id for ws in self._workers.values() for w in ws}
        for role in ROLES:
            self._workers[role] = [w for w in accepted if w.role == role]
        now = {w.id: w for w in accepted}
        for wid in sorted(now.keys() - before):
            log.info("worker %s joined (%s at %s)", wid, now[wid].role, now[wid].address)
        for wid in sorted(before - now.keys()):
            log.info("worker %s left (its registration expired or was removed)", wid)

    async def _loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # never let discovery die; the next poll tries again
                log.exception("worker discovery poll failed")
            await asyncio.sleep(self.poll_s)

    async def start(self) -> None:
        """First poll now (so a request right after startup sees workers), then in background."""
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        await self._redis.aclose()

    # ------------------------------------------------------------------ state
    def workers(self, role: str) -> list[WorkerInfo]:
        return list(self._workers[role])

    def refused(self) -> list[WorkerInfo]:
        return sorted(self._refused.values(), key=lambda w: w.id)

    def num_workers(self) -> int:
        return sum(len(ws) for ws in self._workers.values())

    def counts(self) -> dict[str, int]:
        out = {role: len(ws) for role, ws in self._workers.items()}
        out["refused"] = len(self._refused)
        return out

    def in_flight(self, worker_id: str) -> int:
        return self._in_flight.get(worker_id, 0)

    # ------------------------------------------------------------------ choice
    def pick(self, role: str) -> WorkerInfo:
        """The least loaded worker of `role`; GatewayError(503) when none is registered."""
        workers = self._workers[role]
        if not workers:
            raise GatewayError(f"no {role} worker registered (redis: {self.redis_url})",
                               status=503, code="no_worker")
        now = time.monotonic()
        workers = [w for w in workers if self._avoid_until.get(w.id, 0.0) <= now] or workers
        least = min(self.in_flight(w.id) for w in workers)
        tied = [w for w in workers if self.in_flight(w.id) == least]
        turn = self._turn[role]
        self._turn[role] = turn + 1
        return tied[turn % len(tied)]

    def mark_unreachable(self, worker: WorkerInfo, avoid_s: float = 5.0) -> None:
        """Prefer other workers of the role for `avoid_s` (a dead worker stays registered until
        its TTL runs out)."""
        self._avoid_until[worker.id] = time.monotonic() + avoid_s
        log.warning("worker %s at %s is unreachable; avoiding it for %.0f s", worker.id,
                    worker.address, avoid_s)

    async def pick_pair(self) -> tuple[WorkerInfo, WorkerInfo]:
        """(prefill, decode). When a role has no known worker, Redis is read once more first
        (a worker may have registered since the last poll). Decode is checked first."""
        if not all(self._workers.values()):
            await self.refresh()
        decode = self.pick("decode")
        return self.pick("prefill"), decode

    @contextlib.contextmanager
    def track(self, *workers: WorkerInfo) -> Iterator[None]:
        """Count a request as in flight on these workers while the block runs."""
        counted = [(self._in_flight, w.id) for w in workers]
        counted += [(self._busy_addresses, w.address) for w in workers]
        for table, key in counted:
            table[key] = table.get(key, 0) + 1
        try:
            yield
        finally:
            for table, key in counted:
                table[key] -= 1
                if not table[key]:
                    del table[key]

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = ch
        return ch

    async def _close_unused_channels(self) -> None:
        live = {w.address for ws in self._workers.values() for w in ws}
        unused = [a for a in self._channels if a not in live and a not in self._busy_addresses]
        for address in unused:
            await self._channels.pop(address).close()
