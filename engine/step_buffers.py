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

from engine.pinned import pinned_empty

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
        # page-locked for the step's one asynchronous copy, exactly its bytes (engine.pinned)
        self._host = pinned_empty((off,), torch.uint8, pin=self.copies).zero_()
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



class GrammarMasks:
    """The step's grammar bitmasks, int32 [rows, words] on the host (engine.structured's
    layout), in one buffer kept across steps and grown only when a step samples more rows than
    any before. Not page-locked: the sampler's copy to the device reads pageable memory before
    it returns, so the next step may write the buffer again."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._buf: torch.Tensor | None = None

    def take(self, rows: int) -> torch.Tensor:
        """The first `rows` rows, every token allowed in each."""
        if self._buf is None or self._buf.shape[0] < rows:
            from engine.structured.bitmask import new_bitmask   # only once grammars are used

            have = 0 if self._buf is None else self._buf.shape[0]
            self._buf = new_bitmask(max(rows, 2 * have), self.vocab_size)
            return self._buf[:rows]
        view = self._buf[:rows]
        view.fill_(-1)
        return view
