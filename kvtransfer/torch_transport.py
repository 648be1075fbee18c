"""The `torch` transport: torch.distributed point-to-point send/recv, gloo on CPUs, NCCL on GPUs.

Workers come and go, so there is no global process group: each (prefill, decode) pair gets
groups of its own. The decode worker runs a TCPStore (its address is the receiver's address); a
prefill worker that first sends to it takes a channel number from the store (`add`), announces a
channel id under it, and both build the channel's groups (each on a thread of its own: the
rendezvous blocks) over a PrefixStore of that id (prefill rank 0, decode rank 1). The decode
worker listens for announcements on one thread and receives on one thread per channel.

A channel is two groups: `control`, always gloo (host tensors), and `payload`, NCCL when the
pools are on CUDA (device tensors), else the control group itself. One message is a header
[meta bytes, blocks, checksums follow] and the meta (a KVChunk without data: request id, layout,
destination block ids, `last` with the first token), both on the control group, then, if the
header says so, the payload: the blocks' data [layers, 2, blocks, block_size, kv_heads,
head_dim] and their checksums (int64 [blocks], kvtransfer.integrity, computed from the gathered
blocks on the sender's device: no host sync on the way out) unless the sender runs
--kv-checksum off. A channel's messages go out from one thread, in order; messages of several
requests interleave whole. The receiver holds every message to the request's reservation
(kvtransfer.integrity.Intake) before writing and checks the checksums on its pool at the
completion (two-sided: a late message of an aborted request is dropped). A sender that closes
says goodbye (a header of -1), which ends the receiving thread.

Idle channels. Between messages the receiving thread waits for the next header on the control
group, on the host, for as long as the channel stays idle (IDLE): no device operation is posted
meanwhile, so NCCL's watchdog has nothing to time out, and every operation of either group is
posted only once both sides know it is coming and is held to the configured timeout (`timeout_s`,
NCCL's included: a payload that stalls past it trips NCCL's watchdog, which by default ends the
process). A sender that goes away ends the wait (its connections close).

Streams (CUDA). An NCCL operation makes the calling thread's current stream wait for it, and
NCCL's stream waits for that stream's earlier work: every channel thread, sending or receiving,
makes a stream of its own current (kvtransfer.staging.use_own_stream), never the device's
default stream, which the engine computes on, so a decode step never queues behind a receive,
nor a send behind later steps. The sender gathers the blocks (a copy) and their checksums on
the engine thread (`run_on_pool`), on the engine's stream behind the step that wrote them (so
`ready` events are not waited for), and records an event there; the channel's thread makes its
stream wait for that event before it sends, holds the gathered tensors until the send has
completed, and never waits for an NCCL send (`finish` polls the last one's `is_completed()`:
NCCL orders one peer's sends on one stream). The receiver records an event on its stream after
the payload's receives, waits for it there (its own thread, so the engine's stream never waits
for a payload in flight) and hands it to the sink with the data: the engine thread's stream
waits for it on the device (kvtransfer.staging `wait_for`, no host sync) before the copy into
the pool reads the data, whose memory then stays allocated until that copy is done
(record_stream). On CPUs there are no streams and no events: gloo's `wait()` returns once the
bytes are out or in, and the code is the same.

Who may open a channel: the TCPStore has no authentication, so the announcement carries
ClusterAuth.sign of (channel number, channel id) and the receiver builds no group for one
without the deployment's signature. Anyone who reaches the store's port can still read and write
its keys (and disturb rendezvous), and gloo/NCCL connections are not authenticated: keep the
workers on a private network.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import itertools
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import torch
import torch.distributed as dist

from engine.config import DTYPES
from engine.kv_layout import KVLayout
from engine.request import TokenLogprob
from kvtransfer.base import (KVReceiver, KVSender, KVSendStream, KVSink, KVTransferError,
                             TransferTarget, block_bytes, check_layout, poll_until)
from kvtransfer.integrity import Intake, Refused, checksums
from kvtransfer.staging import host_to_device, recorded, use_own_stream, wait_for
from kvtransfer.wire import completion_chunk, first_logprob_of, layout_from_pb, layout_to_pb
from cluster.auth import ClusterAuth
from proto import pdserve_pb2 as pb

log = logging.getLogger(__name__)

HEADER = 3          # int64s: meta length, number of blocks, 1 when checksums follow
MAX_META = 1 << 20  # bytes of one message's meta a receiver accepts
IDLE = datetime.timedelta(days=3650)    # a channel's wait for its next header: while it is idle


def _client(address: str, timeout_s: float) -> dist.TCPStore:
    """A connection of its own to a store (one connection serves one blocking call at a time)."""
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def _announcement(n: int, channel: str) -> dict[str, str]:
    """The fields of a channel announcement that the deployment token signs."""
    return {"purpose": "torch-kv-channel", "n": str(n), "channel": channel}


def _groups(store, channel: str, rank: int, device: torch.device, timeout_s: float):
    """-> (control, payload): the channel's gloo group, and NCCL's for pools on CUDA (else the
    gloo group again); both held to `timeout_s` per operation."""
    prefixed = dist.PrefixStore(f"pdserve/kv/{channel}", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", prefixed), rank, 2, timeout)
    if device.type != "cuda":
        return control, control
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return control, dist.ProcessGroupNCCL(dist.PrefixStore("payload", prefixed), rank, 2,
                                          options)


@dataclass
class Outgoing:
    """One message's tensors (MessageTensors.outgoing)."""

    control: list[torch.Tensor]         # [header, meta bytes], on the host
    payload: list[torch.Tensor]         # [blocks, checksums], or fewer, on the pool's device
    ready: object | None = None         # CUDA: event after the payload, on the engine's stream


