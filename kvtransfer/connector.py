"""The KV connector, worker side: where a decode engine's received KV meets its pool.

The scheduler side (engine.kv_connector, through the Engine's load API) decides which blocks a
transfer holds; this side moves bytes and touches the pool only on the engine thread, in commands the AsyncEngine runs between steps:

- `write(request_id, block_ids, data)`: on CUDA the received bytes are first copied into
  page-locked memory on a worker thread (kvtransfer.staging: `stage`), so the engine thread only
  queues the device copy and the index; the copy into the pool runs only while the connector
  says the blocks are still the request's to receive (an abort that came first wins: its blocks
  may already be another request's). No pins: the engine thread cannot free a block while it
  copies into it.
- `complete(request_id, first_token, ...)`: queued behind the request's writes; the checksums of
  the written blocks are computed on the pool, on the engine thread, compared with the
  sender's, and only then does the request join the batch, in the same command (explicit
  completion: nothing runs on half-written or unchecked KV).
- `reject`, `sender_done`: the load ends; a one-sided sender's blocks stay aside until it says
  it has stopped writing.

Transports see this as a KVSink (kvtransfer.base); `pool` is handed only to the one-sided
receiver (NIXL registers the region; the NIC writes it) and to nobody who copies.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import torch

from engine.async_engine import AsyncEngine, EngineDead
from engine.kv_layout import KVLayout
from engine.parallel import RankFailure
from engine.request import TokenLogprob
from kvtransfer.base import block_bytes
from kvtransfer.integrity import block_checksums
from kvtransfer.staging import HostStaging

log = logging.getLogger(__name__)

MAX_PENDING_BYTES = 256 << 20     # received KV queued to the engine thread, per sink


def mismatch(kv: torch.Tensor, block_ids: list[int], claimed: list[int]) -> str | None:
    """None when the pool's blocks have the sender's checksums, else what differs. Syncs the
    device (call it where the blocks' writes are queued: the engine thread, between steps)."""
    got = block_checksums(kv, block_ids).tolist()
    bad = [b for b, want, have in zip(block_ids, claimed, got) if want != have]
    if len(got) != len(claimed) or bad:
        where = f" (e.g. block {bad[0]})" if bad else ""
        return (f"KV checksum mismatch in {len(bad) or len(block_ids)} of {len(block_ids)} "
                f"blocks{where}: the KV was corrupted in transfer")
    return None


class EngineSink:
    """A decode engine's KVSink. `refused(request_id, message)` is what becomes of a request
    whose KV was rejected (the decode service's --kv-load-failure policy); `transfers` counts
    (cluster.metrics.TransferMetrics)."""

    def __init__(self, aengine: AsyncEngine, transfers,
                 refused: Callable[[str, str], Awaitable[None]]) -> None:
        self.aengine = aengine
        self.engine = aengine.engine          # its load API (Engine.load, end_load, ...)
        self.layout: KVLayout = self.engine.layout
        self.vocab_size = self.engine.model_cfg.vocab_size
        self.transfers = transfers
        self.refused = refused
        self.staging = HostStaging(self.engine.kv.device)
        self._pending: list[tuple[asyncio.Future, int]] = []   # writes queued, and their bytes
        self._pending_bytes = 0

    @property
    def pool(self) -> torch.Tensor:
        """For a one-sided receiver's registration only."""
        return self.engine.kv

    def reserved_blocks(self, request_id: str) -> list[int] | None:
        return self.engine.reserved_blocks(request_id)

    def expecting(self) -> bool:
        return self.engine.expecting_kv()

    async def write(self, request_id: str, block_ids: list[int], data: torch.Tensor,
                    ready: object | None = None) -> None:
        """Copy received blocks into the pool, on the engine thread (its stream waits for
        `ready` first: kvtransfer.base.KVSink), if they are still the request's to receive. Returns once the copy is queued to the engine (in order with the
        request's completion, which follows it); waits only while more than
        MAX_PENDING_BYTES of received KV is queued, so a long prompt's pieces all land in
        the engine's next pause between steps instead of one a step."""
        ids = list(block_ids)
        pool = self.engine.kv
        nbytes = data.numel() * data.element_size()
        staged = None
        if self.staging.pinned and isinstance(pool, torch.Tensor):
            # the bytes go into page-locked memory here, off the loop and the engine thread
            staged = await asyncio.to_thread(self.staging.stage, data)

        def run() -> None:
            if not self.engine.is_loading(request_id, ids):
                if staged is not None:
                    self.staging.release(staged)
                return
            try:
                if staged is not None:            # only the device copy and the index
                    self.staging.write_staged(pool, ids, staged)
                else:
                    self.staging.write_blocks(pool, ids, data, ready)
            except RankFailure:              # tensor parallel: the engine stops
                raise
            except Exception as exc:     # the request must not run on KV that is not there
                log.exception("request %s: writing received KV failed", request_id)
                self.engine.fail_load(request_id,
                                      f"writing the received KV into the pool failed: {exc}")

        while self._pending and self._pending_bytes + nbytes > MAX_PENDING_BYTES:
            head = self._pending[0][0]
            if head.done():                # its callback may not have run yet: run it now
                self._written(head)
            else:
                await asyncio.wait({head})
        fut = self.aengine.run(run)
        self._pending.append((fut, nbytes))
        self._pending_bytes += nbytes
        fut.add_done_callback(self._written)

    def _written(self, fut: asyncio.Future) -> None:
        for i, (f, nbytes) in enumerate(self._pending):
            if f is fut:
                del self._pending[i]
                self._pending_bytes -= nbytes
                break
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None and not isinstance(exc, EngineDead):   # dead: every stream fails
            log.error("a KV write command failed", exc_info=exc)

    async def complete(self, request_id: str, first_token: int,
                       first_logprob: TokenLogprob | None, block_ids: list[int],
                       claimed: list[int] | None) -> tuple[str, str] | None:
        """Every block arrived: check them (`claimed`: the sender's checksums, None: not
        checked) and let the request decode, in one engine command. -> None (done, or the
        request is gone), or (kind, why) the KV is refused (the load stays open for
        `reject`)."""
        ids = list(block_ids)
        pool = self.engine.kv

        def run():
            load = self.engine.load(request_id)
            if load is None:
                return None
            if load.failed is not None:
                return "invalid", load.failed
            if claimed is not None:
                why = mismatch(pool, ids, claimed)
                if why is not None:
                    return "checksum", why
            self.aengine.remote_ready_now(request_id, first_token, first_logprob)
            return load
        result = await self.aengine.run(run)
        if isinstance(result, tuple):
            return result
        if result is not None:
            self.transfers.done(len(result.blocks), block_bytes(self.layout),
                                time.monotonic() - result.started)
        return None

    async def reject(self, request_id: str, message: str, kind: str) -> None:
        """The request's KV is unusable (kvtransfer.integrity), and its sender has stopped
        writing: the load ends, is counted, then `refused`."""
        load = await self.aengine.run(self.engine.end_load, request_id, True)
        if load is None:
            return
        self.transfers.failed(kind)
        if kind == "checksum":
            self.transfers.checksum_failures.inc()
        await self.refused(request_id, f"KV from the prefill worker refused: {message}")

    def sender_done(self, request_id: str) -> None:
        """A one-sided sender stopped writing the request's blocks: those kept aside go back."""
        self.aengine.run_nowait(self.engine.sender_done, request_id)
