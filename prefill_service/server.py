"""The prefill worker's gRPC services.

Prefill(request): queue the prompt in the engine (prefill role: it finishes after the first
token and keeps its blocks; blocks of a cached prefix are reused), push the KV blocks the decode
worker lacks into its reserved blocks over the chosen transport, then free them (hashed blocks stay
cached until evicted). Cancellation or any failure frees them too.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from engine.async_engine import AsyncEngine
from engine.request import Request
from kvtransfer import KVTransferError, LayoutMismatch, check_layout, create_sender
from kvtransfer.wire import target_from_pb
from pdserve.worker import WorkerIdentity, sampling_from_pb, serve, worker_stats
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class PrefillServicer(pb_grpc.PrefillWorkerServicer):
    def __init__(self, aengine: AsyncEngine, ident: WorkerIdentity, transport: str) -> None:
        self.aengine = aengine
        self.ident = ident
        self.layout = aengine.engine.layout
        self.sender = create_sender(transport, self.layout)

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        try:
            target = target_from_pb(request.destination)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if target.transport != self.sender.name:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"decode worker wants KV transport {target.transport!r}; this "
                                f"prefill worker runs {self.sender.name!r}")
        try:
            check_layout(self.layout, target.layout)
            req = Request(rid, list(request.prompt_token_ids), sampling_from_pb(request.params),
                          cache_salt=request.cache_salt)
        except LayoutMismatch as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        t0 = time.perf_counter()
        try:
            try:
                queue = await self.aengine.add(req)
            except ValueError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            out = await queue.get()
            if out.error:
                await context.abort(grpc.StatusCode.INTERNAL, out.error)
            t1 = time.perf_counter()
            blocks = (await self.aengine.block_table(rid))[target.num_cached_blocks:]
            lp = out.new_logprobs[0] if out.new_logprobs else None
            try:
                await self.sender.send(rid, self.aengine.engine.kv, blocks, target,
                                       out.new_token_ids[0], lp)
            except KVTransferError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            t2 = time.perf_counter()
        finally:
            self.aengine.abort_nowait(rid)          # frees the held blocks in every case
        return pb.PrefillReply(first_token_id=out.new_token_ids[0],
                               num_prompt_tokens=req.num_prompt_tokens,
                               compute_seconds=t1 - t0, transfer_seconds=t2 - t1,
                               num_cached_tokens=req.num_cached_tokens,
                               num_blocks_sent=len(blocks))

    async def Abort(self, request: pb.AbortRequest, context):
        return pb.AbortReply(found=await self.aengine.abort(request.request_id))

    async def Stats(self, request, context):
        return worker_stats(self.aengine)

    async def close(self) -> None:
        await self.sender.close()


def main(args) -> int:
    def add(server, aengine, ident):
        servicer = PrefillServicer(aengine, ident, args.kv_transport)
        pb_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
        return servicer

    asyncio.run(serve(args, "prefill", add))
    return 0