class MessageTensors:
    """The tensors of channel messages for pools of `layout` on `device`: what a sender sends and
    what a receiver receives into; headers and metas on the host, payloads on `device`."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = torch.device(device)

    def outgoing(self, meta: bytes, kv: torch.Tensor, src_blocks: list[int],
                 checksum: bool = True) -> Outgoing:
        """[header, meta bytes] and, with src_blocks, kv[:, :, src_blocks] gathered on the device
        (kv: the pool, on `device`) and (checksum) their checksums, computed there; on the
        pool's thread (its current stream: the event `ready` follows them there)."""
        n = len(src_blocks)
        summed = int(checksum and n > 0)
        control = [torch.tensor([len(meta), n, summed], dtype=torch.int64),
                   torch.frombuffer(bytearray(meta), dtype=torch.uint8)]
        payload = []
        if n:
            index = host_to_device(torch.tensor(src_blocks, dtype=torch.long), kv.device)
            payload.append(kv.index_select(2, index))  # [layers, 2, n, bs, heads, head_dim]
        if summed:
            payload.append(checksums(payload[0]))      # int64 [n]
        return Outgoing(control, payload, recorded(self.device) if payload else None)

    def goodbye(self) -> torch.Tensor:
        return torch.tensor([-1, 0, 0], dtype=torch.int64)

    def header(self) -> torch.Tensor:
        return torch.empty(HEADER, dtype=torch.int64)

    def meta(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def sums(self, num_blocks: int) -> torch.Tensor:
        return torch.empty(num_blocks, dtype=torch.int64, device=self.device)

    def data(self, num_blocks: int) -> torch.Tensor:
        lay = self.layout
        return torch.empty((lay.num_layers, 2, num_blocks, lay.block_size, lay.num_kv_heads,
                            lay.head_dim), dtype=DTYPES[lay.dtype], device=self.device)

    @staticmethod
    def read_header(header: torch.Tensor) -> tuple[int, int, bool]:
        """(meta bytes, blocks, checksums follow), once the header's receive has completed."""
        meta_len, n, summed = header.tolist()
        return meta_len, n, summed == 1

    @staticmethod
    def read_meta(meta: torch.Tensor) -> bytes:
        return meta.numpy().tobytes()


class _Channel:
    """Prefill side of one pair's groups: a single thread sends, so messages stay whole."""

    def __init__(self, address: str, sender_id: str, layout: KVLayout, device: torch.device,
                 timeout_s: float, checksum: bool, auth: ClusterAuth):
        self.address = address
        self.sender_id = sender_id
        self.device = device
        self.checksum = checksum
        self.auth = auth
        self.tensors = MessageTensors(layout, device)
        self.timeout_s = timeout_s
        self.control = self.payload = None
        self.pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="kv-send", initializer=use_own_stream, initargs=(device,))
        self.broken: Exception | None = None
        self._sending: list[tuple[object, list[torch.Tensor]]] = []   # NCCL: (work, tensors)

    def _connect(self) -> None:
        """On the channel's thread (the groups' rendezvous blocks until the receiver joins)."""
        self.store = _client(self.address, self.timeout_s)
        n = self.store.add("channels", 1) - 1
        channel = f"{self.sender_id}-{n}"
        signature = self.auth.sign(_announcement(n, channel))
        self.store.set(f"channel/{n}", f"{channel} {signature}")
        self.control, self.payload = _groups(self.store, channel, 0, self.device, self.timeout_s)

    def check(self, work) -> None:
        """Raise the error of a completed payload send, if any (NCCL; gloo's was raised while
        sending, and a second gloo wait() would wait for another send)."""
        if self.device.type == "cuda":
            work.wait()

    def _sent(self) -> bool:
        """Forget the payloads whose sends have completed; -> whether none is in flight."""
        self._sending = [(w, t) for w, t in self._sending if not w.is_completed()]
        return not self._sending

    def close(self) -> None:
        """Tell the receiver this channel ends (its thread returns), on the channel's thread."""
        def goodbye():
            if self.control is not None and self.broken is None:
                self.control.send([self.tensors.goodbye()], 1, 0).wait()
                deadline = time.monotonic() + self.timeout_s
                while not self._sent() and time.monotonic() < deadline:
                    time.sleep(0.001)
        try:
            self.pool.submit(goodbye).result(timeout=self.timeout_s)
        except Exception:
            pass
        self.pool.shutdown(wait=False)

    def message(self, meta: bytes, kv: torch.Tensor, src_blocks: list[int]) -> Outgoing:
        """One message's tensors, the blocks gathered from the pool: on the pool's thread."""
        return self.tensors.outgoing(meta, kv, src_blocks, self.checksum)

    def send(self, message: Outgoing):
        """One message, on the channel's thread: its header and meta, waited for until they are
        out; then its payload once the engine's stream has computed it, not waited for on
        NCCL (gloo: until out). -> the work of the payload's last send, or None."""
        if self.control is None:
            self._connect()
        for tensor in message.control:
            self.control.send([tensor], 1, 0).wait()
        if not message.payload:
            return None
        wait_for(message.ready)                 # this thread's stream, not the engine's
        for tensor in message.payload:
            work = self.payload.send([tensor], 1, 0)
            if self.device.type != "cuda":
                work.wait()
        self._sent()
        if self.device.type == "cuda":
            self._sending.append((work, message.payload))
        return work


