"""KV blocks through host memory, for transports whose bytes cross the host (grpc).

Device -> host bytes (sender): `HostStaging.blocks_to_bytes(kv, block_ids)` gathers the blocks
on the pool's device, copies them into a reusable host buffer (page-locked on CUDA, so the copy
is an asynchronous DMA), waits for that copy only (a CUDA event on the current stream), and
returns the bytes. The gather is queued on the current (default) stream behind the engine step
that wrote the blocks, so it reads final KV without waiting for any event of its own.

Host -> device (receiver): `HostStaging.write_blocks(pool, block_ids, data)` copies host data
into a buffer (page-locked on CUDA), from there asynchronously to the pool's device, and indexes
it into the pool, all on the current stream: engine work queued on that stream afterwards sees
the blocks. The buffer is not written again before an event recorded after that copy has
completed. Data already on a device (an NCCL receive) goes into the pool directly.

On CPU pools the same code runs with ordinary buffers and no events (every copy is synchronous,
and pinning would fail without CUDA): the CPU tests exercise it.

Buffers: each call holds one buffer exclusively (calls come from several threads); a free buffer
that is too small is dropped for a larger one, so a staging holds at most as many buffers as
calls ever ran at once, each as large as the largest message it carried. Freeing a page-locked
buffer while a copy from it is in flight is safe: torch's pinned-memory allocator reuses it only
after the copies recorded on it have completed.

This module imports neither the generated proto code nor the engine, so a device check can drive
the exact path of the grpc transport without them.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable

import torch


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


class HostStaging:
    """Reusable host buffers for copies between `device` and host memory; page-locked when
    `device` is a CUDA device. Thread-safe."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self._free: list[_Buffer] = []
        self._lock = threading.Lock()
        self._capacity = 0

    @property
    def capacity(self) -> int:
        """Bytes of host memory the staging holds now, buffers in use included."""
        return self._capacity

    def blocks_to_bytes(self, kv: torch.Tensor, block_ids: list[int]) -> bytes:
        """The bytes of `kv[:, :, block_ids]` (kv: [layers, 2, blocks, block_size, kv_heads,
        head_dim] on this staging's device), in that tensor's C order. Blocks until the copy is on
        the host: call it off the event loop."""
        return self.blocks_and_digest(kv, block_ids, None)[0]

    def blocks_and_digest(self, kv: torch.Tensor, block_ids: list[int],
                          digest: Callable[[torch.Tensor], torch.Tensor] | None
                          ) -> tuple[bytes, list[int]]:
        """blocks_to_bytes, and `digest(gathered blocks)` (an int64 tensor computed on the
        device, e.g. kvtransfer.integrity.checksums) copied back with them: one wait for both;
        [] without a digest."""
        index = host_to_device(torch.tensor(block_ids, dtype=torch.long), kv.device)
        gathered = kv.index_select(2, index)     # [layers, 2, len(block_ids), bs, heads, dim]
        nbytes = gathered.numel() * gathered.element_size()
        sums = None
        if digest is not None:
            computed = digest(gathered)
            sums = torch.empty(computed.shape, dtype=computed.dtype, pin_memory=self.pinned)
            sums.copy_(computed, non_blocking=self.pinned)
        with self._buffer(nbytes) as buf:
            buf.view(gathered).copy_(gathered, non_blocking=self.pinned)
            copied = self._record()
            if copied is not None:
                copied.synchronize()             # those copies (and what they queued behind)
            return buf.data[:nbytes].numpy().tobytes(), [] if sums is None else sums.tolist()

    def write_blocks(self, pool: torch.Tensor, block_ids: list[int], data: torch.Tensor) -> None:
        """pool[:, :, block_ids] = data (data: [layers, 2, len(block_ids), block_size, kv_heads,
        head_dim], on the host or on a device). Returns once the copies are queued; work queued
        later on the current stream sees them."""
        index = host_to_device(torch.tensor(block_ids, dtype=torch.long), pool.device)
        if data.device.type != "cpu":
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
            buf.pending = self._record()
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
            return _Buffer(torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned))
        if buf.pending is not None:
            buf.pending.synchronize()            # the last copy out of it has finished
            buf.pending = None
        return buf

    def _record(self):
        """An event after the work queued so far on the device's current stream; None on CPU."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event(blocking=True)  # waits yield the core instead of spinning
        event.record(torch.cuda.current_stream(self.device))
        return event
