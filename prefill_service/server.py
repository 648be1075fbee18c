"""The prefill worker's gRPC services.

Prefill(request): queue the prompt in the engine (prefill role: it finishes after the first
token and keeps its blocks; blocks of a cached prefix are reused). After every engine step that
completes blocks of the prompt, those blocks go to the decode worker's reserved blocks over the
chosen transport while the next chunk computes; the first token follows the last block. The
engine's KV connector holds those blocks (and the finished request's table) until the send has
ended, sent or not (`save_done`); then they are freed (hashed blocks stay cached until evicted).
On a GPU each output's `kv_ready` event goes along: a transport that reads the blocks off the
engine's stream (nixl) waits for it before reading.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from engine.async_engine import AsyncEngine
from kvtransfer import (KVTransferError, LayoutMismatch, block_bytes, check_layout,
                        create_sender)
from kvtransfer.wire import prompt_logprobs_to_pb, target_from_pb
from cluster.auth import ClusterAuth
from cluster.metrics import WorkerMetrics
from cluster.tracing import Tracing
from serving.params import request_from_pb
from serving.tracing import Transfer, prefill_phase, prefill_timing, start_timeline, traced_call
from serving.worker import (ADMISSION_ERRORS, Grammars, WorkerIdentity, lora_call,
                            output_error_code, refuse, serve, worker_stats)
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class PrefillServicer(pb_grpc.PrefillWorkerServicer):
    def __init__(self, aengine: AsyncEngine, ident: WorkerIdentity, transport: str,
                 metrics: WorkerMetrics, timeout_s: float = 30.0,
                 checksum: bool = True, auth: ClusterAuth | None = None,
                 tracing: Tracing | None = None) -> None:
        """checksum: send the checksums of the blocks (--kv-checksum); auth: the deployment
        token the sender's connections carry (None: an open deployment); tracing: where the
        requests' spans go (serving/tracing.py)."""
        self.aengine = aengine
        self.tracing = tracing or Tracing.off()
        self.checksum = checksum
        self.ident = ident
        self.layout = aengine.engine.layout
        self.block_bytes = block_bytes(self.layout)
        # the sender reads the pool (gathers, checksums) through the engine: on a device on
        # its thread between steps, on a CPU at once (AsyncEngine.read_blocks)
        self.sender = create_sender(transport, self.layout, run_on_pool=aengine.read_blocks,
                                    kv=aengine.engine.kv, timeout_s=timeout_s,
                                    checksum=checksum, auth=auth)
        self.transfers = metrics.transfers(transport)
        self.grammars = Grammars(aengine.engine)
        self._cancelled: set[str] = set()      # ended by an Abort call: CANCELLED

    async def _accept(self, request: pb.PrefillRequest, context):
        """The call's destination and engine request, or the call ends with the status that
        says what is wrong with it."""
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
            req = request_from_pb(rid, request)
            await self.grammars.attach(req)        # the first token follows the grammar too
        except LayoutMismatch as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        n = req.num_tokens                                  # resumed: prompt + output
        kv = self.aengine.engine.kv_manager
        num_blocks = kv.transfer_count(0, kv.blocks_needed(n), n)   # (per KV group)
        if len(target.block_ids) != num_blocks:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the prompt needs {num_blocks} KV blocks; the destination has "
                                f"{len(target.block_ids)}")
        return target, req

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext):
        parent, timed = traced_call(self.tracing, context, request.return_timing)
        target, req = await self._accept(request, context)
        if not timed:
            return await self._prefill(request, context, target, req, None)
        start_timeline(req)
        transfer = Transfer(self.sender.name, "on" if self.checksum else "off")
        error = ""
        try:
            reply = await self._prefill(request, context, target, req, transfer)
        except BaseException as exc:
            error = str(exc) or type(exc).__name__
            raise
        finally:
            ended = time.time_ns()
            self.tracing.record(prefill_phase(req, transfer, ended, error), parent, "server")
        if request.return_timing:
            reply.timing.CopyFrom(prefill_timing(self.ident.id, req, transfer, ended))
        return reply

    async def _prefill(self, request: pb.PrefillRequest, context, target, req,
                       transfer: Transfer | None) -> pb.PrefillReply:
        """The call's work; `transfer` (traced or timed calls) gets what the KV transfer did."""
        rid = request.request_id
        t0 = time.perf_counter()
        queue = stream = None
        done = False
        try:
            try:
                queue = await self.aengine.add(req)
            except ADMISSION_ERRORS as exc:
                await refuse(context, exc)
            stream = self.sender.open(rid, self.aengine.engine.kv, target)
            out, src, dst, sent, t_send = await self._send_chunks(rid, queue, stream, target,
                                                                  context)
            t1 = time.perf_counter()
            lp = out.new_logprobs[0] if out.new_logprobs else None
            await stream.finish(out.new_token_ids[0], lp, src, dst, out.kv_ready)
            done = True
            t2 = time.perf_counter()
            moved = sent - target.num_cached_blocks
            if transfer is not None:
                transfer.blocks, transfer.bytes = moved, moved * self.block_bytes
                transfer.last_ns = time.time_ns()
                transfer.first_block_ns = transfer.last_ns - int((t2 - (t_send or t1)) * 1e9)
            self.transfers.done(moved, self.block_bytes, t2 - (t_send or t1))
            log.info("request %s: %d prompt tokens (%d cached here) prefilled in %.3f s; %d "
                     "blocks sent to %s, %.3f s of transfer after the last chunk", rid,
                     req.num_prompt_tokens, req.num_cached_tokens, t1 - t0, moved,
                     target.engine_id, t2 - t1)
        except KVTransferError as exc:
            self.transfers.failed("send")
            log.warning("request %s: %s; no more KV goes to %s, the request's blocks here are "
                        "freed%s", rid, exc, target.engine_id,
                        " (the decode worker gave up on this KV)" if exc.refused else "")
            if transfer is not None:
                transfer.error = str(exc)
                transfer.checksum = "failed" if "checksum" in str(exc).lower() else \
                    transfer.checksum
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        finally:
            try:
                if stream is not None and not done:
                    await stream.abort()            # the call ends; what it still reads is dropped
            finally:
                if queue is not None:
                    self.aengine.drain(queue)
                self.aengine.abort_nowait(rid)      # no more blocks for it (if still running)
                self.aengine.save_done(rid)         # then every reference it held goes back
                self._cancelled.discard(rid)
        return pb.PrefillReply(first_token_id=out.new_token_ids[0],
                               num_prompt_tokens=req.num_prompt_tokens,
                               compute_seconds=t1 - t0, transfer_seconds=t2 - t1,
                               num_cached_tokens=req.num_cached_tokens,
                               num_blocks_sent=moved,
                               prompt_logprobs=prompt_logprobs_to_pb(out.prompt_logprobs)
                               if out.prompt_logprobs is not None else ())

    async def _send_chunks(self, rid: str, queue, stream, target, context):
        """Each chunk's blocks go while the next chunk computes, until the output that finishes
        the prefill; -> (that output, its blocks still to send and their destinations, the
        blocks counted so far (cached ones included), when the first block went or None)."""
        sent = 0
        t_send = None
        while True:
            out = await queue.get()
            if out.error:
                code = (grpc.StatusCode.CANCELLED if rid in self._cancelled
                        else output_error_code(self.aengine))
                await context.abort(code, out.error)
            blocks = out.kv_blocks or []           # held for us by the engine's connector
            skip = min(max(target.num_cached_blocks - sent, 0), len(blocks))
            src, dst = blocks[skip:], list(target.block_ids[sent + skip:sent + len(blocks)])
            sent += len(blocks)
            if t_send is None and src:
                t_send = time.perf_counter()
            if out.finished:
                return out, src, dst, sent, t_send
            if src:
                await stream.send(src, dst, out.kv_ready)

    async def Abort(self, request: pb.AbortRequest, context):
        rid = request.request_id
        self._cancelled.add(rid)
        found = await self.aengine.cancel(rid, "the request was aborted (an Abort call)")
        if not found:
            self._cancelled.discard(rid)
        return pb.AbortReply(found=found)

    async def LoRA(self, request: pb.LoRARequest, context):
        return await lora_call(self.aengine, request, context)

    async def Stats(self, request, context):
        return worker_stats(self.aengine)

    async def close(self) -> None:
        await self.sender.close()
        self.tracing.shutdown()


def main(args) -> int:
    def add(server, aengine, ident, metrics, auth):
        servicer = PrefillServicer(aengine, ident, args.kv_transport, metrics,
                                   args.kv_transfer_timeout, args.kv_checksum == "on", auth,
                                   Tracing.from_args(args, "pdserve-prefill"))
        pb_grpc.add_PrefillWorkerServicer_to_server(servicer, server)
        return servicer

    asyncio.run(serve(args, "prefill", add))
    return 0
