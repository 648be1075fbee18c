"""KV offload tiers below a worker's pool: host memory, then a local disk.

    pool --evicted--> host tier --its LRU victim--> disk tier        (stores)
    pool <--restored-- host tier or disk tier, checksum checked       (restores)

Store. When the pool hands a cached block to another request (engine.block_pool evicts its
hash), the block's KV is copied into the host tier, if the admission gate lets it: its hash must
have been seen `min_seen` times (computed, or looked up by a prompt), so one-off prompts need not
churn the tier. Its checksum (engine.kv_checksum, the one KV transfers compute) is taken from the
pool block as it is copied and kept with it. A full host tier passes its least recently used
block to the disk tier (or drops it without one); a full disk tier drops its own LRU block.

Restore. A prompt whose leading blocks miss the pool but continue in a tier (engine.
kv_cache_manager.cached_prefix) gets them copied into fresh pool blocks, which are then
registered in the prefix cache and used like any cached block. Each restored block's checksum
is computed again in the pool and compared with the stored one: a mismatch drops that block and
every one after it (the prompt computes them) and is counted (`checksum_failures`). A run that
would take longer to read than to compute (`_worth_it`: the tier's measured bandwidth against the
engine's measured prompt rate) is not restored.

Keys are the pool's: the chained block hash (engine.block_hash: seed, salt and every earlier
token), the token ids compared on a hit. A tier holds one model's blocks: the host tier is the
process's own; the disk tier keeps its files under a folder named by a fingerprint of the model,
dtype, KV layout and hash seed, each file with a header naming them, and ignores a file whose
header differs. Files are written to a temporary name and renamed, so a worker killed mid-store
leaves no half file (left temporaries are removed at start); a restarted worker with the same
folder finds its blocks again.

When: on the engine thread, between steps (stores while the scheduler allocates, restores while
it admits a prompt). On CPUs the copies are done at once: memory copies of a few hundred KB a
block (a 20-block prompt in about 7 ms) beside steps of tens of ms to seconds. On CUDA they run
on a stream of their own (`_Copies`), so the engine's steps go on meanwhile: the stream first
waits for the compute stream's queued work (the blocks it reads or overwrites are final), the
copies and checksums follow, then an event. A store lets the compute stream wait for its event
(an evicted block's next writer runs after the copy has read it) and keeps its checksums in
page-locked memory, read when needed (`_Entry.checksum` waits for the event then). A restore is
begun (`begin_restore`) and finished when its event has passed (`finish_restore`: the checksums
compared, the compute stream made to wait for the event): the request waits in the queue
meanwhile, the others are scheduled (engine.kv_cache_manager.cached_prefix).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import torch

from engine.block_hash import EVICTED, STORED
from engine.kv_checksum import block_checksums
from engine.pinned import pinned_empty

log = logging.getLogger(__name__)

MAGIC = b"PDSKVB1\n"
_HEADER_LEN = struct.Struct("<I")
_TMP = ".tmp"
_SUFFIX = ".kvb"


@dataclass
class TierStats:
    """One tier's counters (metrics: pdserve_kv_offload_*{tier=...})."""

    hits: int = 0                  # blocks found here and read for a prompt
    misses: int = 0                # lookups that reached this tier and missed (a prompt
    #                                waiting for room in the pool is looked up each step)
    stored_blocks: int = 0
    stored_bytes: int = 0
    store_seconds: float = 0.0
    restored_blocks: int = 0
    restored_bytes: int = 0
    restore_seconds: float = 0.0
    skipped_blocks: int = 0        # hits not restored: recompute was cheaper
    evicted_blocks: int = 0        # dropped (or moved down) to make room
    rejected_blocks: int = 0       # refused by the admission gate (host tier, or disk alone)
    checksum_failures: int = 0
    errors: int = 0                # I/O errors (the disk tier)
    ignored_files: int = 0         # disk files of another model, dtype, layout or seed
    blocks: int = 0                # held now
    capacity_blocks: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class _Entry:
    """A stored block: its tokens, its checksum (an int, or `(batch, i)`: the i-th checksum of
    copies still in flight, read when first asked for), its row of the host tier's buffer."""

    __slots__ = ("tokens", "_checksum", "slot")

    def __init__(self, tokens: tuple[int, ...], checksum, slot: int = -1) -> None:
        self.tokens = tokens
        self._checksum = checksum
        self.slot = slot

    @property
    def checksum(self) -> int:
        """The stored checksum; waits for the copies that took it (and the block's data)."""
        if not isinstance(self._checksum, int):
            batch, i = self._checksum
            self._checksum = batch.sums()[i]
        return self._checksum


