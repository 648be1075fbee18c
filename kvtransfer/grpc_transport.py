"""The portable KV transport: a gRPC stream of KVChunk messages into DecodeWorker.PushKV; the
receiver answers on the same stream (a refusal, said before the call ends, or the count).

Each message carries up to `blocks_per_message` blocks of every layer, so memory stays bounded
for long prompts; messages go out as the prefill worker's chunks finish, and the last one carries
the first token. The decode worker serves PushKV on its
ordinary gRPC port, so the receiver's address is the worker's address.

Blocks cross the host on both sides through kvtransfer.staging. The sender's engine thread only
queues work: one command per send (`run_on_pool`, between steps, on the stream the engine computes
on, behind the step that wrote the blocks, so `ready` events are not waited for; on CPUs a worker
thread at once: AsyncEngine.read_blocks) gathers the blocks into a copy of the sender's own (which
is what frees the pool's blocks for a `save_done` queued after it) and, on CUDA, computes their
checksums there and queues their copy into page-locked host memory on a copy stream; the sender's
own thread waits for that copy's event (on CPUs: computes the checksums of the gathered copy) and
serializes each message, the blocks' bytes written once, from host memory straight into the encoded
message (kvtransfer.wire.chunk_bytes), which the call sends as it is. The decode engine's sink
(kvtransfer.connector) copies received bytes back to its device through staging too.

Integrity: each message carries the checksums of its blocks (kvtransfer.integrity), computed on
the sender's device from the gathered blocks (CUDA: queued behind the gather and copied back with
the blocks; CPUs: on the sender's thread, from its gathered copy); the receiver holds every
message to the request's reservation (kvtransfer.integrity.Intake) before writing, and checks the
checksums on its pool once the last message is in. Calls carry the deployment token
(cluster.auth), which the worker's server checks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Awaitable, Callable

import grpc
import torch

from engine.kv_layout import KVLayout
from engine.request import TokenLogprob
from kvtransfer.base import (KVReceiver, KVSender, KVSendStream, KVSink, KVTransferError,
                             LayoutMismatch, TransferTarget, block_bytes, check_layout)
from kvtransfer.integrity import Intake, Refused, checksums
from kvtransfer.staging import Gathered, HostStaging
from kvtransfer.wire import (chunk_bytes, completion_chunk, first_logprob_of, layout_from_pb,
                             layout_to_pb, tensor_from_bytes)
from cluster.auth import ClusterAuth
from proto import pdserve_pb2 as pb

MAX_MESSAGE = 256 << 20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE),
                   ("grpc.max_receive_message_length", MAX_MESSAGE)]
# The receiver's initial metadata on a PushKV call it took (the sender writes only then).
ACCEPTED = ("x-pdserve-kv-accepted", "1")
# How long a refused call keeps reading what its sender wrote before the refusal reached it.
REFUSAL_DRAIN_S = 5.0
PUSH_KV = f"/{pb.DESCRIPTOR.services_by_name['DecodeWorker'].full_name}/PushKV"


class _GrpcSendStream(KVSendStream):
    """A PushKV client stream of encoded KVChunk messages fed from a queue; each send() queues
    its blocks as messages of at most `blocks_per_message` blocks."""

    def __init__(self, sender: "GrpcKVSender", request_id: str, kv: torch.Tensor,
                 target: TransferTarget) -> None:
        self.request_id = request_id
        self.kv = kv
        self.target = target
        self.step = sender.blocks_per_message
        self.staging = sender.staging(kv.device)
        self.digest = checksums if sender.checksum else None
        self.run_on_pool = sender.run_on_pool
        self.thread = sender.thread
        self.sender_layout = sender.layout
        self.layout = layout_to_pb(sender.layout)
        self.block_bytes = block_bytes(sender.layout)
        self._out: asyncio.Queue = asyncio.Queue()
        self._refusal: pb.PushKVReply | None = None
        self.timeout_s = sender.timeout_s
        # no deadline on the call: it lasts as long as the prefill; the tail is bounded in finish
        self._call = sender._push(target.address)(self._messages())
        self._result = asyncio.ensure_future(self._finish_call())

    async def _messages(self):
        # Nothing is written before the receiver has accepted the call (its initial metadata
        # carries ACCEPTED): a call refused at once (a wrong token) ends with no write, so the
        # sender sees the receiver's status. A write racing that end would turn the status
        # into INTERNAL "Internal error from Core" (gRPC Python's asyncio client,
        # grpc/grpc#36066). A refusal later on is said in a reply first (_finish_call): the
        # writes stop there, and the messages still queued are dropped.
        try:
            metadata = await self._call.initial_metadata()
        except grpc.aio.AioRpcError:
            return                              # the call's status says why (_finish_call)
        if ACCEPTED not in tuple(metadata or ()):
            return                              # refused: trailers only, the status follows
        while (msg := await self._out.get()) is not None and self._refusal is None:
            yield msg

    async def _finish_call(self) -> pb.PushKVReply:
        """The receiver's final reply; raises KVTransferError with its refusal's code and
        message (said in the stream, so never lost to a status that became INTERNAL), or with
        the call's status."""
        try:
            reply = None
            while (msg := await self._call.read()) is not grpc.aio.EOF:
                reply = msg
                if msg.refused_code:
                    self._refusal = msg
                    self._out.put_nowait(None)          # the writer stops: half-close
            if self._refusal is None:
                return reply
        except grpc.aio.AioRpcError as exc:
            if self._refusal is None:
                raise KVTransferError(f"KV push to {self.target.address} failed: "
                                      f"{exc.code().name}: {exc.details()}") from None
        raise self._refused()

    def _refused(self) -> KVTransferError:
        code = _CODES.get(self._refusal.refused_code, grpc.StatusCode.UNKNOWN)
        return KVTransferError(f"KV push to {self.target.address} refused: {code.name}: "
                               f"{self._refusal.refused_message}", refused=True)

    def _failed(self) -> None:
        if self._refusal is not None:       # stop at once, while the call ends
            raise self._refused()
        if self._result.done():
            self._result.result()           # raises the call's error

    async def send(self, src_blocks: list[int], dst_blocks: list[int],
                   ready: object | None = None) -> None:
        """Queues the blocks' messages: staging buffers reserved and, once the pool's thread
        has queued the gathers and copies (run_on_pool, one command), each message waited for
        and encoded on the sender's thread. `ready` is not waited for: the gathers are ordered
        behind the step on the engine's stream."""
        self._failed()
        starts = range(0, len(src_blocks), self.step)
        pieces = [list(src_blocks[i:i + self.step]) for i in starts]
        if not pieces:
            return
        loop = asyncio.get_running_loop()
        buffers = await loop.run_in_executor(
            self.thread, lambda: [self.staging.reserve(len(p) * self.block_bytes)
                                  for p in pieces])
        gathered = await self.run_on_pool(self._gather, pieces, buffers)   # one engine command
        for i, g in zip(starts, gathered):
            self._out.put_nowait(await loop.run_in_executor(
                self.thread, self._encode, g, list(dst_blocks[i:i + self.step])))

    def _gather(self, pieces: list[list[int]], buffers: list) -> list[Gathered]:
        """On the pool's thread: gathers (and on CUDA digests and copies to the host) queued."""
        return [self.staging.gather(self.kv, src, self.digest, buf)
                for src, buf in zip(pieces, buffers)]

    def _encode(self, gathered: Gathered, dst_blocks: list[int]) -> bytes:
        """On the sender's thread: one message, once its blocks are on the host."""
        with gathered.on_host() as (data, sums):
            head = pb.KVChunk(request_id=self.request_id, layout=self.layout,
                              block_ids=dst_blocks, checksums=sums)
            return chunk_bytes(head, data.numpy())

    async def finish(self, first_token: int, first_logprob: TokenLogprob | None,
                     src_blocks: list[int] = (), dst_blocks: list[int] = (),
                     ready: object | None = None) -> None:
        if src_blocks:
            await self.send(list(src_blocks), list(dst_blocks))
        self._out.put_nowait(completion_chunk(self.request_id, self.sender_layout, first_token,
                                              first_logprob).SerializeToString())
        self._out.put_nowait(None)
        try:
            await asyncio.wait_for(asyncio.shield(self._result), self.timeout_s)
        except asyncio.TimeoutError:
            raise KVTransferError(f"KV push to {self.target.address} did not complete within "
                                  f"{self.timeout_s:g} s of the last block") from None

    async def abort(self) -> None:
        self._call.cancel()
        self._result.cancel()
        with contextlib.suppress(asyncio.CancelledError, KVTransferError):
            await self._result


