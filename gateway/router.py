"""Worker discovery and choice.

A background task polls the Redis registry (cluster.registry.list_workers) every `poll_s`. If
Redis is unreachable the last known list stays in use (logged once, and once when it is back);
so it does for a few seconds when Redis suddenly lists no worker at all (a restart).

Layout check: every worker of a deployment must share `WorkerInfo.layout_key()` (model, block
size, hash seed, dtype, KV shape) for KV to move between them. A worker whose KV shape is not
the one of the gateway's own model (`expected`: layers, KV heads, head size from its
config.json) is refused whatever its age, so no registration can impose another model's layout;
among the others the reference is the live worker that registered first (smallest started_at,
then id), so every gateway replica agrees on it without coordination; workers that differ are
refused with a warning naming both layouts. Registrations not signed with the deployment token
never get this far (cluster.registry.list_workers).

Choice (--routing):
- `prefix` (default): the prompt's full blocks are hashed (engine.block_hash, with the
  deployment's block size and hash seed) and the Redis prefix directory says how many leading
  blocks each worker holds. A prefill worker costs the prompt tokens it would compute (the prompt
  minus its cached prefix) plus the uncached prompt tokens this gateway already has outstanding on
  it; the cheapest wins. A decode worker is the one with the fewest requests in flight, the longest
  cached prefix breaking ties (fewer blocks to transfer). Redis unreachable: load only, retried
  after a second, serving continues.
- `load`: per role the worker with the fewest requests in flight from this gateway.
- `round-robin`: workers in turn.
Ties are broken round-robin; a worker found unreachable is avoided for a few seconds while others
exist. One grpc.aio channel is kept per worker address.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from typing import Iterator

import grpc
import redis.asyncio as aioredis

from engine.block_hash import BlockHasher, salt_bytes
from gateway.errors import GatewayError
from cluster.auth import ClusterAuth
from cluster.prefix_directory import directory_sizes, tiered_prefix_blocks
from cluster.registry import (ROLES, RedisSettings, WorkerInfo, cancel_task, connect, list_workers,
                              redacted)

log = logging.getLogger(__name__)

ROUTING = ("prefix", "load", "round-robin")
# What a listed block saves against computing it, by where the worker holds it: a block in a KV
# offload tier costs a copy into the pool (engine.kv_offload). On CPUs a host copy is some 1/1000
# of computing the block and a disk read (page cache) a few times that; on a GPU a host copy of
# an 8B model's block over PCIe is about a tenth of computing it, and a disk read can cost as
# much as computing: these weights sit between (docs/design.md#kv-offload-tiers).
TIER_SAVING = {"pool": 1.0, "host": 0.9, "disk": 0.5}
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


def kv_shape(w: WorkerInfo) -> tuple[int, int, int]:
    return w.num_layers, w.num_kv_heads, w.head_dim


def split_by_layout(workers: list[WorkerInfo], expected: tuple[int, int, int] | None = None
                    ) -> tuple[list[WorkerInfo], list[WorkerInfo]]:
    """(accepted, refused): accepted have the `expected` KV shape (layers, KV heads, head size)
    when given, and share the layout of the earliest registered such worker."""
    shaped = [w for w in workers if expected is None or kv_shape(w) == expected]
    if not shaped:
        return [], list(workers)
    reference = min(shaped, key=lambda w: (w.started_at, w.id)).layout_key()
    accepted = [w for w in shaped if w.layout_key() == reference]
    refused = [w for w in workers if w not in accepted]
    return accepted, refused


class PrefillTicket:
    """A prompt counted in a prefill worker's queue; release() (idempotent) takes it out."""

    def __init__(self, router: "Router", worker_id: str, tokens: int) -> None:
        self._router, self._worker_id, self._tokens = router, worker_id, tokens
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._router._dequeue(self._worker_id, self._tokens)


@dataclass(frozen=True)
class Route:
    """A routing decision: the workers and why (see GatewayMetrics.route_reason)."""

    prefill: WorkerInfo
    decode: WorkerInfo
    reason: str                 # cached_prefix | load | no_directory | round_robin
    cached_tokens: int          # prompt tokens the directory lists on the chosen prefill worker
    # what was weighed: (worker id, cached prompt tokens, load) per prefill candidate; load is
    # the uncached tokens this gateway has queued there (prefix routing) or its requests in
    # flight (load, round-robin)
    candidates: tuple[tuple[str, int, int], ...] = ()


LORA_NOTE_S = 6.0        # a LoRA call's answer outlives the registry's view this long