class _Batch:
    """Copies and the checksums taken with them, issued together inside `with copies.batch()
    as batch:` (the checksums given by `batch.checksums(t)`): done at once on CPUs; on CUDA
    queued on the tiers' stream with an event after them, the checksums copied into page-locked
    memory. Keeps the tensors the copies read (`keep`) until they are done."""

    def __init__(self, copies: "_Copies") -> None:
        self._copies = copies
        self._polls = copies.min_polls
        self._sums_dev: torch.Tensor | None = None
        self._sums: list[int] | None = None
        self._keep: list[torch.Tensor] = []
        self.event = self._start = self._ctx = None
        self._seconds: float | None = None

    def __enter__(self) -> "_Batch":
        self._t0 = time.perf_counter()
        stream = self._copies.stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self._copies.device))
            self._ctx = torch.cuda.stream(stream)
            self._ctx.__enter__()
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(stream)
        return self

    def checksums(self, sums: torch.Tensor) -> None:
        self._sums_dev = sums

    def keep(self, t: torch.Tensor) -> None:
        self._keep.append(t)

    def __exit__(self, *exc) -> None:
        if self._ctx is None:
            self._sums = self._sums_dev.tolist() if self._sums_dev is not None else []
            self._seconds = time.perf_counter() - self._t0
            self._keep = []
            return
        try:
            if self._sums_dev is not None:
                host = torch.empty(self._sums_dev.shape, dtype=self._sums_dev.dtype,
                                   pin_memory=True)
                host.copy_(self._sums_dev, non_blocking=True)
                self._keep += [self._sums_dev, host]
                self._sums_dev = host
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record(self._copies.stream)
        finally:
            self._ctx.__exit__(*exc)

    def done(self) -> bool:
        """Whether the copies are done (never blocks)."""
        if self._polls > 0:
            self._polls -= 1
            return False
        return self.event is None or self.event.query()

    def wait(self) -> None:
        self._polls = 0
        if self.event is not None:
            self.event.synchronize()

    def sums(self) -> list[int]:
        if self._sums is None:
            self.wait()
            self._sums = self._sums_dev.tolist() if self._sums_dev is not None else []
            self._keep = []
        return self._sums

    def seconds(self) -> float:
        """How long the copies took (on CUDA between the batch's events: the stream's time)."""
        if self._seconds is None:
            self.wait()
            self._seconds = self._start.elapsed_time(self.event) / 1e3
        return self._seconds

    def order_compute(self) -> None:
        """The compute stream's later work waits for these copies."""
        if self.event is not None:
            torch.cuda.current_stream(self._copies.device).wait_event(self.event)


class _Copies:
    """Where the tiers' copies run: on CPUs at once; on CUDA on a stream of their own, after the
    compute stream's queued work. `min_polls`: a batch reports done only after that many
    `done()` calls (tests drive the asynchronous path on CPUs with it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.min_polls = 0

    def batch(self) -> _Batch:
        return _Batch(self)


class RestoreJob:
    """A restore begun (KVOffload.begin_restore): the run's blocks copied into `block_ids`."""

    def __init__(self, copied: list, batch: _Batch | None, block_ids: list[int]) -> None:
        self.copied = copied              # (hash, tier, entry, block id) of each block copied
        self.batch = batch
        self.block_ids = block_ids        # all the blocks given for it (the caller's)
        self.held: list[int] = []         # the caller's: pool blocks it holds meanwhile
        self.chunks: list[tuple[int, ...]] = []   # the caller's: each copied block's tokens

    def done(self) -> bool:
        return self.batch is None or self.batch.done()

    def wait(self) -> None:
        if self.batch is not None:
            self.batch.wait()


class _Tier:
    """What both tiers keep: an LRU index by block hash, counters, and the stored / evicted
    events the worker's prefix directory publisher drains (another thread: deque appends and
    pops are atomic)."""

    name = ""

    def __init__(self, capacity: int) -> None:
        self.index: OrderedDict[int, _Entry] = OrderedDict()
        self.stats = TierStats(capacity_blocks=capacity)
        self.events: deque[tuple[str, int]] = deque()

    def find(self, block_hash: int, tokens: tuple[int, ...]) -> _Entry | None:
        """The entry holding exactly these tokens under this hash (now the most recently used),
        or None."""
        e = self.index.get(block_hash)
        if e is None or e.tokens != tokens:
            return None
        self.index.move_to_end(block_hash)
        return e


