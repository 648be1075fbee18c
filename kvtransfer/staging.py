"""KV blocks through host memory for transports whose bytes cross the host (grpc), and the CUDA
stream plumbing every transport shares (`use_own_stream`, `recorded`, `wait_for`).

Device -> host (sender), in two halves, so that the thread owning the pool only queues work:

  `HostStaging.gather(kv, block_ids, digest, buffer)`, on the pool's thread (through
  `run_on_pool`: the engine thread on a device; a worker thread on a CPU, where the blocks a
  transfer holds are final), on its current stream behind the step that wrote the blocks: the blocks
  are gathered (index_select, a copy the caller owns: the pool's blocks may be freed and reused as
  soon as it returns, so a `save_done` queued after it cannot change what is sent). On CUDA the
  `digest` (the checksums) is queued there too, and both are copied asynchronously into
  page-locked memory (`buffer`, taken beforehand off that thread with `reserve`) on the staging's
  copy stream, which waits for an event on the pool's stream: the engine's next steps do not
  queue behind the copy, and nothing waits. On CPUs only the gather runs there.

  `Gathered.on_host()`, on the sender's own thread: waits for the copies' event (CUDA) or computes
  the digest of the gathered copy (CPUs), and lends the blocks' bytes (a host tensor over the
  page-locked buffer, or over the gathered copy itself: no further copy) and the checksums; the
  buffer goes back when the block ends.

Host -> device (receiver), in two halves on CUDA, so that the engine thread does no copy of the
bytes: `HostStaging.stage(data)`, on the receiving side's own thread, copies the received host
data into a page-locked buffer; `write_staged(pool, block_ids, staged)`, on the engine thread,
only queues its asynchronous copy to the device and the index into the pool, on the current
stream: engine work queued on that stream afterwards sees the blocks. `write_blocks(pool,
block_ids, data, ready)` is both in one call (CPU pools, where the copy into the pool is the
write, and data already on a device). The buffer is not written again before an event recorded after that copy has
completed. Data already on a device (an NCCL receive, on the receiving thread's own stream) goes
into the pool directly, once the current stream has waited for its `ready` event.

On CPU pools the same code runs with ordinary buffers and no events (every copy is synchronous,
and pinning would fail without CUDA): the CPU tests exercise it.

Buffers: each use holds one buffer exclusively (uses come from several threads); a free buffer
that is too small is dropped for a larger one, so a staging holds at most as many buffers as
uses ever ran at once, each as large as the largest message it carried. Freeing a page-locked
buffer while a copy from it is in flight is safe: torch's pinned-memory allocator reuses it only
after the copies recorded on it have completed.

This module imports neither the generated proto code nor the engine's model code (only
engine.pinned, which needs torch alone), so a device check can drive the exact path of the grpc
transport without them.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from engine.pinned import pinned_empty


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (block ids, a header) on `device` without waiting for the device's
    stream (a pageable copy would sync it, so wait for the engine's queued step): on CUDA through
    page-locked memory, which torch's allocator keeps until the copy is done."""
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor of `shape` and `dtype` over a copy of `data` (a writable one: torch refuses
    to wrap read-only bytes without a warning)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).view(shape)


def use_own_stream(device: torch.device) -> None:
    """Once, on a transport's own thread: `device` becomes its current device (NCCL creates its
    communicators there) and a new stream its current stream, so that what the thread waits for
    on the device (an NCCL operation makes the current stream wait for it) holds that stream,
    never the device's default stream, which the engine computes on. Nothing off CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.set_stream(torch.cuda.Stream(device))


def recorded(device: torch.device):
    """An event after the work queued so far on this thread's current stream of `device`; None
    off CUDA (there every operation has completed when it returns)."""
    if torch.device(device).type != "cuda":
        return None
    event = torch.cuda.Event(blocking=True)      # waits yield the core instead of spinning
    event.record(torch.cuda.current_stream(device))
    return event


def wait_for(ready, tensors: list[torch.Tensor] = ()) -> None:
    """Make this thread's current stream wait for `ready` (a `recorded` event, made on another
    stream) before the work queued on it from now on, without a host sync; `tensors` (written
    on that other stream) then stay allocated until this stream's work queued so far is done
    (record_stream), whoever drops them first. Nothing without an event."""
    if ready is None:
        return
    stream = torch.cuda.current_stream(tensors[0].device if tensors else None)
    stream.wait_event(ready)
    for t in tensors:
        t.record_stream(stream)


@dataclass(eq=False)                    # buffers are found by identity
class _Buffer:
    data: torch.Tensor                  # uint8 [capacity], on the host
    pending: object | None = None       # CUDA event after the last copy from or into it

    @property
    def capacity(self) -> int:
        return self.data.numel()

    def view(self, like: torch.Tensor) -> torch.Tensor:
        """The buffer's head as a tensor of like's dtype and shape."""
        nbytes = like.numel() * like.element_size()
        return self.data[:nbytes].view(like.dtype).view(like.shape)


@dataclass(eq=False)
class Staged:
    """Received blocks in a page-locked buffer, waiting for the engine thread's device copy."""

    buffer: _Buffer
    host: torch.Tensor          # the buffer's head, shaped as the data


