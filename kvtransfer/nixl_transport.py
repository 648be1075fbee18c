"""The `nixl` transport: the prefill worker WRITEs blocks straight into the decode worker's pool.

The decode worker registers its whole KV pool with a NIXL agent once at start and puts, in every
KV descriptor it hands out, its agent's metadata and the pool's base address (a NixlPeer). The
prefill worker (whose own pool is registered once too) computes the address of each destination
block from that and issues one-sided WRITEs: one per prefill chunk, while the next chunk
computes. Push rather than pull because the prefill side knows when each chunk's KV is final;
the decode side does nothing until the last WRITE, which carries a notification with the first
token (a KVChunk without data, serialized), so there is no extra round trip.

A block of the pool `kv[layer, k_or_v, block, slot, head, dim]` is contiguous per (layer, k_or_v);
consecutive block ids on both sides are merged into one descriptor, so a transfer has at most
2 x layers x (runs of consecutive ids) descriptors.

Progress: with NIXL's progress thread off (the default here: it spins a core) both sides progress
by polling: the sender while it waits for its WRITEs, the receiver from an asyncio task that reads
notifications (quickly while reservations are open, slowly when idle). CPU memory is "DRAM", CUDA
memory "VRAM"; the code is the same.

A WRITE reads the source blocks outside the stream the engine computes on, so it is posted only
once the step that wrote them has completed on the device: the sender polls the step's `ready`
event (`query()`, backing off like its other waits) before posting; with `ready` None (CPUs) it
posts at once.

Trust. The receiver cannot see the WRITEs, so it checks what the completion notice claims: it
lists every block of the transfer with its checksum (kvtransfer.integrity, computed by the sender
on its device, on a side stream once the step is final, so not behind the engine's next steps);
the ids must be exactly the request's reservation, and the pool's blocks must match the
checksums before the request runs. Notices carry ClusterAuth.sign of their fields, and unsigned
ones are ignored, so a stranger cannot complete a request or release blocks kept aside. The
sender bounds every descriptor: source ids inside its own pool, destination ids below the
peer's advertised block count, and the peer's advertised region (NixlPeer.region_bytes) exactly
a pool of the layout. The receiver registers exactly its pool tensor (one region: its address
and size), so remote WRITEs can reach nothing else of its memory. Anyone who holds the agent
metadata (it travels in KV descriptors, which only the deployment's processes receive) can still
WRITE into that region; the checksums catch such writes into reserved blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from typing import Awaitable, Callable

import torch

from engine.kv_layout import KVLayout
from engine.request import TokenLogprob
from kvtransfer.base import (KVReceiver, KVSender, KVSendStream, KVSink, KVTransferError,
                             TransferTarget, block_bytes, check_layout, poll_until)
from kvtransfer.integrity import Intake, Refused, block_checksums, host_values
from kvtransfer.wire import (chunk_from_bytes, completion_chunk, first_logprob_of,
                             layout_from_pb, notice_fields)
from cluster.auth import ClusterAuth
from proto import pdserve_pb2 as pb

log = logging.getLogger(__name__)

# Polling takes the GIL from the engine thread: back off. The sender waits for its WRITEs and
# for the step's ready event starting at _POLL_MIN_S, doubling to _POLL_MAX_S; the receiver
# reads notifications every _POLL_BUSY_S while reservations are open, every _POLL_IDLE_S
# otherwise.
_POLL_MIN_S = 0.0002
_POLL_MAX_S = 0.005
_POLL_BUSY_S = 0.002
_POLL_IDLE_S = 0.02
NOTICE_PROGRESS_S = 5.0      # the sender progresses its agent this long after a lone notice


def _agent(name: str, progress_thread: bool):
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:  # pragma: no cover - nixl is a dependency
        raise KVTransferError("--kv-transport nixl needs the nixl package (pip install "
                              "nixl==1.5.1)") from exc
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread,
                                              backends=["UCX"]))


def _memory(kv: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", kv.device.index or 0) if kv.is_cuda else ("DRAM", 0)


def block_regions(base: int, num_blocks: int, layout: KVLayout, elem: int,
                  block_ids: list[int]) -> list[tuple[int, int]]:
    """(address, bytes) of `block_ids` in a pool at `base` with `num_blocks` blocks, every layer
    and K/V, consecutive ids merged. Regions are ordered (layer, k_or_v, run)."""
    block_bytes = layout.block_size * layout.num_kv_heads * layout.head_dim * elem
    runs: list[tuple[int, int]] = []
    for _, group in itertools.groupby(enumerate(block_ids), key=lambda t: t[1] - t[0]):
        ids = [b for _, b in group]
        runs.append((ids[0], len(ids)))
    out = []
    for plane in range(layout.num_layers * 2):
        plane_base = base + plane * num_blocks * block_bytes
        out.extend((plane_base + first * block_bytes, n * block_bytes) for first, n in runs)
    return out


def _paired_runs(src: list[int], dst: list[int]) -> list[tuple[list[int], list[int]]]:
    """Split (src, dst) pairs where either side stops being consecutive, so each piece merges
    into one region per plane on both sides."""
    pieces: list[tuple[list[int], list[int]]] = []
    for s, d in zip(src, dst):
        if pieces and s == pieces[-1][0][-1] + 1 and d == pieces[-1][1][-1] + 1:
            pieces[-1][0].append(s)
            pieces[-1][1].append(d)
        else:
            pieces.append(([s], [d]))
    return pieces


class _NixlSendStream(KVSendStream):
    def __init__(self, sender: "NixlKVSender", request_id: str, target: TransferTarget,
                 peer: pb.NixlPeer, remote: str) -> None:
        self.sender = sender
        self.request_id = request_id
        self.target = target
        self.peer = peer
        self.remote = remote
        self._handles: list = []
        self._dst: list[int] = []                # every block written so far, in order
        self._sums: list[torch.Tensor] = []      # their checksums, on the sender's device

    def _descs(self, src: list[int], dst: list[int]):
        s, elem = self.sender, self.sender.elem
        if len(src) != len(dst):
            raise KVTransferError(f"request {self.request_id}: {len(src)} source blocks for "
                                  f"{len(dst)} destination blocks")
        outside = [b for b in src if not 0 <= b < s.num_blocks]
        if outside:
            raise KVTransferError(f"request {self.request_id}: source blocks {outside[:8]} "
                                  f"outside this worker's pool of {s.num_blocks}")
        outside = [b for b in dst if not 0 <= b < self.peer.num_blocks]
        if outside:
            raise KVTransferError(f"request {self.request_id}: destination blocks "
                                  f"{outside[:8]} outside {self.target.engine_id}'s pool of "
                                  f"{self.peer.num_blocks}")
        local, remote = [], []
        for src_run, dst_run in _paired_runs(src, dst):
            local += block_regions(s.base, s.num_blocks, s.layout, elem, src_run)
            remote += block_regions(self.peer.base_address, self.peer.num_blocks, s.layout, elem,
                                    dst_run)
        mem, dev = s.memory
        agent = s.agent
        return (agent.get_xfer_descs([(a, n, dev) for a, n in local], mem),
                agent.get_xfer_descs([(a, n, self.peer.device_id) for a, n in remote],
                                     self.peer.memory_type))

    def _post(self, src: list[int], dst: list[int], notif: bytes = b"") -> None:
        """Start one WRITE; it completes in the background (`_reap`, `_wait`)."""
        agent = self.sender.agent
        local, remote = self._descs(src, dst)
        try:
            handle = agent.initialize_xfer("WRITE", local, remote, self.remote, notif)
            state = agent.transfer(handle)
        except Exception as exc:      # nixl raises its own error types
            raise KVTransferError(f"NIXL write to {self.target.engine_id} failed: {exc}") from exc
        self._handles.append(handle)
        if state == "ERR":
            raise KVTransferError(f"NIXL write to {self.target.engine_id} failed to start")

    def _reap(self) -> None:
        """Release the WRITEs that are done, oldest first (this also progresses UCX)."""
        agent = self.sender.agent
        while self._handles:
            state = agent.check_xfer_state(self._handles[0])
            if state == "ERR":
                raise KVTransferError(f"NIXL write to {self.target.engine_id} failed")
            if state != "DONE":
                return
            agent.release_xfer_handle(self._handles.pop(0))

    async def _wait(self) -> None:
        """Until every WRITE so far is done."""
        def done() -> bool:
            self._reap()
            return not self._handles
        await poll_until(done, self.sender.timeout_s,
                         lambda: f"NIXL write to {self.target.engine_id} did not complete",
                         _POLL_MIN_S, _POLL_MAX_S)

    async def _ready(self, ready) -> None:
        """Until the device has completed the step that wrote the blocks (None: it has)."""
        if ready is not None:
            await poll_until(ready.query, self.sender.timeout_s,
                             lambda: f"request {self.request_id}: the KV of the prefill step "
                                     "was not final on the device", _POLL_MIN_S, _POLL_MAX_S)

    async def send(self, src_blocks: list[int], dst_blocks: list[int],
                   ready: object | None = None) -> None:
        """Posts the WRITE once `ready` has completed, and returns: the copy runs while the next
        chunk computes. The source blocks must stay unchanged until finish() or abort()
        returns."""
        self._reap()
        await self._ready(ready)
        self._post(list(src_blocks), list(dst_blocks))
        await self._record(list(src_blocks), list(dst_blocks))

    async def _record(self, src: list[int], dst: list[int]) -> None:
        """Keep the written blocks for the completion notice, with their checksums queued on
        the sender's side stream (the step that wrote them has completed), on the pool's
        thread (run_on_pool)."""
        self._dst += dst
        if self.sender.checksum and src:
            self._sums.append(await self.sender.run_on_pool(self.sender.checksums, src))

    async def _notice(self, first_token: int, first_logprob: TokenLogprob | None) -> bytes:
        """The signed completion: every block written and its checksum, the first token."""
        s = self.sender
        sums = []
        if self._sums:
            with s.side_stream():
                gathered = torch.cat(self._sums)
            sums = await host_values(gathered, s.timeout_s, s.side)
        chunk = completion_chunk(self.request_id, s.layout, first_token, first_logprob,
                                 self._dst, sums)
        chunk.signature = s.auth.sign(notice_fields(chunk))
        return chunk.SerializeToString()

    async def finish(self, first_token: int, first_logprob: TokenLogprob | None,
                     src_blocks: list[int] = (), dst_blocks: list[int] = (),
                     ready: object | None = None) -> None:
        if src_blocks:
            # The notification travels with the last WRITE: NIXL sends it once the endpoint
            # is flushed, so after the data of this WRITE and of every earlier one.
            await self._ready(ready)
            await self._record(list(src_blocks), list(dst_blocks))
            done = await self._notice(first_token, first_logprob)
            self._post(list(src_blocks), list(dst_blocks), done)
            await self._wait()
        else:
            done = await self._notice(first_token, first_logprob)
            await self._wait()
            try:
                self.sender.agent.send_notif(self.remote, done)
                self.sender.progress_for(NOTICE_PROGRESS_S)
            except Exception as exc:
                raise KVTransferError(f"NIXL notification to {self.target.engine_id} failed: "
                                      f"{exc}") from exc

    async def abort(self) -> None:
        """Let WRITEs in flight end, then tell the decode worker no more will come for this
        request, so it can reuse the blocks it kept aside (KVSink.sender_done)."""
        try:
            await self._wait()
        except KVTransferError:
            pass
        finally:
            self._handles.clear()
        try:
            notice = pb.KVChunk(request_id=self.request_id, last=False)
            notice.signature = self.sender.auth.sign(notice_fields(notice))
            self.sender.agent.send_notif(self.remote, notice.SerializeToString())
            self.sender.progress_for(NOTICE_PROGRESS_S)
        except Exception:       # the decode worker is gone: its lease frees the blocks
            pass


class NixlKVSender(KVSender):
    name = "nixl"

    def __init__(self, layout: KVLayout, kv: torch.Tensor, progress_thread: bool = False,
                 timeout_s: float = 60.0, checksum: bool = True,
                 run_on_pool: Callable[..., Awaitable] | None = None,
                 auth: ClusterAuth | None = None) -> None:
        """checksum: put the blocks' checksums in the completion notice (--kv-checksum);
        run_on_pool: KVSender's; auth: the deployment token completion notices are signed
        with (None: unsigned, an open deployment)."""
        super().__init__(run_on_pool)
        self.layout = layout
        self.kv = kv
        self.timeout_s = timeout_s
        self.checksum = checksum
        self.auth = auth or ClusterAuth()
        self.side = torch.cuda.Stream(kv.device) if kv.is_cuda else None
        self.agent = _agent(f"pdserve-prefill-{os.getpid()}-{id(self):x}", progress_thread)
        self._registration = self.agent.register_memory(kv)
        self.base = kv.data_ptr()
        self.num_blocks = kv.shape[2]
        self.elem = kv.element_size()
        self.memory = _memory(kv)
        self._remotes: dict[str, str] = {}       # agent name -> name nixl knows it by
        self._progress_until = 0.0
        self._progressing: asyncio.Task | None = None

    def progress_for(self, seconds: float) -> None:
        """Progress the agent for `seconds` from now in the background. With the progress thread
        off, UCX moves a notification sent alone (not with a WRITE) only while the agent is
        progressed, and nothing else may progress it soon: an abort notice would otherwise
        wait for the next transfer, and the decode worker would keep its blocks aside until
        its lease ran out."""
        self._progress_until = max(self._progress_until, time.monotonic() + seconds)
        if self._progressing is None or self._progressing.done():
            self._progressing = asyncio.get_running_loop().create_task(self._progress())

    async def _progress(self) -> None:
        while time.monotonic() < self._progress_until:
            try:
                self.agent.get_new_notifs()      # a prefill agent receives none: progress only
            except Exception:
                return
            await asyncio.sleep(_POLL_MAX_S)

    def checksums(self, block_ids: list[int]) -> torch.Tensor:
        """The pool's blocks' checksums, queued on the side stream (no sync)."""
        with self.side_stream():
            return block_checksums(self.kv, block_ids)

    def side_stream(self):
        """Where checksums are computed: off the engine's stream (CUDA), so they wait for
        nothing but the blocks' own step, which has completed when they are queued."""
        return torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext()

    def _check_peer(self, peer: pb.NixlPeer, target: TransferTarget) -> None:
        """The peer's advertised region must be a pool of our layout, and the target's blocks
        inside it."""
        who = target.engine_id
        if peer.memory_type not in ("DRAM", "VRAM"):
            raise KVTransferError(f"decode worker {who}: unknown NIXL memory type "
                                  f"{peer.memory_type!r}")
        need = peer.num_blocks * block_bytes(self.layout)
        if peer.num_blocks == 0 or peer.region_bytes != need:
            raise KVTransferError(f"decode worker {who} advertises a KV region of "
                                  f"{peer.region_bytes} bytes for {peer.num_blocks} blocks; the "
                                  f"layout needs {need}")
        outside = [b for b in target.block_ids if b >= peer.num_blocks]
        if outside:
            raise KVTransferError(f"decode worker {who}: blocks {outside[:8]} outside its pool "
                                  f"of {peer.num_blocks}")

    def open(self, request_id: str, kv: torch.Tensor, target: TransferTarget) -> KVSendStream:
        check_layout(self.layout, target.layout)
        if kv.data_ptr() != self.base:
            raise KVTransferError("the nixl sender registered another KV pool")
        try:
            peer = pb.NixlPeer.FromString(target.metadata)
        except Exception as exc:
            raise KVTransferError(f"bad NIXL metadata from {target.engine_id}: {exc}") from exc
        if not peer.agent_name:
            raise KVTransferError(f"decode worker {target.engine_id} sent no NIXL metadata "
                                  "(does it run --kv-transport nixl?)")
        self._check_peer(peer, target)
        remote = self._remotes.get(peer.agent_name)
        if remote is None:
            loaded = self.agent.add_remote_agent(peer.agent_metadata)
            remote = loaded.decode() if isinstance(loaded, bytes) else loaded
            self._remotes[peer.agent_name] = remote
        return _NixlSendStream(self, request_id, target, peer, remote)

    async def close(self) -> None:
        if self._progressing is not None:
            self._progressing.cancel()
        for remote in self._remotes.values():
            try:
                self.agent.remove_remote_agent(remote)
            except Exception:
                pass
        self.agent.deregister_memory(self._registration)