class HostTier(_Tier):
    """Blocks in host memory: one preallocated buffer of `capacity` blocks (page-locked when the
    pool is on CUDA: registered, so exactly its bytes are locked; engine.pinned)."""

    name = "host"

    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype, capacity: int,
                 pin: bool = False) -> None:
        super().__init__(capacity)
        self.data = pinned_empty((capacity, *block_shape), dtype, pin)   # exactly its bytes
        self._free = list(range(capacity - 1, -1, -1))

    def put(self, block_hash: int, tokens: tuple[int, ...], checksum,
            src: torch.Tensor) -> None:
        """Store `src` (one block; on CUDA a copy queued on the current stream); `checksum` as
        _Entry takes it. The caller made room (`drop`)."""
        slot = self._free.pop()
        self.data[slot].copy_(src, non_blocking=True)
        self.index[block_hash] = _Entry(tokens, checksum, slot)
        self.stats.blocks = len(self.index)
        self.events.append((STORED, block_hash))

    def read(self, e: _Entry) -> torch.Tensor:
        return self.data[e.slot]

    def drop(self, block_hash: int) -> None:
        e = self.index.pop(block_hash, None)
        if e is not None:
            self._free.append(e.slot)
            self.stats.blocks = len(self.index)
            self.events.append((EVICTED, block_hash))


class DiskTier(_Tier):
    """Blocks as files under `directory`/<fingerprint>/, one a block, LRU by use, at most
    `capacity` blocks. `identity` (model, dtype, layout, hash seed) is in every file's header."""

    name = "disk"

    def __init__(self, directory: str | Path, identity: dict, block_shape: tuple[int, ...],
                 dtype: torch.dtype, capacity: int) -> None:
        super().__init__(capacity)
        self.identity = dict(identity)
        self.block_shape, self.dtype = tuple(block_shape), dtype
        self.nbytes = torch.Size(block_shape).numel() * torch.empty((), dtype=dtype).element_size()
        fingerprint = _fingerprint(self.identity)
        self.root = Path(directory) / fingerprint
        self._warned = False
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()

    def _path(self, block_hash: int) -> Path:
        return self.root / f"{block_hash:016x}{_SUFFIX}"

    def _scan(self) -> None:
        """Index the files a previous run left, oldest use first; remove half-written ones."""
        found = []
        for p in self.root.iterdir():
            if p.name.endswith(_TMP):
                p.unlink(missing_ok=True)
                continue
            if not p.name.endswith(_SUFFIX):
                continue
            try:
                with open(p, "rb") as f:
                    header = _read_header(f)
                size = p.stat().st_size
                mtime = p.stat().st_mtime
            except (OSError, ValueError):
                header = None
            if (header is None or header.get("identity") != self.identity
                    or size != _data_offset(header) + self.nbytes
                    or p.name != f"{int(header['hash']):016x}{_SUFFIX}"):
                self.stats.ignored_files += 1
                continue
            found.append((mtime, int(header["hash"]),
                          _Entry(tuple(header["tokens"]), int(header["checksum"]))))
        for _, h, e in sorted(found, key=lambda t: t[0]):
            self.index[h] = e
        while len(self.index) > self.stats.capacity_blocks:
            self.drop(next(iter(self.index)))
        self.stats.blocks = len(self.index)
        self.events.clear()
        self.events.extend((STORED, h) for h in self.index)
        if self.index or self.stats.ignored_files:
            log.info("KV offload disk tier %s: %d blocks found, %d files ignored (another "
                     "model, dtype, layout or hash seed, or damaged)", self.root, len(self.index),
                     self.stats.ignored_files)

    def full(self) -> bool:
        return len(self.index) >= self.stats.capacity_blocks

    def put(self, block_hash: int, tokens: tuple[int, ...], checksum: int,
            src: torch.Tensor) -> bool:
        """Write one block (a CPU tensor); False (counted, logged once) when the disk refuses."""
        while self.full() and self.index:
            self.drop(next(iter(self.index)))
            self.stats.evicted_blocks += 1
        header = json.dumps({"identity": self.identity, "hash": str(block_hash),
                             "tokens": list(tokens), "checksum": str(checksum)}).encode()
        path = self._path(block_hash)
        tmp = path.with_name(path.name + _TMP)
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + _HEADER_LEN.pack(len(header)) + header)
                f.write(memoryview(src.contiguous().view(torch.uint8).numpy()))
            os.replace(tmp, path)
        except OSError as exc:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self._error("write", exc)
            return False
        self.index[block_hash] = _Entry(tokens, checksum)
        self.stats.blocks = len(self.index)
        self.events.append((STORED, block_hash))
        return True

    def read(self, block_hash: int, e: _Entry) -> torch.Tensor | None:
        """The block's KV (a CPU tensor), or None (the entry dropped) when the file is gone,
        damaged or no longer this tier's."""
        try:
            with open(self._path(block_hash), "rb") as f:
                header = _read_header(f)
                data = f.read()
        except (OSError, ValueError) as exc:
            self._error("read", exc)
            self.drop(block_hash)
            return None
        if (header.get("identity") != self.identity or int(header["hash"]) != block_hash
                or len(data) != self.nbytes):
            self.stats.ignored_files += 1
            self.drop(block_hash)
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype).view(
            self.block_shape)

    def drop(self, block_hash: int) -> None:
        if self.index.pop(block_hash, None) is not None:
            try:
                self._path(block_hash).unlink(missing_ok=True)
            except OSError as exc:
                self._error("remove", exc)
            self.stats.blocks = len(self.index)
            self.events.append((EVICTED, block_hash))

    def _error(self, what: str, exc: OSError) -> None:
        self.stats.errors += 1
        if not self._warned:
            self._warned = True
            log.warning("KV offload disk tier %s: %s failed (%s); the blocks concerned are "
                        "computed instead (further errors counted, not logged)", self.root, what,
                        exc)


