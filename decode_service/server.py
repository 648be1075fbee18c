"""The decode worker's gRPC services.

Decode(request) is one server stream per request: reserve blocks, answer with their descriptor,
then stream tokens as the engine makes them. The stream's end — finished, cancelled by the
gateway, or broken — always releases the request and its blocks on this worker.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from engine.async_engine import AsyncEngine
from engine.request import RequestOutput
from kvtransfer import TransferTarget, create_receiver
from kvtransfer.connector import EngineSink
from kvtransfer.wire import logprob_to_pb, prompt_logprobs_to_pb, target_to_pb
from cluster.auth import ClusterAuth
from cluster.metrics import WorkerMetrics
from cluster.tracing import Tracing
from serving.params import request_from_pb
from serving.tracing import decode_phase, decode_timing, start_timeline, traced_call
from serving.worker import (ADMISSION_ERRORS, Grammars, WorkerIdentity, lora_call,
                            output_error_code, refuse, serve, worker_stats)
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def _token_batches(outs: list[RequestOutput]) -> list[pb.TokenBatch]:
    """One TokenBatch per choice among `outs` (in order of first appearance)."""
    batches: dict[int, pb.TokenBatch] = {}
    for o in outs:
        batch = batches.get(o.choice)
        if batch is None:
            batch = batches[o.choice] = pb.TokenBatch(index=o.choice)
        batch.token_ids.extend(o.new_token_ids)
        batch.logprobs.extend(logprob_to_pb(lp) for lp in o.new_logprobs)
        if o.prompt_logprobs is not None:
            batch.prompt_logprobs.extend(prompt_logprobs_to_pb(o.prompt_logprobs))
        if o.finish_reason:
            batch.finish_reason = o.finish_reason
    return list(batches.values())


class DecodeServicer(pb_grpc.DecodeWorkerServicer):
    """`timeout_s`: how long a reservation may wait for its KV; then `on_timeout` decides:
    "fail" ends the request with an error, "recompute" computes the prompt on this worker.
    `auth`: the deployment token senders must hold (None: an open deployment)."""

    def __init__(self, aengine: AsyncEngine, ident: WorkerIdentity, transport: str,
                 metrics: WorkerMetrics, timeout_s: float = 300.0,
                 on_timeout: str = "fail", checksum: bool = True,
                 auth: ClusterAuth | None = None, tracing: Tracing | None = None) -> None:
        if on_timeout not in ("fail", "recompute"):
            raise ValueError(f"on_timeout must be 'fail' or 'recompute', got {on_timeout!r}")
        self.aengine = aengine
        self.ident = ident
        self.tracing = tracing or Tracing.off()
        self.transfers = metrics.transfers(transport)
        self.sink = EngineSink(aengine, self.transfers, self._give_up)
        # the torch transport's store and collectives are held to the transfer timeout too
        kw = {"timeout_s": timeout_s} if transport == "torch" else {}
        self.receiver = create_receiver(transport, self.sink, address=ident.address,
                                        checksum=checksum, auth=auth, **kw)
        aengine.configure_loads(self.receiver.one_sided, timeout_s, self.receiver.lease_s,
                                on_timeout=self._timed_out)   # before any request reserves
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self.grammars = Grammars(aengine.engine)
        # requests ended from outside, and the status their Decode stream ends with: ABORTED
        # for a failed KV transfer (the gateway runs it again), CANCELLED for an Abort call
        self._ended: dict[str, grpc.StatusCode] = {}
        self._open: dict[str, asyncio.Queue] = {}   # requests whose Decode stream is open
        self._pending: set[asyncio.Task] = set()

    def _timed_out(self, rid: str) -> None:
        """The engine ended a reservation whose KV did not arrive in time (its blocks kept
        aside from a one-sided sender): fail it or compute it here."""
        self.transfers.failed("timeout")
        task = asyncio.ensure_future(self._give_up(
            rid, f"KV transfer from the prefill worker did not complete within "
                 f"{self.timeout_s:g} s"))
        self._pending.add(task)
        task.add_done_callback(self._given_up)

    def _given_up(self, task: asyncio.Task) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a timed-out reservation could not be ended", exc_info=task.exception())

    async def _give_up(self, rid: str, why: str) -> None:
        """The request's KV will not arrive, or arrived unusable (its load has ended): compute
        its prompt here or fail it, as --kv-load-failure says."""
        if self.on_timeout == "recompute":
            log.warning("request %s: %s; computing the prompt here", rid, why)
            queue = self._open.get(rid)
            if queue is not None:       # said on the stream before any token of it can come
                queue.put_nowait(pb.LocalCompute(reason=why))
            await self.aengine.compute_locally(rid)
        else:
            log.warning("request %s: %s", rid, why)
            if rid in self._open:                   # its stream ends ABORTED
                self._ended[rid] = grpc.StatusCode.ABORTED
            self.aengine.fail(rid, why)

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        parent, timed = traced_call(self.tracing, context, request.return_timing)
        try:
            if "#" in rid:
                raise ValueError(f"request id {rid!r} contains '#' (reserved for the ids of a "
                                 "request's choices)")
            req = request_from_pb(rid, request)
            await self.grammars.attach(req)
            queue = self.aengine.open_stream(rid, req.params.n)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not timed:
            async for event in self._decode(request, context, req, queue):
                yield event
            return
        start_timeline(req)
        error, finished = "", False
        try:
            async for event in self._decode(request, context, req, queue):
                if request.return_timing and event.tokens.finish_reason:
                    event.tokens.timing.CopyFrom(decode_timing(
                        self.ident.id, req, request.local_prefill, time.time_ns()))
                finished = finished or bool(event.tokens.finish_reason)
                yield event
        except (asyncio.CancelledError, GeneratorExit):
            raise                               # the gateway ended the stream
        except BaseException as exc:
            error = str(exc) or type(exc).__name__
            raise
        finally:
            self.tracing.record(decode_phase(req, request.local_prefill, time.time_ns(), error,
                                             cancelled=not finished and not error),
                                parent, "server")

    async def _decode(self, request: pb.DecodeRequest, context, req, queue):
        """The stream's events: the reservation (unless local), then the tokens."""
        rid = request.request_id
        finished = False
        done: set[int] = set()          # choices finished
        self._open[rid] = queue
        local = request.local_prefill      # the prompt is computed here (asked, or taken over)
        try:
            if request.local_prefill:
                try:
                    await self.aengine.submit(req)
                except ADMISSION_ERRORS as exc:
                    await refuse(context, exc)
            else:
                try:
                    blocks = await self.aengine.reserve(req)
                except ADMISSION_ERRORS as exc:
                    await refuse(context, exc)
                cached = req.kv_cached_entries        # set by the engine thread on reserve
                target = TransferTarget(self.receiver.name, self.receiver.address(),
                                        self.ident.id, self.sink.layout, tuple(blocks), cached,
                                        self.receiver.metadata())
                yield pb.DecodeEvent(reservation=target_to_pb(target))
            while not finished:
                outs = [await queue.get()]
                while not queue.empty():               # batch what is already there
                    outs.append(queue.get_nowait())
                if any(isinstance(o, pb.LocalCompute) for o in outs):
                    local = True
                    yield pb.DecodeEvent(local_compute=next(
                        o for o in outs if isinstance(o, pb.LocalCompute)))
                    outs = [o for o in outs if not isinstance(o, pb.LocalCompute)]
                errors = [o.error for o in outs if o.error]
                if errors:
                    finished = True
                    # a KV transfer that failed is ABORTED: the gateway runs the request again
                    code = self._ended.get(rid) or output_error_code(self.aengine)
                    await context.abort(code, errors[0])
                done.update(o.choice for o in outs if o.finished)
                finished = len(done) >= req.params.n
                for batch in _token_batches(outs):
                    if local:
                        batch.num_cached_tokens = req.num_cached_tokens
                    yield pb.DecodeEvent(tokens=batch)
        finally:
            self._open.pop(rid, None)
            self._ended.pop(rid, None)
            if not finished:        # the engine ends the load (one-sided: blocks kept aside)
                self.aengine.abort_nowait(rid)
            self.aengine.close_stream(rid)

    async def PushKV(self, request_iterator, context):
        return await self.receiver.push_kv(request_iterator, context)

    async def Abort(self, request: pb.AbortRequest, context):
        if request.HasField("choice"):            # one choice of an n > 1 request
            self.aengine.abort_choice(request.request_id, request.choice)
            return pb.AbortReply(found=True)
        rid = request.request_id
        self._ended.setdefault(rid, grpc.StatusCode.CANCELLED)
        found = await self.aengine.cancel(rid, "the request was aborted (an Abort call)")
        if not found:
            self._ended.pop(rid, None)
        return pb.AbortReply(found=found)

    async def LoRA(self, request: pb.LoRARequest, context):
        return await lora_call(self.aengine, request, context)

    async def Stats(self, request, context):
        return worker_stats(self.aengine)

    def end_streams(self, why: str) -> int:
        """End every open Decode stream with UNAVAILABLE (`why`): the gateway moves each to
        another decode worker (the drain's deadline). -> how many."""
        rids = list(self._open)
        for rid in rids:
            self._ended[rid] = grpc.StatusCode.UNAVAILABLE
            self.aengine.fail(rid, why)
        return len(rids)

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()
        await self.receiver.close()
        self.tracing.shutdown()


def main(args) -> int:
    def add(server, aengine, ident, metrics, auth):
        servicer = DecodeServicer(aengine, ident, args.kv_transport, metrics,
                                  args.kv_transfer_timeout, args.kv_load_failure,
                                  args.kv_checksum == "on", auth,
                                  Tracing.from_args(args, "pdserve-decode"))
        pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        return servicer

    asyncio.run(serve(args, "decode", add))
    return 0