class Router:
    """Knows the live workers, picks a (prefill, decode) pair per request, owns the channels.

    Use: `await start()` in the serving loop, `route()` + `track()` per request,
    `await stop()` at shutdown. `refresh()` runs one poll (tests call it directly).
    `auth`: the deployment token its channels carry and registrations must be signed with
    (None: an open deployment); `redis_settings`: the Redis password and CA.
    """

    def __init__(self, redis_url: str, poll_s: float = 0.5, routing: str = "prefix",
                 metrics=None, expected_shape: tuple[int, int, int] | None = None,
                 auth: ClusterAuth | None = None,
                 redis_settings: RedisSettings = RedisSettings()) -> None:
        if routing not in ROUTING:
            raise ValueError(f"routing must be one of {ROUTING}, got {routing!r}")
        self.auth = auth or ClusterAuth()
        self.redis_url = redis_url
        self.poll_s = poll_s
        self.routing = routing
        self.metrics = metrics                     # GatewayMetrics: directory sizes
        self.expected_shape = expected_shape       # the gateway's model's KV shape
        self._redis = connect(redis_url, redis_settings, socket_timeout=2.0,
                              socket_connect_timeout=2.0)
        # directory lookups are on the request path: short timeouts, a pause after a failure
        self._directory = connect(redis_url, redis_settings, socket_timeout=0.5,
                                  socket_connect_timeout=0.5)
        self._directory_down_until = 0.0
        self._reference: WorkerInfo | None = None
        self._queued_tokens: dict[str, int] = {}   # prefill worker id -> uncached tokens queued
        self._queued_prompts: dict[str, int] = {}  # prefill worker id -> prompts queued
        # after Redis was lost (unreachable, or back empty) the workers register again within
        # a heartbeat or two; until then the ones known before stay routable
        self.rejoin_grace_s = 6.0
        self._rejoin_until: float | None = None
        self._workers: dict[str, list[WorkerInfo]] = {role: [] for role in ROLES}
        self._lora_notes: dict[str, tuple[str, float]] = {}   # worker id -> (adapters, until)
        self._refused: dict[str, WorkerInfo] = {}
        self._warned: set[tuple] = set()
        self._unsigned: set[tuple[str, str]] = set()   # refused registrations already logged
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
            workers = await list_workers(self._redis, auth=self.auth, warned=self._unsigned)
        except (aioredis.RedisError, OSError) as exc:
            if not self._redis_down:
                log.warning("cannot read workers from redis at %s (%s); keeping the last known "
                            "list of %d workers", redacted(self.redis_url), exc,
                            self.num_workers())
            self._redis_down = True
            return
        came_back = self._redis_down
        if came_back:
            log.info("redis at %s is reachable again", redacted(self.redis_url))
        self._redis_down = False
        workers = self._with_rejoining(workers, came_back)
        self._apply(self._with_lora_changes(workers))
        await self._close_unused_channels()
        if self.metrics is not None and self.routing == "prefix":
            try:
                sizes = await directory_sizes(self._redis, [w.id for w in workers])
            except (aioredis.RedisError, OSError):
                return
            self.metrics.directory_blocks.clear()
            for wid, n in sizes.items():
                self.metrics.directory_blocks.labels(worker=wid).set(n)

    def _with_rejoining(self, workers: list[WorkerInfo], came_back: bool) -> list[WorkerInfo]:
        """The registry's list, plus the workers known before Redis was lost that have not
        registered again yet, for rejoin_grace_s. Redis lost means: it was unreachable and is
        back, or it lists no worker at all (restarted empty between two polls: far likelier than
        every worker dying together). A worker that really died is still avoided when it does
        not answer (mark_unreachable), and dropped when the grace ends."""
        now = time.monotonic()
        if self._rejoin_until is None and self.num_workers() and (came_back or not workers):
            self._rejoin_until = now + self.rejoin_grace_s
            log.warning("redis %s; keeping the last known workers for %.0f s while they "
                        "register again", "is back" if came_back else "lists no workers",
                        self.rejoin_grace_s)
        if self._rejoin_until is None:
            return workers
        if now >= self._rejoin_until:
            self._rejoin_until = None
            return workers
        listed = {w.id for w in workers}
        known = [w for ws in self._workers.values() for w in ws] + list(self._refused.values())
        return workers + [w for w in known if w.id not in listed]

    def _apply(self, workers: list[WorkerInfo]) -> None:
        accepted, refused = split_by_layout(workers, self.expected_shape)
        self._reference = min(accepted, key=lambda w: (w.started_at, w.id)) if accepted else None
        for w in refused:
            key = (w.id, w.layout_key())
            if key not in self._warned:
                self._warned.add(key)
                want = (accepted[0].layout_key() if accepted else
                        f"(layers, KV heads, head size) = {self.expected_shape}")
                log.warning("refusing worker %s (%s at %s): its KV layout %s differs from the "
                            "deployment's %s; restart it with the same model, block size, hash "
                            "seed and dtype", w.id, w.role, w.address, w.layout_key(), want)
        self._refused = {w.id: w for w in refused}
        live = {w.id for w in workers}
        self._avoid_until = {k: v for k, v in self._avoid_until.items() if k in live}
        before = {w.id for ws in self._workers.values() for w in ws}
        for role in ROLES:
            self._workers[role] = [w for w in accepted if w.role == role]
        if self.metrics is not None:
            self.metrics.set_pools(self._workers)
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
        await cancel_task(self._task)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        await self._redis.aclose()
        await self._directory.aclose()

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
    def note_loras(self, worker_id: str, names: list[str]) -> None:
        """A worker's adapters as its LoRA call just answered: they hold over what Redis says
        until its heartbeats have caught up (LORA_NOTE_S)."""
        self._lora_notes[worker_id] = (",".join(names), time.monotonic() + LORA_NOTE_S)
        for role, ws in self._workers.items():
            self._workers[role] = [dataclasses.replace(w, loras=",".join(names))
                                   if w.id == worker_id else w for w in ws]

    def _with_lora_changes(self, workers: list[WorkerInfo]) -> list[WorkerInfo]:
        now = time.monotonic()
        self._lora_notes = {k: v for k, v in self._lora_notes.items() if v[1] > now}
        return [dataclasses.replace(w, loras=self._lora_notes[w.id][0])
                if w.id in self._lora_notes else w for w in workers]

    def lora_names(self) -> set[str]:
        """The LoRA adapters some registered worker serves (their heartbeats')."""
        return {n for ws in self._workers.values() for w in ws for n in w.loras.split(",") if n}

    def _candidates(self, role: str, avoid: frozenset[str] = frozenset(),
                    lora: str = "") -> list[WorkerInfo]:
        """Workers of the role (serving the LoRA adapter `lora`, if any), without those found
        unreachable lately or in `avoid` (ids), as long as that leaves any."""
        workers = self._workers[role]
        if not workers:
            raise GatewayError(f"no {role} worker is available; try again later",
                               status=503, code="no_worker", retry_after=5.0)
        if lora:
            workers = [w for w in workers if lora in w.loras.split(",")]
            if not workers:
                raise GatewayError(f"no {role} worker serves the LoRA adapter `{lora}`; load "
                                   "it on every worker (POST /v1/load_lora_adapter)",
                                   status=503, code="lora_not_loaded", retry_after=5.0)
        now = time.monotonic()
        workers = [w for w in workers if w.id not in avoid] or workers
        return [w for w in workers if self._avoid_until.get(w.id, 0.0) <= now] or workers

    def _take_turn(self, role: str, tied: list[WorkerInfo]) -> WorkerInfo:
        turn = self._turn[role]
        self._turn[role] = turn + 1
        return tied[turn % len(tied)]

    def _lowest(self, role: str, workers: list[WorkerInfo], cost) -> WorkerInfo:
        best = min(cost(w) for w in workers)
        return self._take_turn(role, [w for w in workers if cost(w) == best])

    def pick(self, role: str, avoid: frozenset[str] = frozenset(), lora: str = ""
             ) -> WorkerInfo:
        """The least loaded worker of `role`; GatewayError(503) when none is registered."""
        workers = self._candidates(role, avoid, lora)
        if self.routing == "round-robin":
            return self._take_turn(role, workers)
        return self._lowest(role, workers, lambda w: self.in_flight(w.id))

    async def cached_blocks(self, prompt_token_ids, cache_salt: str = ""
                            ) -> dict[str, dict[str, int]] | None:
        """worker id -> the leading run of the prompt's blocks the directory lists, counted by
        where ({"pool": n, "host": n, "disk": n}); None when the directory cannot be read now."""
        ref = self._reference
        if ref is None or time.monotonic() < self._directory_down_until:
            return None
        hashes = BlockHasher(ref.block_size, ref.hash_seed).hashes(prompt_token_ids,
                                                                    salt_bytes(cache_salt))
        ids = [w.id for ws in self._workers.values() for w in ws]
        try:
            found = await tiered_prefix_blocks(self._directory, ids, hashes)
        except (aioredis.RedisError, OSError) as exc:
            if not self._redis_down:
                log.warning("prefix directory unreadable (%s); routing by load for now", exc)
            self._directory_down_until = time.monotonic() + 1.0
            return None
        return found

    async def route(self, prompt_token_ids=(), cache_salt: str = "",
                    avoid: frozenset[str] = frozenset(), lora: str = "") -> Route:
        """Choose (prefill, decode) for a prompt, not among `avoid` (worker ids) unless nothing
        else is left, both serving the LoRA adapter `lora` if one is asked for. When a role has
        no known worker, Redis is read once more first (a worker may have registered since the
        last poll)."""
        if not all(self._workers.values()):
            await self.refresh()
        if self.routing != "prefix":
            decode = self.pick("decode", avoid, lora)
            prefill = self.pick("prefill", avoid, lora)
            weighed = tuple((w.id, 0, self.in_flight(w.id))
                            for w in self._candidates("prefill", avoid, lora))
            return Route(prefill, decode, self.routing.replace("-", "_"), 0, weighed)
        decodes = self._candidates("decode", avoid, lora)
        prefills = self._candidates("prefill", avoid, lora)
        cached = await self.cached_blocks(prompt_token_ids, cache_salt)
        found = cached or {}
        bs = self._reference.block_size if self._reference else 1
        n = len(prompt_token_ids)
        held = {w: sum(c.values()) * bs for w, c in found.items()}     # tokens, any tier
        saved = {w: sum(TIER_SAVING[k] * v for k, v in c.items()) * bs for w, c in found.items()}
        decode = self._lowest("decode", decodes,
                              lambda w: (self.in_flight(w.id), -held.get(w.id, 0)))
        prefill = self._lowest("prefill", prefills,
                               lambda w: n - saved.get(w.id, 0) + self.queued_tokens(w.id))
        cached_tokens = held.get(prefill.id, 0)
        reason = "no_directory" if cached is None else "cached_prefix" if cached_tokens else "load"
        weighed = tuple((w.id, held.get(w.id, 0), self.queued_tokens(w.id)) for w in prefills)
        return Route(prefill, decode, reason, cached_tokens, weighed)

    async def pick_pair(self) -> tuple[WorkerInfo, WorkerInfo]:
        """(prefill, decode) for an empty prompt: the choice by load alone."""
        route = await self.route()
        return route.prefill, route.decode

    def queued_tokens(self, worker_id: str) -> int:
        return self._queued_tokens.get(worker_id, 0)

    def queued_prompts(self, worker_id: str) -> int:
        return self._queued_prompts.get(worker_id, 0)

    def enqueue_prefill(self, worker: WorkerInfo, tokens: int) -> "PrefillTicket":
        """Count a prompt (`tokens` of work) as queued on a prefill worker from the moment it is
        routed there (so a burst of arrivals sees the queue it builds) until the ticket is
        released: when the prefill ends, or the request does."""
        for table, n in ((self._queued_tokens, tokens), (self._queued_prompts, 1)):
            table[worker.id] = table.get(worker.id, 0) + n
        return PrefillTicket(self, worker.id, tokens)

    def _dequeue(self, worker_id: str, tokens: int) -> None:
        # A table's entry can reach 0 while other tickets are out (prompts whose every token
        # was cached queue 0 tokens): an absent entry counts as 0.
        for table, n in ((self._queued_tokens, tokens), (self._queued_prompts, 1)):
            left = table.get(worker_id, 0) - n
            if left > 0:
                table[worker_id] = left
            else:
                table.pop(worker_id, None)

    def mark_unreachable(self, worker: WorkerInfo, avoid_s: float = 5.0) -> None:
        """Prefer other workers of the role for `avoid_s` (a dead worker stays registered until
        its TTL runs out)."""
        self._avoid_until[worker.id] = time.monotonic() + avoid_s
        log.warning("worker %s at %s is unreachable; avoiding it for %.0f s", worker.id,
                    worker.address, avoid_s)

    def set_hung(self, worker: WorkerInfo, hung: bool) -> None:
        """A worker found hung (gateway/liveness.py) is avoided until it answers again."""
        if hung:
            self._avoid_until[worker.id] = math.inf
        else:
            self._avoid_until.pop(worker.id, None)

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
            ch = self.auth.channel(address, CHANNEL_OPTIONS)
            self._channels[address] = ch
        return ch

    async def _close_unused_channels(self) -> None:
        live = {w.address for ws in self._workers.values() for w in ws}
        unused = [a for a in self._channels if a not in live and a not in self._busy_addresses]
        for address in unused:
            await self._channels.pop(address).close()
