"""A step's inputs in one place, allocated once: a host staging area and its device mirror.

Regions are declared once (name, element count, dtype) at fixed, 8-byte aligned offsets, in
declaration order. Each step writes what it uses into the host regions (`host[name]`, numpy
views: a Python list is written in one C loop) and `upload(name, count)` copies everything up
to `count` elements of region `name` to the device in ONE host-to-device copy; the device views
(`dev[name]`) keep their addresses for the life of the buffers, which is what CUDA graphs
need. Declare the region that grows most (block tables) last, so a step copies only the part it
used. On a GPU the host side is pinned and the copy is asynchronous: `wait_writable()` (called
before a step writes the host side) waits for an event recorded after the last copy, which has
long completed when the previous step synced for its sampled tokens, but not after a step that
sampled nothing (a prompt chunk). On CPUs host and device are the same memory and `upload` does
nothing.

    bytes: | input_ids | positions | ... | block_tables (rows used) ........ |
           0                               ^ upload("block_tables", B * W) copies up to here
"""

from __future__ import annotations

import numpy as np
import torch

_ALIGN = 8


class StepBuffers:
    def __init__(self, regions: list[tuple[str, int, torch.dtype]], device: torch.device) -> None:
        self.device = device
        self._offsets: dict[str, tuple[int, int, torch.dtype]] = {}
        off = 0
        for name, numel, dtype in regions:
            if name in self._offsets:
                raise ValueError(f"region {name!r} declared twice")
            size = max(int(numel), 1) * torch.empty((), dtype=dtype).element_size()
            self._offsets[name] = (off, size, dtype)
            off += -(-size // _ALIGN) * _ALIGN
        self.nbytes = off
        self.copies = device.type != "cpu"
        self._host = torch.zeros(off, dtype=torch.uint8, pin_memory=self.copies)
        self._dev = (torch.zeros(off, dtype=torch.uint8, device=device) if self.copies
                     else self._host)
        self._copied = torch.cuda.Event() if self.copies else None
        self._pending = False
        self.host: dict[str, np.ndarray] = {}
        self.dev: dict[str, torch.Tensor] = {}
        for name, (start, size, dtype) in self._offsets.items():
            self.host[name] = self._host[start:start + size].view(dtype).numpy()
            self.dev[name] = self._dev[start:start + size].view(dtype)

    def end(self, name: str, count: int) -> int:
        """Byte offset just past `count` elements of region `name`."""
        start, size, dtype = self._offsets[name]
        return start + count * torch.empty((), dtype=dtype).element_size()

    def wait_writable(self) -> None:
        """Until the last upload has read the host side (then it may be written again)."""
        if self._pending:
            self._copied.synchronize()
            self._pending = False

    def upload(self, name: str | None = None, count: int = 0) -> None:
        """Copy the host side to the device, up to `count` elements of `name` (all: None)."""
        if not self.copies:
            return
        n = self.nbytes if name is None else self.end(name, count)
        self._dev[:n].copy_(self._host[:n], non_blocking=True)
        self._copied.record(torch.cuda.current_stream(self.device))
        self._pending = True

