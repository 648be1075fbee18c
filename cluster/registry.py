"""Worker registry in Redis: registration with a heartbeat TTL, discovery by the gateway.

Layout in Redis::

    pdserve:worker:<worker_id>   hash   id, role, address, model, block_size, hash_seed,
                                        dtype, num_layers, num_kv_heads, head_dim, total_blocks,
                                        tensor_parallel_size, running, waiting, free_blocks, started_at,
                                        expires_at, sig (HMAC of the other fields and the
                                        key with the deployment token: cluster.auth)
                                 TTL    ttl_s, refreshed by every heartbeat

A worker whose process dies stops refreshing, and its key disappears after ttl_s seconds. The
gateway lists live workers with SCAN; it never needs a worker to say goodbye (it still does, on a
clean shutdown). With a deployment token, entries whose signature does not verify are ignored:
a process that can write to Redis but does not hold the token cannot register a worker.

Redis itself can take a password (the URL's, --redis-password-file or $PDSERVE_REDIS_PASSWORD)
and TLS (`rediss://` URLs, --redis-ca-cert for a private CA): a process's main reads them once
into a `RedisSettings`, which `connect()` applies to every client made with it; `redacted()` is
the URL as logs show it. Torch-free: the gateway imports this.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis

from cluster.auth import ClusterAuth

log = logging.getLogger(__name__)

KEY_PREFIX = "pdserve:worker:"
ROLES = ("prefill", "decode")
SIGNATURE_FIELD = "sig"
EXPIRES_FIELD = "expires_at"      # signed with the entry: after it, a copy of it is refused
CLOCK_SKEW_S = 30.0               # how far the gateway's clock may be behind a worker's
PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"
CA_CERT_ENV = "PDSERVE_REDIS_CA_CERT"


@dataclass(frozen=True)
class RedisSettings:
    """How a process reaches the deployment's Redis besides the URL: a password, used when the
    URL has none, and the CA that signs a `rediss://` server's certificate (None: the system's).
    """

    password: str | None = field(default=None, repr=False)
    ca_cert: str | None = None

    @classmethod
    def from_sources(cls, password_file: str | None = None,
                     ca_cert: str | None = None) -> "RedisSettings":
        """A password from a file (else $PDSERVE_REDIS_PASSWORD, else the URL's) and the CA
        of a TLS server (else $PDSERVE_REDIS_CA_CERT, else the system's)."""
        password = os.environ.get(PASSWORD_ENV) or None
        if password_file:
            path = Path(password_file)
            if not path.is_file():
                raise SystemExit(f"--redis-password-file {password_file}: no such file")
            password = path.read_text(encoding="utf-8").strip() or None
        ca_cert = ca_cert or os.environ.get(CA_CERT_ENV) or None
        if ca_cert and not Path(ca_cert).is_file():
            raise SystemExit(f"--redis-ca-cert {ca_cert}: no such file")
        return cls(password, ca_cert)


def connect(url: str, settings: RedisSettings = RedisSettings(), **kw) -> aioredis.Redis:
    """An asyncio Redis client for `url` with the password and CA of `settings`."""
    extra = {}
    if settings.password and not urlsplit(url).password:
        extra["password"] = settings.password
    if url.startswith("rediss://"):
        extra["ssl_check_hostname"] = True       # redis-py 5 does not check it by default
        if settings.ca_cert:
            extra["ssl_ca_certs"] = settings.ca_cert
    return aioredis.from_url(url, **extra, **kw)


def redacted(url: str) -> str:
    """The URL without its password (what logs and error messages show)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


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
    tensor_parallel_size: int = 1     # ranks; rank r holds KV heads engine.parallel.head_range
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    started_at: float = 0.0
    # the autoscaling signals (each heartbeat): work queued here and the rates measured lately
    queued_prompt_tokens: int = 0
    remaining_decode_tokens: int = 0
    prompt_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0
    loras: str = ""                   # the LoRA adapters it serves, comma-separated (heartbeat)

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

    def __init__(self, redis_url: str, interval_s: float,
                 redis_settings: RedisSettings = RedisSettings()) -> None:
        self.redis_url = redis_url
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None
        self._client = connect(redis_url, redis_settings, socket_timeout=2.0,
                               socket_connect_timeout=2.0)

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
                    log.info("%s: redis at %s reachable again", self.what,
                             redacted(self.redis_url))
                down = False
            except Exception as exc:  # redis down: keep serving, keep trying
                if not down:
                    log.warning("%s: cannot reach redis at %s (%s); retrying", self.what,
                                redacted(self.redis_url), exc)
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
    every heartbeat. Each beat writes the entry signed with the deployment token (`auth`; None:
    unsigned, an open deployment).
    """

    what = "worker registration"

    def __init__(self, redis_url: str, info: WorkerInfo, load=None, ttl_s: float = 10.0,
                 interval_s: float = 2.0, auth: ClusterAuth | None = None,
                 redis_settings: RedisSettings = RedisSettings(), signals=None) -> None:
        if interval_s >= ttl_s:
            raise ValueError("heartbeat interval must be shorter than the TTL")
        super().__init__(redis_url, interval_s, redis_settings)
        self.auth = auth or ClusterAuth()
        self.info = info
        self.load = load
        self.signals = signals        # () -> {WorkerInfo field: value}, the autoscaling ones
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
        if self.signals is not None:
            info = dataclasses.replace(info, **self.signals())
        fields = info.to_redis()
        # the signature binds the entry to its key and to a time: a copy under another key, or
        # an old entry written back (a dead worker's, a quieter load's), does not verify
        fields[EXPIRES_FIELD] = f"{time.time() + self.ttl_s:.3f}"
        fields[SIGNATURE_FIELD] = self.auth.sign(dict(fields, key=self.key))
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(self.key)            # no field of an earlier entry outlives this one
            pipe.hset(self.key, mapping=fields)
            pipe.pexpire(self.key, int(self.ttl_s * 1000))
            await pipe.execute()

    tick = beat


def _signed(key: str, raw: dict, auth: ClusterAuth, warned: set[tuple[str, str]]) -> bool:
    """The entry at `key` carries this deployment's signature of its fields, its key and an
    expiry not past (beyond CLOCK_SKEW_S); always True without a token. A refusal is logged
    once per (worker, reason) in `warned`, the caller's record of those already logged."""
    if not auth.enabled:
        return True
    fields = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes)
                                                            else v) for k, v in raw.items()}
    signature = fields.pop(SIGNATURE_FIELD, None)
    why = None
    if not auth.verify(dict(fields, key=key), signature):
        why = "it is not signed with this deployment's token"
    else:
        try:
            expired = float(fields.get(EXPIRES_FIELD, "0")) < time.time() - CLOCK_SKEW_S
        except ValueError:
            expired = True
        if expired:
            why = "its signature has expired (an old entry written back?)"
    if why is None:
        return True
    wid = fields.get("id", "?")
    if (wid, why) not in warned:
        warned.add((wid, why))
        log.warning("ignoring the registration of %r (%r at %r): %s", wid, fields.get("role"),
                    fields.get("address"), why)
    return False


