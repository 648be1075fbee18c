"""Sharing a host's cores between workers (engine.core_share): each step of a CPU worker runs on
as many of its threads as the other processes left idle.

The arithmetic on /proc/stat text and a stepped clock; then the real thing: processes that keep
every core busy take the worker down to one thread, and its own computing does not count
against it; an AsyncEngine on a real model runs its steps on the count the share sets; and which
workers get a share.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time

import pytest
import torch

from engine import core_share
from engine.async_engine import AsyncEngine
from engine.core_share import CoreShare, _busy_jiffies
from engine.request import Request, SamplingParams
from tests.conftest import make_engine

STAT = """cpu  900 0 300 5000 10 0 0 0 0 0
cpu0 100 1 20 3000 5 2 3 4 0 0
cpu1 200 0 30 2000 5 0 0 0 0 0
cpu2 7 0 0 100 0 0 0 0 0 0
intr 12345
ctxt 999
"""


def test_busy_jiffies_sum_the_listed_cpus_busy_fields():
    # user nice system (idle iowait: not busy) irq softirq steal
    assert _busy_jiffies(STAT, {0}) == 100 + 1 + 20 + 2 + 3 + 4
    assert _busy_jiffies(STAT, {0, 1}) == 130 + 230
    assert _busy_jiffies(STAT, {2}) == 7
    assert _busy_jiffies(STAT, {0, 5}) is None          # a CPU of ours has no line


class Clock:
    """time.monotonic / time.process_time stand-ins the test steps."""

    def __init__(self) -> None:
        self.wall = 100.0
        self.cpu = 5.0

    def monotonic(self) -> float:
        return self.wall

    def process_time(self) -> float:
        return self.cpu


def stat_text(busy_per_cpu: list[int]) -> str:
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    lines += [f"cpu{i} {b} 0 0 1000 0 0 0 0 0 0" for i, b in enumerate(busy_per_cpu)]
    return "\n".join(lines) + "\n"


def test_threads_follow_the_cores_others_leave_idle(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(core_share, "time", clock)
    stat = tmp_path / "stat"
    busy = [0, 0]
    stat.write_text(stat_text(busy))
    share = CoreShare(2, interval_s=0.1, stat_path=stat, cpus={0, 1})
    share.tick = 100
    set_to = []
    monkeypatch.setattr(share, "_set", lambda n: (set_to.append(n), setattr(share, "current", n)))
    assert share.threads() == 2                      # no look yet: every thread

    def after(wall_s: float, others: float, own: float = 0.0) -> int:
        """wall_s seconds on, the other processes busy `others` cores, this one `own`."""
        clock.wall += wall_s
        clock.cpu += own * wall_s
        jiffies = round((others + own) * wall_s * 100)
        busy[0] += jiffies // 2
        busy[1] += jiffies - jiffies // 2
        stat.write_text(stat_text(busy))
        return share.threads()

    assert after(0.2, others=2.0) == 1               # another worker computes on both cores
    assert after(0.2, others=1.0, own=1.0) == 1      # ... on one, we on the other
    assert after(0.2, others=0.0, own=1.0) == 2      # it waits: our own time does not count
    assert after(0.2, others=0.3, own=1.7) == 2      # a gateway's and a client's bits
    assert after(0.2, others=0.6, own=1.4) == 1      # a worker crowded to 0.6 of a core
    assert share.others == pytest.approx(0.6, abs=0.01)
    # within interval_s the last choice stands and the file is not read
    stat.unlink()
    clock.wall += 0.05
    assert share.threads() == 1
    clock.wall += 0.1                                # unreadable now: the last choice stands
    assert share.threads() == 1
    assert set_to == [1, 2, 1]


def test_the_count_never_exceeds_max_threads(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(core_share, "time", clock)
    stat = tmp_path / "stat"
    stat.write_text(stat_text([0] * 8))
    share = CoreShare(3, stat_path=stat, cpus=set(range(8)))
    monkeypatch.setattr(share, "_set", lambda n: setattr(share, "current", n))
    share.threads()
    clock.wall += 1.0
    assert share.threads() == 3                      # 8 idle cores, 3 threads asked for


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def _spinners(n: int):
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    return stop, procs


def _busy_for(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc/stat")
def test_real_processes_on_every_core_leave_one_thread_and_our_own_work_does_not_count():
    cpus = len(os.sched_getaffinity(0))
    share = CoreShare(max(2, cpus), interval_s=0.0)
    before = torch.get_num_threads()
    stop, procs = _spinners(cpus)
    try:
        time.sleep(1.0)                              # the spinners start (spawned interpreters)
        share.threads()
        time.sleep(0.5)
        assert share.threads() == 1, f"others busy {share.others:.2f} cores of {cpus}"
        assert torch.get_num_threads() == 1
    finally:
        stop.set()
        for p in procs:
            p.join(10)
    try:
        time.sleep(0.3)
        share.threads()
        _busy_for(0.5)                               # this process computes on one core
        assert share.threads() == max(2, cpus), f"others busy {share.others:.2f} cores"
        assert torch.get_num_threads() == max(2, cpus)
    finally:
        torch.set_num_threads(before)


def test_which_workers_get_a_share():
    assert CoreShare.for_worker(2, "cpu", 1) is not None
    assert CoreShare.for_worker(1, "cpu", 1) is None          # nothing to share
    assert CoreShare.for_worker(2, "cpu", 2) is None          # tensor-parallel ranks
    assert CoreShare.for_worker(2, "cuda:0", 1) is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc/stat")
def test_the_engine_thread_runs_each_step_on_the_count_the_share_sets(tiny_model_dir):
    """A real AsyncEngine: while other processes keep every core busy its steps run on one
    thread (read on the engine thread after each step, as the worker's metrics do)."""
    cpus = len(os.sched_getaffinity(0))
    share = CoreShare(max(2, cpus), interval_s=0.1)
    seen: list[int] = []
    eng = make_engine(tiny_model_dir, num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)

    async def run():
        aengine = AsyncEngine(eng, on_step=lambda s: seen.append(torch.get_num_threads()),
                              cores=share)
        aengine.start()
        try:
            end, n = time.monotonic() + 2.0, 0
            while time.monotonic() < end:               # requests one after another, 2 s
                n += 1
                q = await aengine.add(Request(f"r{n}", [1, 2, 3],
                                              SamplingParams(temperature=0.0, max_tokens=200,
                                                             ignore_eos=True)))
                while not (await asyncio.wait_for(q.get(), 60)).finished:
                    pass
        finally:
            aengine.stop()

    stop, procs = _spinners(cpus)
    try:
        time.sleep(1.0)
        asyncio.run(run())
    finally:
        stop.set()
        for p in procs:
            p.join(10)
    # from its first look on, the share took the engine to one thread (a look between two
    # spinners' time slices may see a core free: most steps, not all)
    assert share.changes >= 1 and 1 in seen, seen[:20]
    after = seen[seen.index(1):]
    assert after.count(1) >= 0.8 * len(after), (after.count(1), len(after))
