"""The KV transfer contract.

Sender side (prefill): `stream = sender.open(request_id, kv, target)` starts one request's
transfer into the decode worker's reserved blocks; `await stream.send(src_blocks, dst_blocks,
ready)` moves blocks of the pool tensor `kv[layer, k_or_v, block, ...]` as soon as their KV is
final (one call per prefill chunk, so the transfer overlaps the computation of the next chunk); it
may return before the bytes have moved, so the caller keeps every sent source block unchanged
(pinned) until `finish` or `abort` returns; `await stream.finish(first_token, first_logprob,
src_blocks, dst_blocks, ready)` sends the last blocks, waits until the receiver has every block
and delivers the first token; `await stream.abort()` gives up. Blocks the decode worker already
holds (`target.num_cached_blocks`, its prefix cache) are never sent. Failures raise
KVTransferError.

ready: blocks' KV is final once this device event has completed; None: final already. It is the
engine's `RequestOutput.kv_ready` (a torch.cuda.Event recorded after the step that wrote the
blocks: `query()`, `synchronize()`). A transport that reads the blocks on the stream the engine
computes on (the device's default stream) is ordered behind that step and may ignore it; one that
reads them outside that stream (a one-sided WRITE) must not start before `ready.query()` is True,
and waits for it without blocking the event loop (`poll_until`) and without a device-wide sync.

Receiver side (decode): a KVReceiver lands arriving blocks through a `KVSink`, the worker side of
the decode engine's KV connector (kvtransfer.connector): it knows which blocks each request
reserved, writes into its pool on the engine thread, and is told when a request's transfer is
complete, or that it is unusable (`reject`). Receivers trust nothing
they receive: kvtransfer.integrity.Intake holds every piece to the request's reservation, the
layout's sizes and the sender's checksums before a request may run.

Both sides check the KV layout (dtype, block size, layers, KV heads, head size) before any byte
moves, and refuse a mismatch with a message naming the differing fields.
"""

from __future__ import annotations

import abc
import asyncio
import importlib
import time
from dataclasses import asdict, dataclass, fields
from typing import Awaitable, Callable, Protocol

import torch

from engine.config import DTYPES
from engine.kv_layout import KVLayout
from engine.request import TokenLogprob
from cluster.auth import ClusterAuth


class KVTransferError(RuntimeError):
    """A transfer failed. `refused`: the receiver refused it (no reservation any more, a broken
    rule, corrupted KV): it has given up on this KV, so sending more is pointless."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class LayoutMismatch(KVTransferError):
    pass


def check_layout(ours: KVLayout, theirs: KVLayout) -> None:
    """LayoutMismatch unless the blocks mean the same on both sides (tensor-parallel sizes may
    differ: blocks cross with every head, each side maps them to its ranks)."""
    if ours != theirs:
        a, b = asdict(ours), asdict(theirs)
        shared = [f.name for f in fields(KVLayout) if f.compare]
        diff = ", ".join(f"{k}: ours {a[k]} vs theirs {b[k]}" for k in shared if a[k] != b[k])
        raise LayoutMismatch(f"KV layout mismatch ({diff}); start both workers with the same "
                             "model, --dtype and --block-size")


async def poll_until(done: Callable[[], bool], timeout_s: float, what: Callable[[], str],
                     first_s: float = 0.0002, max_s: float = 0.005) -> None:
    """Return once `done()` is true, asking now and then after pauses doubling from `first_s` to
    `max_s` (polling takes the GIL from the engine thread: back off); never blocks the loop.
    KVTransferError(`what()` + " within ... s") once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    pause = first_s
    while not done():
        if time.monotonic() > deadline:
            raise KVTransferError(f"{what()} within {timeout_s:g} s")
        await asyncio.sleep(pause)
        pause = min(pause * 2, max_s)


def block_bytes(layout: KVLayout) -> int:
    """Bytes of one block across all layers, K and V."""
    elem = torch.empty((), dtype=DTYPES[layout.dtype]).element_size()
    return 2 * layout.num_layers * layout.block_size * layout.num_kv_heads * layout.head_dim * elem