async def list_workers(client: aioredis.Redis, role: str | None = None,
                       auth: ClusterAuth | None = None,
                       warned: set[tuple[str, str]] | None = None) -> list[WorkerInfo]:
    """All live workers (optionally of one role) whose entries carry a valid signature with
    the deployment token `auth` (None: an open deployment, every entry), sorted by id.
    `warned`: the (worker, reason) refusals already logged, kept by a caller that lists again
    and again so that each is logged once (None: log every refusal of this call)."""
    auth = auth or ClusterAuth()
    warned = set() if warned is None else warned
    keys = [k async for k in client.scan_iter(match=KEY_PREFIX + "*", count=100)]
    if not keys:
        return []
    async with client.pipeline(transaction=False) as pipe:
        for k in keys:
            pipe.hgetall(k)
        raws = await pipe.execute()
    out = []
    for key, raw in zip(keys, raws):
        key = key.decode() if isinstance(key, bytes) else key
        if not raw or not _signed(key, raw, auth, warned):
            continue
        try:
            w = WorkerInfo.from_redis(raw)
        except (TypeError, ValueError) as exc:
            log.warning("ignoring malformed worker entry: %s", exc)
            continue
        if role is None or w.role == role:
            out.append(w)
    return sorted(out, key=lambda w: w.id)