class GrpcKVSender(KVSender):
    name = "grpc"

    def __init__(self, layout: KVLayout, kv: torch.Tensor | None = None,
                 blocks_per_message: int = 16, timeout_s: float = 600.0,
                 checksum: bool = True, run_on_pool: Callable[..., Awaitable] | None = None,
                 auth: ClusterAuth | None = None) -> None:
        """kv: the pool blocks will be sent from (its device picks the staging memory);
        checksum: send the blocks' checksums (--kv-checksum); run_on_pool: KVSender's; auth:
        the deployment token its channels carry (None: an open deployment)."""
        super().__init__(run_on_pool)
        self.layout = layout
        self.checksum = checksum
        self.auth = auth or ClusterAuth()
        self._staging: dict[torch.device, HostStaging] = {}
        if kv is not None:
            self.staging(kv.device)
        self.blocks_per_message = blocks_per_message
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        # the sender's own thread: waits for copies to the host, encodes messages
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-grpc")

    def _push(self, address: str):
        """DecodeWorker.PushKV on `address`, for messages encoded already (chunk_bytes)."""
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = self.auth.channel(address, CHANNEL_OPTIONS)
        return ch.stream_stream(PUSH_KV, request_serializer=None,
                                response_deserializer=pb.PushKVReply.FromString)

    def staging(self, device: torch.device) -> HostStaging:
        """The staging of pools on `device` (one per device, reused by every stream)."""
        if device not in self._staging:
            self._staging[device] = HostStaging(device)
        return self._staging[device]

    def open(self, request_id: str, kv: torch.Tensor, target: TransferTarget) -> KVSendStream:
        check_layout(self.layout, target.layout)
        return _GrpcSendStream(self, request_id, kv, target)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self.thread.shutdown(wait=False)