class _TorchSendStream(KVSendStream):
    """`ready` is not waited for: the gather (on the pool's thread: run_on_pool) is ordered
    behind the step on the engine's stream; the channel's thread sends the gathered copy."""

    def __init__(self, sender: "TorchKVSender", channel: _Channel, request_id: str,
                 kv: torch.Tensor, target: TransferTarget) -> None:
        self.sender = sender
        self.channel = channel
        self.request_id = request_id
        self.kv = kv
        self.target = target
        self._last = None                  # the work of the last payload send

    async def _message(self, msg: pb.KVChunk, src_blocks: list[int]) -> None:
        ch = self.channel
        if ch.broken is not None:
            raise KVTransferError(f"torch.distributed channel to {ch.address} is broken: "
                                  f"{ch.broken}")
        try:
            message = await self.sender.run_on_pool(ch.message, msg.SerializeToString(),
                                                    self.kv, src_blocks)
            work = await asyncio.get_running_loop().run_in_executor(ch.pool, ch.send, message)
        except Exception as exc:
            raise self._broken(exc) from exc
        if work is not None:
            self._last = work

    def _broken(self, exc: Exception) -> KVTransferError:
        """Retire the channel after `exc`; -> the error to raise."""
        ch = self.channel
        ch.broken = exc
        self.sender.drop(ch)
        return KVTransferError(f"torch.distributed send to {ch.address} failed: {exc}")

    async def _sent(self) -> None:
        """Until the last payload send has completed (on the device too); header and meta
        sends were waited for."""
        work = self._last
        if work is None:
            return
        await poll_until(work.is_completed, self.sender.timeout_s,
                         lambda: f"torch.distributed send to {self.channel.address} did not "
                                 "complete")
        try:
            self.channel.check(work)
        except Exception as exc:
            raise self._broken(exc) from exc

    def _chunk(self, dst_blocks) -> pb.KVChunk:
        return pb.KVChunk(request_id=self.request_id, layout=layout_to_pb(self.sender.layout),
                          block_ids=list(dst_blocks))

    async def send(self, src_blocks: list[int], dst_blocks: list[int],
                   ready: object | None = None) -> None:
        await self._message(self._chunk(dst_blocks), list(src_blocks))

    async def finish(self, first_token: int, first_logprob: TokenLogprob | None,
                     src_blocks: list[int] = (), dst_blocks: list[int] = (),
                     ready: object | None = None) -> None:
        msg = completion_chunk(self.request_id, self.sender.layout, first_token, first_logprob,
                               dst_blocks)
        await self._message(msg, list(src_blocks))
        await self._sent()