@dataclass(eq=False)
class Gathered:
    """Blocks read out of a pool by `HostStaging.gather`, on their way to the host."""

    blocks: torch.Tensor        # [layers, 2, n, block_size, kv_heads, head_dim], the pool's device
    digest: Callable[[torch.Tensor], torch.Tensor] | None = None   # CPUs: applied by on_host
    buffer: _Buffer | None = None       # CUDA: page-locked, holds the blocks once `copied`
    sums: torch.Tensor | None = None    # CUDA: the digest, page-locked, once `copied`
    copied: object | None = None        # CUDA: event after both copies to the host
    staging: "HostStaging | None" = None

    @contextlib.contextmanager
    def on_host(self):
        """-> (the blocks' bytes: a uint8 host tensor in the C order of `blocks`, valid inside
        the block; the digest as ints, [] without one). Blocks until the copies are done: call
        it off the pool's thread and off the event loop. Once only; the buffer goes back after."""
        nbytes = self.blocks.numel() * self.blocks.element_size()
        try:
            if self.buffer is None:          # CPUs: the gathered copy is on the host already
                sums = [] if self.digest is None else self.digest(self.blocks).tolist()
                yield self.blocks.reshape(-1).view(torch.uint8), sums
            else:
                self.copied.synchronize()
                yield self.buffer.data[:nbytes], [] if self.sums is None else self.sums.tolist()
        finally:
            self.release()

    def release(self) -> None:
        """Give the buffer back (on_host does); safe to call again."""
        if self.buffer is not None:
            self.copied.synchronize()        # nothing may still write into it
            self.staging._give_back(self.buffer)
            self.buffer = None


