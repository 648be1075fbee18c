"""How much of a GPU's memory this worker's KV pool may take.

`--gpu-memory-utilization U` is the share of the device this process may use, whatever other
processes hold: two workers of `pdserve up` on one GPU at 0.45 each. A snapshot of the device
is taken when the runner starts, before the weights load (`MemorySnapshot.take`): the device
must have U x total free then, or the worker refuses to start naming what holds it. Another
is taken after loading, just before the profiled step; after it the budget is

    U x total - (this process's torch peak: weights, activations) - (its memory outside torch:
    the growth of the device's use over the profiled step, less its own torch growth) - graphs

so another process's weights or pool never count against this one. The weights' load makes
no memory outside torch; the profiled step does (cuBLAS handles, Triton modules), and the
window is a few seconds. Growth beyond NON_TORCH_CAP is another process that allocated in it
(workers starting together) and is not counted.

`DeviceMemory` is the seam: what the sizing reads of the device (CUDA's allocator and
cudaMemGetInfo here; tests simulate a device shared by processes).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

NON_TORCH_CAP = 2 << 30       # a process's memory outside torch's allocator, at most


class DeviceMemory:
    """A CUDA device as the pool sizing reads it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def info(self) -> tuple[int, int]:
        """(free, total) bytes of the whole device, every process included."""
        return torch.cuda.mem_get_info(self.device)

    def reserved(self) -> int:
        """Bytes this process's torch allocator holds on the device."""
        return torch.cuda.memory_reserved(self.device)

    def settle(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class MemorySnapshot:
    used: int          # the device's bytes in use (every process)
    reserved: int      # this process's torch bytes
    free: int
    total: int

    @classmethod
    def take(cls, mem: DeviceMemory) -> "MemorySnapshot":
        free, total = mem.info()
        return cls(total - free, mem.reserved(), free, total)


@dataclass(frozen=True)
class Budget:
    kv_bytes: int      # what the pool may take
    non_torch: int     # this process's memory outside torch, as counted
    ignored: int       # growth of the device's use by other processes, not counted


def check_start(start: MemorySnapshot, utilization: float) -> None:
    """ValueError when the device lacks `utilization` x its memory free at start."""
    want = int(start.total * utilization)
    if start.free < want:
        raise ValueError(
            f"--gpu-memory-utilization {utilization:.2f} asks for {want / 2**30:.1f} GiB of "
            f"this {start.total / 2**30:.1f} GiB device, but only {start.free / 2**30:.1f} GiB "
            f"are free ({start.used / 2**30:.1f} GiB held by other processes): lower it, or "
            "free the device")


def kv_budget(mem: DeviceMemory, start: MemorySnapshot, utilization: float, torch_peak: int,
              graph_reserve: int = 0) -> Budget:
    """What the KV pool may take now (see the module docstring); `start`: the snapshot before
    the profiled step; `torch_peak`: this process's peak torch bytes in it (weights
    included)."""
    now = MemorySnapshot.take(mem)
    growth = max(0, (now.used - start.used) - (now.reserved - start.reserved))
    non_torch = min(growth, NON_TORCH_CAP)
    kv = int(now.total * utilization) - torch_peak - non_torch - graph_reserve
    return Budget(kv, non_torch, growth - non_torch)
