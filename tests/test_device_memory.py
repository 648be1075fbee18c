"""KV pool sizing on a GPU shared by two workers (`pdserve up` on one GPU: prefill and decode
at --gpu-memory-utilization 0.45 each, started together). The device is simulated through the
sizing's seam (engine.device_memory.DeviceMemory): a shared table of what each process holds
(its CUDA context, its torch allocator's bytes, its memory outside torch). Two real processes
run the runner's sizing steps in the order that broke the old arithmetic: both snapshot before
either loads, and the first allocates its pool before the second sizes its own."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from engine.device_memory import (NON_TORCH_CAP, DeviceMemory, MemorySnapshot, check_start,
                                  kv_budget)

GIB = 1 << 30
TOTAL = 80 * GIB
CONTEXT = GIB // 2
WEIGHTS = 16 * GIB            # an 8B model in bf16
ACTIVATIONS = 3 * GIB
CUBLAS = 64 << 20             # outside torch, after loading


class SharedDevice(DeviceMemory):
    """Process `me`'s view of a device whose bytes per process live in `table`:
    [context, torch reserved, outside torch] for each process."""

    def __init__(self, table, me: int) -> None:
        self.table, self.me = table, me
        self.table[3 * me] = CONTEXT          # the context exists before the first query

    def _add(self, slot: int, n: int) -> None:
        with self.table.get_lock():
            self.table[3 * self.me + slot] += n

    def torch_alloc(self, n: int) -> None:
        self._add(1, n)

    def other_alloc(self, n: int) -> None:
        self._add(2, n)

    def info(self) -> tuple[int, int]:
        return TOTAL - sum(self.table), TOTAL

    def reserved(self) -> int:
        return self.table[3 * self.me + 1]

    def settle(self) -> None:
        pass


def _worker(table, me, util, started, loaded, first_pool, out):
    mem = SharedDevice(table, me)
    start = MemorySnapshot.take(mem)          # the runner's first step
    check_start(start, util)
    started.wait()                            # both took their snapshot before either loads
    mem.torch_alloc(WEIGHTS)
    loaded.wait()
    if me == 1:
        first_pool.wait()                     # the other worker's pool is already there
    before = MemorySnapshot.take(mem)         # just before the profiled step
    mem.torch_alloc(ACTIVATIONS)              # the profiled step's peak, then freed
    peak = mem.reserved()
    mem.torch_alloc(-ACTIVATIONS)
    mem.other_alloc(CUBLAS)
    free, total = mem.info()
    old = int(total * util) - peak - (total - free - mem.reserved())   # the old arithmetic
    got = kv_budget(mem, before, util, peak)
    mem.torch_alloc(max(got.kv_bytes, 0))
    if me == 0:
        first_pool.set()
    out.put((me, got.kv_bytes, got.non_torch, got.ignored, old))


def test_two_workers_on_one_gpu_each_get_their_share():
    ctx = mp.get_context("spawn")
    table = ctx.Array("q", 6)
    started, loaded, first_pool, out = ctx.Barrier(2), ctx.Barrier(2), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(table, me, 0.45, started, loaded, first_pool,
                                               out)) for me in (0, 1)]
    for p in procs:
        p.start()
    got = dict((r[0], r[1:]) for r in (out.get(timeout=60) for _ in procs))
    for p in procs:
        p.join(timeout=30)
    for me in (0, 1):
        kv, non_torch, ignored, old = got[me]
        # its share, less its own weights, peak activations and outside-torch bytes
        assert kv == int(TOTAL * 0.45) - WEIGHTS - ACTIVATIONS - CUBLAS
        assert non_torch == CUBLAS
    assert got[1][3] < 0            # the old arithmetic: no room for KV blocks
    used = sum(table)
    assert used <= TOTAL * 0.9 + 2 * CONTEXT + 2 * CUBLAS


def test_a_device_without_the_share_free_is_refused_at_start():
    class Busy(DeviceMemory):
        def __init__(self):
            pass

        def info(self):
            return 30 * GIB, TOTAL

        def reserved(self):
            return 0

    with pytest.raises(ValueError, match="only 30.0 GiB are free"):
        check_start(MemorySnapshot.take(Busy()), 0.45)


def test_growth_beyond_the_cap_is_not_this_process():
    class Grows(DeviceMemory):
        def __init__(self):
            self.free = TOTAL - CONTEXT

        def info(self):
            return self.free, TOTAL

        def reserved(self):
            return 0

    mem = Grows()
    start = MemorySnapshot.take(mem)
    mem.free -= 10 * GIB
    got = kv_budget(mem, start, 0.5, torch_peak=GIB)
    assert got.non_torch == NON_TORCH_CAP and got.ignored == 10 * GIB - NON_TORCH_CAP
    assert got.kv_bytes == int(TOTAL * 0.5) - GIB - NON_TORCH_CAP