class TorchKVSender(KVSender):
    name = "torch"

    def __init__(self, layout: KVLayout, kv: torch.Tensor, timeout_s: float = 30.0,
                 checksum: bool = True, run_on_pool: Callable[..., Awaitable] | None = None,
                 auth: ClusterAuth | None = None) -> None:
        """checksum: send the blocks' checksums (--kv-checksum); run_on_pool: KVSender's;
        auth: the deployment token its channels announce themselves with (None: open)."""
        super().__init__(run_on_pool)
        self.layout = layout
        self.device = kv.device
        self.timeout_s = timeout_s
        self.checksum = checksum
        self.auth = auth or ClusterAuth()
        self.id = f"{socket.gethostname()}-{os.getpid()}-{id(self):x}"
        self._channels: dict[str, _Channel] = {}

    def drop(self, channel: _Channel) -> None:
        if self._channels.get(channel.address) is channel:
            del self._channels[channel.address]
        channel.pool.shutdown(wait=False)

    def open(self, request_id: str, kv: torch.Tensor, target: TransferTarget) -> KVSendStream:
        check_layout(self.layout, target.layout)
        if kv.device != self.device:
            raise KVTransferError(f"the torch sender's channels are on {self.device}, the pool "
                                  f"on {kv.device}")
        ch = self._channels.get(target.address)
        if ch is None:
            ch = _Channel(target.address, self.id, self.layout, self.device, self.timeout_s,
                          self.checksum, self.auth)
            self._channels[target.address] = ch
        return _TorchSendStream(self, ch, request_id, kv, target)

    async def close(self) -> None:
        for ch in list(self._channels.values()):
            del self._channels[ch.address]
            await asyncio.to_thread(ch.close)