class HostStaging:
    """Reusable host buffers for copies between `device` and host memory; page-locked when
    `device` is a CUDA device. Thread-safe."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._free: list[_Buffer] = []
        self._lock = threading.Lock()
        self._capacity = 0
        self._stream = None                      # CUDA: the copy stream of gather()

    @property
    def capacity(self) -> int:
        """Bytes of host memory the staging holds now, buffers in use included."""
        return self._capacity

    def reserve(self, nbytes: int) -> _Buffer | None:
        """A buffer for one gather() of `nbytes` (CUDA: taking one may allocate page-locked
        memory, slow: do it before the engine command); None on CPUs, where none is needed."""
        if not self.pinned:
            return None
        with torch.cuda.device(self.device):     # page-locked for this device's context
            return self._take(nbytes)

    def gather(self, kv: torch.Tensor, block_ids: list[int],
               digest: Callable[[torch.Tensor], torch.Tensor] | None = None,
               buffer: _Buffer | None = None) -> Gathered:
        """kv[:, :, block_ids] (kv: [layers, 2, blocks, block_size, kv_heads, head_dim] on this
        staging's device) on its way to the host, with `digest(blocks)` (an int64 tensor, e.g.
        kvtransfer.integrity.checksums) if given. On the pool's thread; queues work only (see
        the module's docstring). buffer: from `reserve` (taken here if None or too small)."""
        index = host_to_device(torch.tensor(block_ids, dtype=torch.long), kv.device)
        blocks = kv.index_select(2, index)       # [layers, 2, len(block_ids), bs, heads, dim]
        if not self.pinned:
            return Gathered(blocks, digest)
        sums = None if digest is None else digest(blocks)
        nbytes = blocks.numel() * blocks.element_size()
        if buffer is None or buffer.capacity < nbytes:
            if buffer is not None:
                self._give_back(buffer)
            buffer = self._take(nbytes)
        ready = recorded(self.device)            # the gather and the digest, on the pool's stream
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stream):
            wait_for(ready, [blocks] + ([sums] if sums is not None else []))
            buffer.view(blocks).copy_(blocks, non_blocking=True)
            host_sums = None
            if sums is not None:
                host_sums = torch.empty(sums.shape, dtype=sums.dtype, pin_memory=True)
                host_sums.copy_(sums, non_blocking=True)
            copied = recorded(self.device)
        return Gathered(blocks, None, buffer, host_sums, copied, self)

    def blocks_to_bytes(self, kv: torch.Tensor, block_ids: list[int]) -> bytes:
        """The bytes of `kv[:, :, block_ids]`, in that tensor's C order, at once (gather and
        on_host in one call: blocks until the copy is on the host)."""
        with self.gather(kv, block_ids).on_host() as (data, _):
            return data.numpy().tobytes()

    def stage(self, data: torch.Tensor) -> "Staged | None":
        """Received host `data` in a page-locked buffer, for `write_staged` (CUDA; None where
        there is nothing to stage: a CPU staging, device data). Any thread but the engine's."""
        if not self.pinned or data.device.type != "cpu":
            return None
        with torch.cuda.device(self.device):
            buf = self._take(data.numel() * data.element_size())
        host = buf.view(data)
        host.copy_(data)
        return Staged(buf, host)

    def write_staged(self, pool: torch.Tensor, block_ids: list[int], staged: "Staged") -> None:
        """pool[:, :, block_ids] = the staged data: an asynchronous copy and an index, queued on
        the current stream (the engine thread's only part of a received block)."""
        index = host_to_device(torch.tensor(block_ids, dtype=torch.long), pool.device)
        pool.index_copy_(2, index, staged.host.to(pool.device, non_blocking=True))
        self._give_back(staged.buffer, recorded(self.device))

    def release(self, staged: "Staged") -> None:
        """A staged buffer whose write did not happen (the load ended first)."""
        self._give_back(staged.buffer)

    def write_blocks(self, pool: torch.Tensor, block_ids: list[int], data: torch.Tensor,
                     ready=None) -> None:
        """pool[:, :, block_ids] = data (data: [layers, 2, len(block_ids), block_size, kv_heads,
        head_dim], on the host or on a device). Returns once the copies are queued; work queued
        later on the current stream sees them. ready: device data is complete once this event
        (recorded where it was received) has completed; the current stream waits for it."""
        index = host_to_device(torch.tensor(block_ids, dtype=torch.long), pool.device)
        if data.device.type != "cpu":
            wait_for(ready, [data])
            pool.index_copy_(2, index, data.to(pool.device))
            return
        with self._buffer(data.numel() * data.element_size()) as buf:
            host = buf.view(data)
            host.copy_(data)
            # CPU: `host` itself, read synchronously below; CUDA: a device copy, queued
            pool.index_copy_(2, index, host.to(pool.device, non_blocking=self.pinned))

    @contextlib.contextmanager
    def _buffer(self, nbytes: int):
        """A buffer of at least `nbytes`, held exclusively until the block ends; on CUDA an event
        recorded then guards its next use."""
        buf = self._take(nbytes)
        try:
            yield buf
        finally:
            self._give_back(buf, recorded(self.device))

    def _give_back(self, buf: _Buffer, pending=None) -> None:
        buf.pending = pending
        with self._lock:
            self._free.append(buf)

    def _take(self, nbytes: int) -> _Buffer:
        with self._lock:
            fits = [b for b in self._free if b.capacity >= nbytes]
            buf = min(fits, key=lambda b: b.capacity) if fits else None
            if buf is not None:
                self._free.remove(buf)
            elif self._free:                     # too small: give one up for a larger one
                self._capacity -= self._free.pop().capacity
            if buf is None:
                self._capacity += nbytes
        if buf is None:
            # page-locked by registration: exactly nbytes (torch's pinned allocator rounds up
            # to a power of two and keeps it)
            return _Buffer(pinned_empty((nbytes,), torch.uint8, pin=self.pinned))
        if buf.pending is not None:
            buf.pending.synchronize()            # the last copy out of it has finished
            buf.pending = None
        return buf
