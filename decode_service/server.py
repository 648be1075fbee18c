"""The decode worker's gRPC services.

Decode(request) is one server stream per request: reserve blocks, answer with their descriptor,
then stream tokens as the engine makes them. The stream's end — finished, cancelled by the
gateway, or broken — always releases the request and its blocks on this worker.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import torch

from engine.async_engine import AsyncEngine
from engine.engine import KVLayout
from engine.request import Request, RequestOutput, TokenLogprob
from kvtransfer import TransferTarget, create_receiver
from kvtransfer.wire import logprob_to_pb, target_to_pb
from pdserve.worker import WorkerIdentity, sampling_from_pb, serve, worker_stats
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class DecodeSink:
    """Where received KV lands: this worker's pool, for blocks reserved by Decode streams."""

    def __init__(self, aengine: AsyncEngine) -> None:
        self.aengine = aengine
        self.layout: KVLayout = aengine.engine.layout
        self.reservations: dict[str, list[int]] = {}

    @property
    def pool(self) -> torch.Tensor:
        return self.aengine.engine.kv

    def reserved_blocks(self, request_id: str) -> list[int] | None:
        """The request's blocks a sender may write: never the shared, cached prefix blocks."""
        return self.reservations.get(request_id)

    def expecting(self) -> bool:
        return bool(self.reservations)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        kv = self.aengine.engine.kv
        kv[:, :, torch.tensor(block_ids, dtype=torch.long)] = data.to(kv.device)

    async def complete(self, request_id: str, first_token: int,
                       first_logprob: TokenLogprob | None) -> None:
        if self.reservations.pop(request_id, None) is not None:
            await self.aengine.remote_ready(request_id, first_token, first_logprob)


def _token_batch(outs: list[RequestOutput]) -> pb.TokenBatch:
    batch = pb.TokenBatch(finish_reason=outs[-1].finish_reason or "")
    for o in outs:
        batch.token_ids.extend(o.new_token_ids)
        batch.logprobs.extend(logprob_to_pb(lp) for lp in o.new_logprobs)
    return batch


class DecodeServicer(pb_grpc.DecodeWorkerServicer):
    def __init__(self, aengine: AsyncEngine, ident: WorkerIdentity, transport: str) -> None:
        self.aengine = aengine
        self.ident = ident
        self.sink = DecodeSink(aengine)
        self.receiver = create_receiver(transport, self.sink, address=ident.address)

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        try:
            req = Request(rid, list(request.prompt_token_ids), sampling_from_pb(request.params),
                          cache_salt=request.cache_salt)
            queue = self.aengine.open_stream(rid)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finished = False
        try:
            if request.local_prefill:
                try:
                    await self.aengine.submit(req)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            else:
                try:
                    blocks = await self.aengine.reserve(req)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                cached = req.num_cached_blocks        # set by the engine thread on reserve
                self.sink.reservations[rid] = blocks[cached:]
                target = TransferTarget(self.receiver.name, self.receiver.address(),
                                        self.ident.id, self.sink.layout, tuple(blocks), cached,
                                        self.receiver.metadata())
                yield pb.DecodeEvent(reservation=target_to_pb(target))
            while not finished:
                outs = [await queue.get()]
                while not queue.empty():               # batch what is already there
                    outs.append(queue.get_nowait())
                errors = [o.error for o in outs if o.error]
                if errors:
                    finished = True
                    await context.abort(grpc.StatusCode.INTERNAL, errors[0])
                finished = outs[-1].finished
                yield pb.DecodeEvent(tokens=_token_batch(outs))
        finally:
            pending = self.sink.reservations.pop(rid, None)
            if pending and self.receiver.one_sided:
                # a one-sided sender may still be writing: keep the blocks out of use
                self.aengine.pin(pending)
                self.receiver.quarantine(rid, pending, self.aengine.unpin)
            if not finished:
                self.aengine.abort_nowait(rid)
            self.aengine.close_stream(rid)

    async def PushKV(self, request_iterator, context):
        return await self.receiver.push_kv(request_iterator, context)

    async def Abort(self, request: pb.AbortRequest, context):
        self.sink.reservations.pop(request.request_id, None)
        return pb.AbortReply(found=await self.aengine.abort(request.request_id))

    async def Stats(self, request, context):
        return worker_stats(self.aengine)

    async def close(self) -> None:
        await self.receiver.close()


def main(args) -> int:
    def add(server, aengine, ident):
        servicer = DecodeServicer(aengine, ident, args.kv_transport)
        pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        return servicer

    asyncio.run(serve(args, "decode", add))
    return 0