class TorchKVReceiver(KVReceiver):
    """Owns the TCPStore senders meet at; one receive thread per channel. checksum: require
    the senders' checksums and verify them (--kv-checksum); auth: the deployment token a
    channel must announce itself with (None: an open deployment)."""

    name = "torch"

    def __init__(self, sink: KVSink, address: str, timeout_s: float = 30.0,
                 checksum: bool = True, auth: ClusterAuth | None = None) -> None:
        self.sink = sink
        self.timeout_s = timeout_s
        self.intake = Intake(sink, checksum)
        self.block_bytes = block_bytes(sink.layout)
        self.auth = auth or ClusterAuth()
        self.loop = asyncio.get_running_loop()
        host = address.rsplit(":", 1)[0]
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        self._address = f"{host}:{self.store.port}"
        self.layout = sink.layout
        self.tensors = MessageTensors(sink.layout, sink.pool.device)
        self._next = 0
        self._closed = threading.Event()
        self._groups: list[tuple] = []               # (control, payload) per channel
        self._threads: list[threading.Thread] = []
        self._idle: set[threading.Thread] = set()    # waiting for a header
        threading.Thread(target=self._accept, name="kv-accept", daemon=True).start()

    def address(self) -> str:
        return self._address

    def _accept(self) -> None:
        store = _client(self._address, self.timeout_s)
        for n in itertools.count():
            self._next = n
            announced = None
            while announced is None and not self._closed.is_set():
                try:
                    announced = store.get(f"channel/{n}").decode()
                except Exception:          # the store's wait timed out: keep listening
                    continue
            if self._closed.is_set():
                return
            channel, _, signature = announced.partition(" ")
            if not self.auth.verify(_announcement(n, channel), signature):
                log.warning("torch.distributed channel %d: announcement without the "
                            "deployment's signature refused", n)
                continue
            thread = threading.Thread(target=self._receive, args=(channel,),
                                      name=f"kv-recv-{n}", daemon=True)
            self._threads.append(thread)
            thread.start()

    def _receive(self, channel: str) -> None:
        device = self.tensors.device
        try:
            use_own_stream(device)
            groups = _groups(_client(self._address, self.timeout_s), channel, 1, device,
                             self.timeout_s)
        except Exception:
            log.exception("torch.distributed channel %s: group setup failed", channel)
            return
        self._groups.append(groups)
        while not self._closed.is_set():
            try:
                message = self._next_message(*groups)
            except Exception as exc:      # the sender went away (or timed out): end the channel
                if self._closed.is_set():
                    return
                log.info("torch.distributed channel %s closed: %s", channel, exc)
                return
            if message is None or self._closed.is_set():   # the sender closed the channel
                return
            try:
                asyncio.run_coroutine_threadsafe(self._land(*message), self.loop).result()
            except Exception:   # one request's failure must not end the channel's thread
                log.exception("torch.distributed channel %s: a message could not be landed",
                              channel)

    def _next_message(self, control, payload):
        """-> (meta chunk, data on the pool's device or None, the claimed checksums, the event
        after the data's receive or None), or None at the sender's goodbye. Waits for the
        header as long as the channel is idle, on the host (see the module's docstring)."""
        tensors = self.tensors
        header = tensors.header()
        thread = threading.current_thread()
        self._idle.add(thread)
        try:
            control.recv([header], 0, 0).wait(IDLE)
        finally:
            self._idle.discard(thread)
        meta_len, n, summed = tensors.read_header(header)
        if meta_len < 0:
            return None
        if not 0 < meta_len <= MAX_META or not 0 <= n <= self.sink.pool.shape[2]:
            raise KVTransferError(f"bad message header: {meta_len} meta bytes, {n} blocks")
        meta = tensors.meta(meta_len)
        control.recv([meta], 0, 0).wait()
        data = sums = ready = None
        if n:
            data = tensors.data(n)
            payload.recv([data], 0, 0).wait()    # gloo: received; NCCL: this thread's stream
            if summed:                           # waits for it
                sums = tensors.sums(n)
                payload.recv([sums], 0, 0).wait()
            ready = recorded(tensors.device)
            if ready is not None:      # this thread waits for the payload, not the engine's
                ready.synchronize()    # stream: the sink's wait for `ready` costs it nothing
        chunk = pb.KVChunk.FromString(tensors.read_meta(meta))
        return chunk, data, sums.tolist() if sums is not None else [], ready

    async def _land(self, chunk: pb.KVChunk, data: torch.Tensor | None, claimed: list[int],
                    ready: object | None) -> None:
        """A message is checked before its blocks are written; a request whose transfer breaks
        a rule is rejected (the sink fails it or computes it); one without a reservation (aborted
        meanwhile, or not ours) is dropped."""
        try:
            check_layout(self.layout, layout_from_pb(chunk.layout))
        except KVTransferError as exc:
            log.warning("request %s: %s", chunk.request_id, exc)
            return
        n = 0 if data is None else data.shape[2]
        try:
            ids = self.intake.admit(chunk.request_id, chunk.block_ids, n * self.block_bytes,
                                    claimed)
            if ids:
                await self.sink.write(chunk.request_id, ids, data, ready)
            if chunk.last:
                await self.intake.complete(chunk.request_id, chunk.first_token_id,
                                           first_logprob_of(chunk))
        except Refused as exc:
            if exc.kind != "unknown":
                log.warning("%s", exc)
            await self.intake.reject(exc)

    async def close(self) -> None:
        """Ends the channels' threads, at most a few seconds for those mid-message; a thread
        waiting for a header returns at its sender's goodbye or when the sender goes away
        (a pending gloo receive cannot be cancelled), landing nothing more."""
        self._closed.set()
        self.store.set(f"channel/{self._next}", "")      # wakes the accept thread: it returns
        for group in {g for pair in self._groups for g in pair}:
            try:                       # NCCL: ends receives in flight from a sender that
                group.abort()          # stopped mid-message
            except Exception:
                pass
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and any(
                t.is_alive() and t not in self._idle for t in self._threads):
            await asyncio.sleep(0.01)
