"""Sharing a host's cores between workers (engine.core_share): each step of a CPU worker runs on
as many of its threads as the other processes left idle.

The arithmetic on /proc/stat text and a stepped clock; then the real thing: processes that keep
every core busy take the worker down to one thread, and its own computing (its real CPU time)
does not count against it; an AsyncEngine on a real model runs its steps on the count the share
sets; and which workers get a share. Where a test needs the host otherwise idle, the share reads
an `OwnHost` instead of /proc/stat: this process's real CPU time plus simulated others, so that
the other processes of a busy test machine cannot change the outcome.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch

from engine import core_share
from engine.async_engine import AsyncEngine
from engine.core_share import CoreShare, _busy_jiffies
from engine.request import Request, SamplingParams
from tests.conftest import make_engine
from tests.waiting import wait_until

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


class OwnHost:
    """/proc/stat text (CoreShare reads it as its stat_path) of a host where only this process
    and, while `others_busy`, other processes keeping every core busy run: the busy jiffies are
    this process's real CPU time (utime + stime of /proc/self/stat, which process_time also
    counts) plus the simulated others'. The machine's real other processes stay out of it."""

    def __init__(self, cpus: set[int]) -> None:
        self.cpus = sorted(cpus)
        self.tick = os.sysconf("SC_CLK_TCK")
        self.others_busy = False
        self._others = 0.0                       # the simulated others' jiffies so far
        self._at = time.monotonic()

    def read_text(self) -> str:
        now = time.monotonic()
        if self.others_busy:
            self._others += len(self.cpus) * (now - self._at) * self.tick
        self._at = now
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        busy = int(fields[11]) + int(fields[12]) + int(self._others)    # utime, stime
        return "".join(f"cpu{c} {busy if i == 0 else 0} 0 0 0 0 0 0 0 0 0\n"
                       for i, c in enumerate(self.cpus))


def _spin(stop, started) -> None:
    started.set()
    while not stop.is_set():
        pass


def _spinners(n: int):
    """n processes that keep a core busy each until `stop` is set; back once every one spins."""
    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    started = [ctx.Event() for _ in range(n)]
    procs = [ctx.Process(target=_spin, args=(stop, e), daemon=True) for e in started]
    for p in procs:
        p.start()
    for e in started:                          # spawned interpreters: slow on a busy host
        if not e.wait(120):
            stop.set()
            raise TimeoutError(f"{n} spinners did not all start within 120 s")
    return stop, procs


def _busy_for(cpu_s: float) -> None:
    """Computes on this thread until this process has used cpu_s more seconds of CPU."""
    end = time.process_time() + cpu_s
    x = 0
    while time.process_time() < end:
        x += 1


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc/stat")
def test_real_processes_on_every_core_leave_one_thread_and_our_own_work_does_not_count():
    cpus = len(os.sched_getaffinity(0))
    share = CoreShare(max(2, cpus), interval_s=0.0)
    before = torch.get_num_threads()
    try:
        stop, procs = _spinners(cpus)
        try:
            share.threads()
            # a look at a stretch in which the spinners kept every core busy (a busier host
            # only keeps them busier)
            wait_until(lambda: share.threads() == 1, 60,
                       lambda: f"one thread: others busy {share.others:.2f} cores of {cpus}")
            assert torch.get_num_threads() == 1
        finally:
            stop.set()
            for p in procs:
                p.join(10)
        # Our own computing, on a host where nothing else runs (OwnHost: the machine's other
        # processes left out): first others keep every core busy, then only we compute.
        host = OwnHost(share.cpus)
        own = CoreShare(max(2, cpus), interval_s=0.0, stat_path=host, cpus=share.cpus)
        host.others_busy = True
        own.threads()
        _busy_for(0.1)
        assert own.threads() == 1 and torch.get_num_threads() == 1, own.others
        host.others_busy = False
        t0 = time.monotonic()
        _busy_for(0.5)                               # this process computes on one core
        wall = time.monotonic() - t0
        assert own.threads() == max(2, cpus), f"others busy {own.others:.2f} cores"
        assert torch.get_num_threads() == max(2, cpus)
        # the others' CPU time it measured is a tick or two of rounding, not our 0.5 s
        assert own.others * wall < 0.1, (own.others, wall)
    finally:
        torch.set_num_threads(before)


def test_which_workers_get_a_share():
    assert CoreShare.for_worker(2, "cpu", 1) is not None
    assert CoreShare.for_worker(1, "cpu", 1) is None          # nothing to share
    assert CoreShare.for_worker(2, "cpu", 2) is None          # tensor-parallel ranks
    assert CoreShare.for_worker(2, "cuda:0", 1) is None


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_the_engine_thread_runs_each_step_on_the_count_the_share_sets(tiny_model_dir):
    """A real AsyncEngine: while other processes keep every core busy (OwnHost's simulated
    ones) its steps run on one thread, from the share's first look on; every step on the count
    the share had set (read on the engine thread after each step, as the worker's metrics do)."""
    cpus = len(os.sched_getaffinity(0))
    host = OwnHost(set(os.sched_getaffinity(0)))
    host.others_busy = True
    share = CoreShare(max(2, cpus), interval_s=0.1, stat_path=host)
    seen: list[tuple[int, int, int]] = []
    eng = make_engine(tiny_model_dir, num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)

    async def run():
        aengine = AsyncEngine(eng, cores=share, on_step=lambda s: seen.append(
            (share.changes, torch.get_num_threads(), share.current)))
        aengine.start()
        try:
            n = 0
            while sum(1 for changes, _, _ in seen if changes) < 20:   # 20 steps since its look
                n += 1                                 # requests one after another
                assert n <= 50, f"the share never changed the count: {seen[:20]}"
                q = await aengine.add(Request(f"r{n}", [1, 2, 3],
                                              SamplingParams(temperature=0.0, max_tokens=50,
                                                             ignore_eos=True)))
                while not (await asyncio.wait_for(q.get(), 60)).finished:
                    pass
        finally:
            aengine.stop()

    before = torch.get_num_threads()
    try:
        asyncio.run(run())
    finally:
        torch.set_num_threads(before)
    # the first look took the engine to one thread, for good: every step since ran on it
    assert share.changes == 1, seen
    since = [(t, c) for changes, t, c in seen if changes]
    assert all(t == c == 1 for t, c in since), since[:20]