class GrpcKVReceiver(KVReceiver):
    """Serves the body of DecodeWorker.PushKV; the decode servicer delegates to `push_kv`.
    checksum: require the senders' checksums and verify them (--kv-checksum). The token of
    `auth` is checked by the server PushKV runs on (`auth.server_interceptors()`), before a
    message reaches this receiver."""

    name = "grpc"

    def __init__(self, sink: KVSink, address: str, checksum: bool = True,
                 auth: ClusterAuth | None = None) -> None:
        self.auth = auth or ClusterAuth()
        self.sink = sink
        self._address = address
        self.intake = Intake(sink, checksum)

    def address(self) -> str:
        return self._address

    async def push_kv(self, requests, context: grpc.aio.ServicerContext) -> None:
        """Each message is checked before any of its bytes are written; a request whose
        transfer breaks a rule is rejected (the sink fails it or computes it) and the call ends
        with INVALID_ARGUMENT (DATA_LOSS for corrupted KV, NOT_FOUND without a reservation,
        FAILED_PRECONDITION for another layout), said first in a reply (`_refuse`)."""
        received = 0
        await context.send_initial_metadata((ACCEPTED,))   # the sender may write now
        async for chunk in requests:
            try:
                check_layout(self.sink.layout, layout_from_pb(chunk.layout))
            except LayoutMismatch as exc:
                await _refuse(requests, context, grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            try:
                ids = self.intake.admit(chunk.request_id, chunk.block_ids, len(chunk.data),
                                        chunk.checksums)
                if ids:
                    data = tensor_from_bytes(chunk.data, self.sink.layout, len(ids))
                    await self.sink.write(chunk.request_id, ids, data)
                    received += len(ids)
                if chunk.last:
                    await self.intake.complete(chunk.request_id, chunk.first_token_id,
                                               first_logprob_of(chunk))
            except Refused as exc:
                await self.intake.reject(exc)
                await _refuse(requests, context, _STATUS[exc.kind], str(exc))
        await context.write(pb.PushKVReply(blocks_received=received))


async def _refuse(requests, context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                  message: str) -> None:
    """End a PushKV call with `code`: said in a reply first, so the sender stops writing and
    half-closes; what it had sent meanwhile is read and dropped (at most REFUSAL_DRAIN_S), and
    only then does the status go out, with no write of the sender's left to race it."""
    await context.write(pb.PushKVReply(refused_code=code.value[0], refused_message=message))

    async def drain():
        async for _ in requests:
            pass
    with contextlib.suppress(asyncio.TimeoutError, grpc.aio.AioRpcError):
        await asyncio.wait_for(drain(), REFUSAL_DRAIN_S)
    await context.abort(code, message)


_STATUS = {"unknown": grpc.StatusCode.NOT_FOUND, "invalid": grpc.StatusCode.INVALID_ARGUMENT,
           "checksum": grpc.StatusCode.DATA_LOSS}
_CODES = {c.value[0]: c for c in grpc.StatusCode}
