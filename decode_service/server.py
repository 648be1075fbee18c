"""The decode worker's gRPC services.

Decode(request) is one server stream per request: reserve blocks, answer with their descriptor,
then stream tokens as the engine makes them. The stream's end — finished, cancelled by the
gateway, or broken — always releases the request and its blocks on this worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import grpc
import torch

from engine.async_engine import AsyncEngine
from engine.engine import KVLayout
from engine.request import Request, RequestOutput, TokenLogprob
from kvtransfer import TransferTarget, block_bytes, create_receiver
from kvtransfer.staging import HostStaging
from kvtransfer.wire import logprob_to_pb, target_to_pb
from pdserve.metrics import TransferMetrics, WorkerMetrics
from pdserve.worker import (ADMISSION_ERRORS, Grammars, WorkerIdentity, output_error_code, refuse,
                            sampling_from_pb, serve, worker_stats)
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class DecodeSink:
    """Where received KV lands: this worker's pool, for blocks reserved by Decode streams.
    Host data reaches a device pool through page-locked staging buffers (kvtransfer.staging).
    `refused(request_id, message)`: what becomes of a request whose KV was rejected (the
    servicer's --kv-load-failure policy)."""

    def __init__(self, aengine: AsyncEngine, transfers: TransferMetrics,
                 refused: Callable[[str, str], Awaitable[None]]) -> None:
        self.aengine = aengine
        self.layout: KVLayout = aengine.engine.layout
        self.vocab_size = aengine.engine.model_cfg.vocab_size
        self.transfers = transfers
        self.refused = refused
        self.staging = HostStaging(aengine.engine.kv.device)
        self.reservations: dict[str, list[int]] = {}
        self.since: dict[str, float] = {}

    @property
    def pool(self) -> torch.Tensor:
        return self.aengine.engine.kv

    def reserve(self, request_id: str, block_ids: list[int]) -> None:
        self.reservations[request_id] = block_ids
        self.since[request_id] = time.monotonic()

    def drop(self, request_id: str) -> list[int] | None:
        """End a reservation; the blocks that were still expected, or None."""
        self.since.pop(request_id, None)
        return self.reservations.pop(request_id, None)

    def reserved_blocks(self, request_id: str) -> list[int] | None:
        """The request's blocks a sender may write: never the shared, cached prefix blocks."""
        return self.reservations.get(request_id)

    def expecting(self) -> bool:
        return bool(self.reservations)

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """On the device's current stream, so the engine's later steps see the blocks; returns
        once the copies are queued (the staging buffer stays untouched until they are done)."""
        self.staging.write_blocks(self.pool, block_ids, data)

    async def write(self, block_ids: list[int], data: torch.Tensor) -> None:
        """write_blocks off the loop, the blocks pinned meanwhile: the pin is queued to the
        engine before any abort of the request can be, and the unpin after the copy, so the
        blocks cannot be freed and reused while the copy runs."""
        self.aengine.pin(block_ids)
        try:
            await asyncio.to_thread(self.write_blocks, block_ids, data)
        finally:
            self.aengine.unpin(block_ids)

    async def complete(self, request_id: str, first_token: int,
                       first_logprob: TokenLogprob | None) -> None:
        since = self.since.get(request_id)
        blocks = self.drop(request_id)
        if blocks is not None:
            self.transfers.done(len(blocks), block_bytes(self.layout), time.monotonic() - since)
            await self.aengine.remote_ready(request_id, first_token, first_logprob)

    async def reject(self, request_id: str, message: str, kind: str) -> None:
        """The request's KV is unusable (kvtransfer.integrity): counted, then `refused`."""
        if self.drop(request_id) is None:
            return
        self.transfers.failed(kind)
        if kind == "checksum":
            self.transfers.checksum_failures.inc()
        await self.refused(request_id, f"KV from the prefill worker refused: {message}")


def _token_batches(outs: list[RequestOutput]) -> list[pb.TokenBatch]:
    """One TokenBatch per choice among `outs` (in order of first appearance)."""
    batches: dict[int, pb.TokenBatch] = {}
    for o in outs:
        batch = batches.get(o.choice)
        if batch is None:
            batch = batches[o.choice] = pb.TokenBatch(index=o.choice)
        batch.token_ids.extend(o.new_token_ids)
        batch.logprobs.extend(logprob_to_pb(lp) for lp in o.new_logprobs)
        if o.finish_reason:
            batch.finish_reason = o.finish_reason
    return list(batches.values())


class DecodeServicer(pb_grpc.DecodeWorkerServicer):
    """`timeout_s`: how long a reservation may wait for its KV; then `on_timeout` decides:
    "fail" ends the request with an error, "recompute" computes the prompt on this worker."""

    def __init__(self, aengine: AsyncEngine, ident: WorkerIdentity, transport: str,
                 metrics: WorkerMetrics, timeout_s: float = 300.0,
                 on_timeout: str = "fail", checksum: bool = True) -> None:
        if on_timeout not in ("fail", "recompute"):
            raise ValueError(f"on_timeout must be 'fail' or 'recompute', got {on_timeout!r}")
        self.aengine = aengine
        self.ident = ident
        self.transfers = metrics.transfers(transport)
        self.sink = DecodeSink(aengine, self.transfers, self._give_up)
        self.receiver = create_receiver(transport, self.sink, address=ident.address,
                                        checksum=checksum)
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self.grammars = Grammars(aengine.engine)
        # requests ended from outside, and the status their Decode stream ends with: ABORTED
        # for a failed KV transfer (the gateway runs it again), CANCELLED for an Abort call
        self._ended: dict[str, grpc.StatusCode] = {}
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Reservations whose KV has not arrived in time: fail them or compute them here."""
        while True:
            await asyncio.sleep(min(0.5, self.timeout_s / 4))
            now = time.monotonic()
            for rid in [r for r, t in self.sink.since.items() if now - t > self.timeout_s]:
                if rid not in self.sink.since:       # ended while an earlier one was handled
                    continue
                blocks = self.sink.drop(rid)
                self.transfers.failed("timeout")
                self._keep_aside(rid, blocks)
                await self._give_up(rid, f"KV transfer from the prefill worker did not complete "
                                         f"within {self.timeout_s:g} s")

    async def _give_up(self, rid: str, why: str) -> None:
        """The request's KV will not arrive, or arrived unusable (the sink's rejections, which
        come once the sender has stopped writing: nothing to keep aside): compute its prompt
        here or fail it, as --kv-load-failure says."""
        if self.on_timeout == "recompute":
            log.warning("request %s: %s; computing the prompt here", rid, why)
            await self.aengine.compute_locally(rid)
        else:
            log.warning("request %s: %s", rid, why)
            self._ended[rid] = grpc.StatusCode.ABORTED
            self.aengine.fail(rid, why)

    def _keep_aside(self, rid: str, blocks: list[int] | None) -> None:
        """A one-sided sender may still write into these blocks: keep them out of use until it
        is done (the receiver releases them)."""
        if blocks and self.receiver.one_sided:
            self.aengine.pin(blocks)
            self.receiver.quarantine(rid, blocks, self.aengine.unpin)

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        rid = request.request_id
        try:
            if "#" in rid:
                raise ValueError(f"request id {rid!r} contains '#' (reserved for the ids of a "
                                 "request's choices)")
            req = Request(rid, list(request.prompt_token_ids), sampling_from_pb(request.params),
                          output_token_ids=list(request.resume_token_ids),
                          cache_salt=request.cache_salt)
            await self.grammars.attach(req)
            queue = self.aengine.open_stream(rid, req.params.n)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finished = False
        done: set[int] = set()          # choices finished
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
                cached = req.num_cached_blocks        # set by the engine thread on reserve
                self.sink.reserve(rid, blocks[cached:])
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
                    # a KV transfer that failed is ABORTED: the gateway runs the request again
                    code = self._ended.get(rid) or output_error_code(self.aengine)
                    await context.abort(code, errors[0])
                done.update(o.choice for o in outs if o.finished)
                finished = len(done) >= req.params.n
                for batch in _token_batches(outs):
                    yield pb.DecodeEvent(tokens=batch)
        finally:
            self._ended.pop(rid, None)
            self._keep_aside(rid, self.sink.drop(rid))
            if not finished:
                self.aengine.abort_nowait(rid)
            self.aengine.close_stream(rid)

    async def PushKV(self, request_iterator, context):
        return await self.receiver.push_kv(request_iterator, context)

    async def Abort(self, request: pb.AbortRequest, context):
        if request.HasField("choice"):            # one choice of an n > 1 request
            self.aengine.abort_choice(request.request_id, request.choice)
            return pb.AbortReply(found=True)
        rid = request.request_id
        self._keep_aside(rid, self.sink.drop(rid))
        self._ended.setdefault(rid, grpc.StatusCode.CANCELLED)
        found = await self.aengine.cancel(rid, "the request was aborted (an Abort call)")
        if not found:
            self._ended.pop(rid, None)
        return pb.AbortReply(found=found)

    async def Stats(self, request, context):
        return worker_stats(self.aengine)

    async def close(self) -> None:
        self._watchdog.cancel()
        await self.receiver.close()


def main(args) -> int:
    def add(server, aengine, ident, metrics):
        servicer = DecodeServicer(aengine, ident, args.kv_transport, metrics,
                                  args.kv_transfer_timeout, args.kv_load_failure,
                                  args.kv_checksum == "on")
        pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
        return servicer

    asyncio.run(serve(args, "decode", add))
    return 0