def _fingerprint(identity: dict) -> str:
    import hashlib
    return hashlib.blake2b(json.dumps(identity, sort_keys=True).encode(),
                           digest_size=8).hexdigest()


def _read_header(f) -> dict:
    if f.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a KV block file")
    (n,) = _HEADER_LEN.unpack(f.read(_HEADER_LEN.size))
    if n > 1 << 20:
        raise ValueError("header too long")
    header = json.loads(f.read(n))
    header["_len"] = n
    return header


def _data_offset(header: dict) -> int:
    return len(MAGIC) + _HEADER_LEN.size + header["_len"]


@dataclass
class OffloadSettings:
    host_blocks: int = 0
    disk_dir: str = ""
    disk_blocks: int = 0
    min_seen: int = 1
    identity: dict = field(default_factory=dict)   # the disk files' header


class KVOffload:
    """The tiers of one engine's pool. `pool()` returns the KV pool tensor
    kv[layer, k_or_v, block, slot, kv_head, head_dim]; engine thread only."""

    SEEN_LIMIT_FACTOR = 4          # hashes counted for the admission gate, per tier block

    def __init__(self, settings: OffloadSettings, pool: Callable[[], torch.Tensor],
                 block_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        """block_shape: one block of the pool, [layers, 2, block_size, kv_heads, head_dim]."""
        self.settings = settings
        self.block_size = block_shape[2]
        self._pool = pool
        self.device = device
        self.block_nbytes = torch.Size(block_shape).numel() * torch.empty(
            (), dtype=dtype).element_size()
        self.host = HostTier(block_shape, dtype, settings.host_blocks,
                             pin=device.type == "cuda") if settings.host_blocks else None
        self.disk = DiskTier(settings.disk_dir, settings.identity, block_shape, dtype,
                             settings.disk_blocks) if settings.disk_blocks else None
        self._seen: OrderedDict[int, int] = OrderedDict()
        self._seen_limit = max(1, self.SEEN_LIMIT_FACTOR * (settings.host_blocks
                                                             + settings.disk_blocks))
        # measured rates for the cost rule: bytes/s per tier, prompt tokens/s of the engine
        self._bandwidth: dict[str, float] = {}
        self.prompt_tokens_per_s: float | None = None
        self.copies = _Copies(device)
        self._stores: deque[tuple[_Batch, int]] = deque()   # host stores not timed yet

    @property
    def tiers(self) -> list:
        return [t for t in (self.host, self.disk) if t is not None]

    def stats(self) -> dict[str, dict]:
        return {t.name: t.stats.as_dict() for t in self.tiers}

    # ------------------------------------------------------------------ admission gate
    def seen(self, block_hash: int) -> None:
        """A prompt computed or looked up this block."""
        self._seen[block_hash] = self._seen.pop(block_hash, 0) + 1
        if len(self._seen) > self._seen_limit:
            self._seen.popitem(last=False)

    def note_prompt_rate(self, tokens: int, seconds: float) -> None:
        """A step's prompt tokens and wall time (the engine, after each step with prompts)."""
        if tokens > 0 and seconds > 0:
            rate = tokens / seconds
            old = self.prompt_tokens_per_s
            self.prompt_tokens_per_s = rate if old is None else 0.8 * old + 0.2 * rate

    # ------------------------------------------------------------------ store
    def store(self, evicted: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """The pool is about to give these blocks (block id, hash, tokens) to other requests:
        keep their KV in a tier. One checksum pass for all of them (one batch of copies: on
        CUDA the compute stream waits for it, nothing waits on the host); the host tier's
        victims move to the disk tier first."""
        self._time_stores()
        first = self.host or self.disk
        keep = []
        for b, h, toks in evicted:
            if self._seen.get(h, 0) < self.settings.min_seen:
                first.stats.rejected_blocks += 1
            elif not any(h in t.index for t in self.tiers):   # else a copy is already kept
                keep.append((b, h, toks))
        if self.host is not None:
            keep = keep[-self.host.stats.capacity_blocks:]    # the most recently used win
        if not keep:
            return
        kv = self._pool()
        if self.host is None:
            sums = block_checksums(kv, [b for b, _, _ in keep]).tolist()
            for (b, h, toks), s in zip(keep, sums):
                self._put_disk(h, toks, s, kv[:, :, b].to("cpu"))
            return
        while len(self.host.index) + len(keep) > self.host.stats.capacity_blocks:
            vh, ve = next(iter(self.host.index.items()))
            if self.disk is not None and vh not in self.disk.index:
                checksum = ve.checksum              # waits for the victim's copy, if queued
                self._put_disk(vh, ve.tokens, checksum, self.host.read(ve))
            self.host.drop(vh)
            self.host.stats.evicted_blocks += 1
        with self.copies.batch() as batch:
            batch.checksums(block_checksums(kv, [b for b, _, _ in keep]))
            for i, (b, h, toks) in enumerate(keep):
                self.host.put(h, toks, (batch, i), kv[:, :, b])
        batch.order_compute()
        self.host.stats.stored_blocks += len(keep)
        self.host.stats.stored_bytes += len(keep) * self.block_nbytes
        self._stores.append((batch, len(keep)))
        self._time_stores()

    def _time_stores(self) -> None:
        """Host stores whose copies are done add their time to the tier's counters."""
        while self._stores and self._stores[0][0].done():
            batch, _ = self._stores.popleft()
            self.host.stats.store_seconds += batch.seconds()

    def _put_disk(self, block_hash: int, tokens, checksum: int, src: torch.Tensor) -> None:
        """`src`: a CPU tensor whose data is there (a host block's checksum read first)."""
        t0 = time.perf_counter()
        if self.disk.put(block_hash, tokens, checksum, src):
            self._count_store(self.disk, t0, 1)

    def _count_store(self, tier, t0: float, n: int) -> None:
        tier.stats.stored_blocks += n
        tier.stats.stored_bytes += n * self.block_nbytes
        tier.stats.store_seconds += time.perf_counter() - t0

    def flush(self, pool_blocks: list[tuple[int, int, tuple[int, ...]]]) -> int:
        """At shutdown, with a disk tier: what the host tier and the pool hold (`pool_blocks`,
        engine.block_pool.cached_blocks) goes to disk, oldest first, so a restarted worker
        finds it; -> blocks written."""
        if self.disk is None:
            return 0
        before = self.disk.stats.stored_blocks
        if self.host is not None:
            for h, e in list(self.host.index.items()):
                if h not in self.disk.index:
                    checksum = e.checksum
                    self._put_disk(h, e.tokens, checksum, self.host.read(e))
        kv = self._pool()
        keep = [(b, h, t) for b, h, t in pool_blocks if h not in self.disk.index]
        sums = block_checksums(kv, [b for b, _, _ in keep]).tolist() if keep else []
        for (b, h, toks), s in zip(keep, sums):
            self._put_disk(h, toks, s, kv[:, :, b].to("cpu"))
        return self.disk.stats.stored_blocks - before

    # ------------------------------------------------------------------ restore
    def find_run(self, hashes: Sequence[int], tokens: Sequence[tuple[int, ...]]
                 ) -> list[tuple[int, object, _Entry]]:
        """The leading run of (hash, tier, entry) found in the tiers, worth restoring."""
        run = []
        for h, toks in zip(hashes, tokens):
            for t in self.tiers:
                e = t.find(h, toks)
                if e is not None:
                    run.append((h, t, e))
                    break
                t.stats.misses += 1
            else:
                break
        bs = len(tokens[0]) if tokens else 0
        keep = len(run)
        for i, (_, t, _) in enumerate(run):        # a tier's part slower than computing: stop
            if not self._worth_it(t, sum(1 for x in run[i:] if x[1] is t) * bs):
                keep = i
                break
        for _, t, _ in run[keep:]:
            t.stats.skipped_blocks += 1
        return run[:keep]

    def _worth_it(self, tier, num_tokens: int) -> bool:
        bw, rate = self._bandwidth.get(tier.name), self.prompt_tokens_per_s
        if bw is None or rate is None:
            return True                            # not measured yet: try
        return num_tokens / self.block_size * self.block_nbytes / bw < num_tokens / rate

    def begin_restore(self, run: list[tuple[int, object, _Entry]],
                      block_ids: list[int]) -> RestoreJob:
        """Start copying the run's blocks into `block_ids` (fresh pool blocks, as many, which
        the caller holds until `finish_restore`) with their checksums: at once on CPUs, on
        the tiers' stream on CUDA. A block moved or gone meanwhile, or a disk file that
        cannot be read, ends the run there."""
        kv = self._pool()
        copied = []
        with self.copies.batch() as batch:
            for (h, tier, e), b in zip(run, block_ids):
                if tier.index.get(h) is not e:
                    break               # moved or dropped meanwhile (the pool's allocation)
                tier.stats.hits += 1
                data = tier.read(e) if tier is self.host else tier.read(h, e)
                if data is None:
                    break
                kv[:, :, b].copy_(data, non_blocking=True)
                if tier is not self.host:
                    batch.keep(data)    # a disk block's buffer, read by the copy
                copied.append((h, tier, e, b))
            if copied:
                batch.checksums(block_checksums(kv, [b for *_, b in copied]))
        return RestoreJob(copied, batch, list(block_ids))

    def finish_restore(self, job: RestoreJob) -> int:
        """A begun restore whose copies are done (it waits if not): compare each checksum; ->
        how many leading blocks were restored intact. A failed block drops its tier entry and
        ends the run. On CUDA the compute stream's later work waits for the copies."""
        job.wait()
        job.batch.order_compute()
        copied = job.copied
        if not copied:
            return 0
        sums = job.batch.sums()
        good = 0
        for (h, tier, e, b), s in zip(copied, sums):
            if s != e.checksum:
                tier.stats.checksum_failures += 1
                log.warning("KV offload %s tier: block %016x failed its checksum; it and the "
                            "blocks after it are computed", tier.name, h)
                if tier.index.get(h) is e:
                    tier.drop(h)
                break
            good += 1
        seconds = job.batch.seconds()
        by_tier: dict[str, int] = {}
        for h, tier, e, b in copied[:good]:
            tier.stats.restored_blocks += 1
            tier.stats.restored_bytes += self.block_nbytes
            by_tier[tier.name] = by_tier.get(tier.name, 0) + 1
        for tier in self.tiers:
            n = by_tier.get(tier.name, 0)
            if n:
                share = seconds * n / good
                tier.stats.restore_seconds += share
                rate = n * self.block_nbytes / max(share, 1e-9)
                old = self._bandwidth.get(tier.name)
                self._bandwidth[tier.name] = rate if old is None else 0.8 * old + 0.2 * rate
        return good

    def restore(self, run: list[tuple[int, object, _Entry]], block_ids: list[int]) -> int:
        """begin_restore, then finish_restore once its copies are done."""
        return self.finish_restore(self.begin_restore(run, block_ids))


__all__ = ["DiskTier", "HostTier", "KVOffload", "OffloadSettings", "RestoreJob", "TierStats"]