@dataclass(frozen=True)
class TransferTarget:
    """Where a request's KV goes: reserved blocks on a decode worker."""

    transport: str
    address: str
    engine_id: str
    layout: KVLayout
    block_ids: tuple[int, ...]
    num_cached_blocks: int = 0    # leading blocks the decode worker holds already: not sent
    metadata: bytes = b""         # transport-specific (KVReceiver.metadata())

    @property
    def missing(self) -> tuple[int, ...]:
        return self.block_ids[self.num_cached_blocks:]


class KVSink(Protocol):
    """Where received KV lands (the worker side of the KV connector: kvtransfer.connector for a
    decode engine, kvtransfer.loopback's MemorySink without one); called by receivers on the
    decode worker's loop. Receivers never write the pool themselves: they hand the sink what
    they received, and the sink copies it in only while the blocks are the request's."""

    layout: KVLayout
    vocab_size: int               # first tokens outside [0, vocab_size) are refused

    def reserved_blocks(self, request_id: str) -> list[int] | None:
        """Blocks a sender may write for the request, or None if it is not (or no longer)
        expected."""

    def expecting(self) -> bool:
        """Whether some request is waiting for its KV (or blocks are kept aside) now."""

    async def write(self, request_id: str, block_ids: list[int], data: torch.Tensor,
                    ready: object | None = None) -> None:
        """data: [num_layers, 2, len(block_ids), block_size, kv_heads, head_dim], on the host
        (built from message bytes) or on the pool's device (an NCCL receive, on the receiving
        thread's own stream: complete once the CUDA event `ready` has, which the copy's stream
        waits for on the device, never the host). Copied into the pool if the blocks are still
        the request's to receive; may return once the copy is queued (the request's completion
        is ordered behind it). `data` is not reused by the caller afterwards."""

    @property
    def pool(self) -> torch.Tensor:
        """The KV pool, for a one-sided receiver's registration (its senders write it)."""

    async def complete(self, request_id: str, first_token: int,
                       first_logprob: TokenLogprob | None, block_ids: list[int],
                       claimed: list[int] | None) -> tuple[str, str] | None:
        """All blocks written (`block_ids`, with the sender's checksums `claimed`; None: not
        checked): check them on the pool and let the request start decoding. None when done
        (or the request is gone), else (kind, why) the KV is refused: kind "checksum"
        (corrupted) or "invalid" (a write failed); then `reject` it."""

    async def reject(self, request_id: str, message: str, kind: str) -> None:
        """The request's KV is unusable (kind "invalid": a transfer that broke a rule;
        "checksum": corrupted KV): end its reservation; the decode service fails the request
        with `message` or computes its prompt itself. Called once the sender has stopped writing
        the request's blocks (two-sided transports write only through the sink; a one-sided one
        rejects at the completion notice, which follows its last write)."""

    def sender_done(self, request_id: str) -> None:
        """A one-sided sender says it has stopped writing the request's blocks (completion or
        abort notice): blocks kept aside for it may be reused."""


class KVSendStream(abc.ABC):
    """One request's transfer, prefill side. Calls come from one task, in order.

    ready: blocks' KV is final once this device event has completed; None: final already (see
    the module's docstring for who may ignore it)."""

    @abc.abstractmethod
    async def send(self, src_blocks: list[int], dst_blocks: list[int],
                   ready: object | None = None) -> None:
        """Start moving src_blocks into dst_blocks (pairwise); may return before they moved."""

    @abc.abstractmethod
    async def finish(self, first_token: int, first_logprob: TokenLogprob | None,
                     src_blocks: list[int] = (), dst_blocks: list[int] = (),
                     ready: object | None = None) -> None:
        """Send the last blocks (if any) and the first token; wait until the receiver has all."""

    async def abort(self) -> None:
        pass


async def _in_thread(fn: Callable, *args):
    return await asyncio.to_thread(fn, *args)