class NixlKVReceiver(KVReceiver):
    """Registers the decode worker's pool; completes requests from NIXL notifications.
    checksum: require the senders' checksums and verify them on the pool (--kv-checksum);
    auth: the deployment token notices must be signed with (None: an open deployment)."""

    name = "nixl"

    def __init__(self, sink: KVSink, address: str, progress_thread: bool = False,
                 lease_s: float = 60.0, checksum: bool = True,
                 auth: ClusterAuth | None = None) -> None:
        self.sink = sink
        self._address = address
        self.lease_s = lease_s
        self.intake = Intake(sink, checksum)
        self.auth = auth or ClusterAuth()
        kv = sink.pool
        self.agent_name = f"pdserve-decode-{address}-{os.getpid()}"
        self.agent = _agent(self.agent_name, progress_thread)
        mem, dev = _memory(kv)
        if not kv.is_contiguous():
            raise KVTransferError("the nixl receiver registers its KV pool as one region: the "
                                  "pool must be contiguous")
        # Exactly the pool tensor: its first byte to its last, nothing around it (a view of a
        # larger allocation would register only itself too).
        self.region = (kv.data_ptr(), kv.numel() * kv.element_size(), dev)
        self._registration = self.agent.register_memory([(*self.region, "")], mem)
        self._metadata = pb.NixlPeer(agent_name=self.agent_name,
                                     agent_metadata=self.agent.get_agent_metadata(),
                                     base_address=kv.data_ptr(), num_blocks=kv.shape[2],
                                     device_id=dev, memory_type=mem,
                                     region_bytes=self.region[1]).SerializeToString()
        self._task = asyncio.get_running_loop().create_task(self._poll())

    one_sided = True

    def address(self) -> str:
        return self._address

    def metadata(self) -> bytes:
        return self._metadata

    async def _poll(self) -> None:
        while True:
            try:
                notifs = self.agent.get_new_notifs()
            except Exception:
                log.exception("reading NIXL notifications failed")
                notifs = {}
            for messages in notifs.values():
                for msg in messages:
                    await self._notified(msg)
            busy = self.sink.expecting()
            await asyncio.sleep(_POLL_BUSY_S if busy else _POLL_IDLE_S)

    async def _notified(self, msg: bytes) -> None:
        try:
            chunk = chunk_from_bytes(msg)
        except Exception as exc:
            log.warning("ignoring a NIXL notification that is not a KV message: %s", exc)
            return
        if not self.auth.verify(notice_fields(chunk), chunk.signature):
            log.warning("request %s: ignoring a NIXL notification without the deployment's "
                        "signature", chunk.request_id)
            return
        self.sink.sender_done(chunk.request_id)   # no more WRITEs for it: kept-aside blocks go
        if not chunk.last:
            return                               # the sender's abort notice
        try:
            check_layout(self.sink.layout, layout_from_pb(chunk.layout))
        except KVTransferError as exc:
            log.warning("request %s: %s", chunk.request_id, exc)
            return
        try:        # the WRITEs are not seen: the notice's claims are checked instead
            self.intake.admit(chunk.request_id, chunk.block_ids, None, chunk.checksums)
            await self.intake.complete(chunk.request_id, chunk.first_token_id,
                                       first_logprob_of(chunk))
        except Refused as exc:
            if exc.kind != "unknown":            # unknown: aborted meanwhile
                log.warning("%s", exc)
            await self.intake.reject(exc)

    async def close(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self.agent.deregister_memory(self._registration)