class KVSender(abc.ABC):
    name: str

    def __init__(self, run_on_pool: Callable[..., Awaitable] | None = None) -> None:
        """How the sender reads the pool (gathers, checksums): `await run_on_pool(fn, *args)`
        runs fn(*args) where it may read blocks the connector holds for the transfer. The
        prefill service passes its engine's (AsyncEngine.read_blocks: on a device between
        steps on the engine thread, on a CPU at once on a worker thread); a read the sender
        awaited has returned before the connector's references go back (on a CPU, one left
        running by a cancelled call may read blocks already given back: its result is
        dropped). Without one (benchmarks, tests), a worker thread."""
        self.run_on_pool = run_on_pool or _in_thread

    @abc.abstractmethod
    def open(self, request_id: str, kv: torch.Tensor, target: TransferTarget) -> KVSendStream:
        """Start a transfer; checks the layout first (LayoutMismatch)."""

    async def send(self, request_id: str, kv: torch.Tensor, src_blocks: list[int],
                   target: TransferTarget, first_token: int,
                   first_logprob: TokenLogprob | None, ready: object | None = None) -> None:
        """The whole transfer at once: `src_blocks` pair with `target.missing`; `ready` as in
        KVSendStream."""
        if len(src_blocks) != len(target.missing):
            raise KVTransferError(f"request {request_id}: {len(src_blocks)} source blocks for "
                                  f"{len(target.missing)} destination blocks")
        stream = self.open(request_id, kv, target)
        try:
            await stream.finish(first_token, first_logprob, src_blocks, list(target.missing),
                                ready)
        except BaseException:
            await stream.abort()
            raise

    async def close(self) -> None:
        pass


class KVReceiver(abc.ABC):
    name: str
    # One-sided transports write into the pool without the receiver's involvement: blocks of a
    # request aborted mid-transfer must stay out of use until the sender is done, at most
    # lease_s (the connector keeps them aside; KVSink.sender_done ends that).
    one_sided = False
    lease_s = 60.0

    @abc.abstractmethod
    def address(self) -> str:
        """Endpoint senders use to reach this receiver."""

    def metadata(self) -> bytes:
        """Transport-specific bytes every TransferTarget of this receiver carries."""
        return b""

    async def close(self) -> None:
        pass


# name -> "module:SenderClass:ReceiverClass"; modules are imported only when chosen.
_TRANSPORTS: dict[str, str] = {
    "grpc": "kvtransfer.grpc_transport:GrpcKVSender:GrpcKVReceiver",
    "nixl": "kvtransfer.nixl_transport:NixlKVSender:NixlKVReceiver",
    "torch": "kvtransfer.torch_transport:TorchKVSender:TorchKVReceiver",
}


def register_transport(name: str, spec: str) -> None:
    """Register a transport as "module:SenderClass:ReceiverClass" (imported lazily)."""
    if spec.count(":") != 2:
        raise ValueError(f"transport spec must be 'module:Sender:Receiver', got {spec!r}")
    _TRANSPORTS[name] = spec


def transports() -> list[str]:
    return sorted(_TRANSPORTS)


def _load(name: str, which: int):
    if name not in _TRANSPORTS:
        raise ValueError(f"unknown KV transport {name!r}; known: {transports()}")
    module, *classes = _TRANSPORTS[name].split(":")
    return getattr(importlib.import_module(module), classes[which])


def create_sender(name: str, layout: KVLayout, run_on_pool: Callable | None = None,
                  auth: ClusterAuth | None = None, **kw) -> KVSender:
    """The sender of transport `name`; `run_on_pool` as in KVSender; `auth`: the deployment
    token its connections carry (None: an open deployment)."""
    return _load(name, 0)(layout=layout, run_on_pool=run_on_pool, auth=auth, **kw)


def create_receiver(name: str, sink: KVSink, auth: ClusterAuth | None = None,
                    **kw) -> KVReceiver:
    """The receiver of transport `name`; `auth`: the deployment token senders must hold."""
    return _load(name, 1)(sink=sink, auth=auth, **kw)
