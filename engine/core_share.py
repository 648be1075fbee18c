"""How many threads a CPU worker's next step runs on, when it shares its cores with others.

`pdserve up` starts a prefill and a decode worker on one host, each with every core
(--threads 0): one worker's threads use the cores while the other has nothing to compute (the
prefill worker once a burst's prompts are done, the decode worker while it waits for KV). While
both compute, twice as many threads as cores take turns: every parallel region ends when its
slowest thread does, and that thread is often the one the kernel has just taken off its core for
the other process's, so both workers slow down far more than by half. Measured on 2 cores, a
prefill and a decode process computing side by side (docs/performance.md, "Sharing the cores"):
two threads each gave a third to a half of the tokens a second of one thread each.

CoreShare is the remedy: before each step it reads how busy the host's cores (those this process
may run on) were since its last look, from /proc/stat, takes away this process's own CPU time
(time.process_time), and runs the step on as many of its threads as the other processes left
idle: all of them while the other worker waits, one each while both compute. A core counts as
idle when more than MIN_IDLE of it was: what another worker gets is less than it would take
while our threads crowd it, and the gateway and clients take a little of a core. The figures
are per-core jiffies (10 ms), so it decides at most every `interval_s` and keeps its last choice
in between.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

STAT = Path("/proc/stat")
# a core is free for a thread when more than this share of it was idle since the last look: a
# worker that computes beside our threads gets only part of a core (three threads on two cores:
# two thirds each), the gateway and clients take a fifth or less
MIN_IDLE = 0.55


def _busy_jiffies(text: str, cpus: set[int]) -> int | None:
    """Busy jiffies (user, nice, system, irq, softirq, steal) summed over `cpus`, from /proc/stat
    text; None when a listed CPU has no line."""
    total, seen = 0, 0
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        try:
            cpu = int(name[3:])
        except ValueError:
            continue
        if cpu not in cpus:
            continue
        v = [int(f) for f in fields[:8]] + [0] * max(0, 8 - len(fields))
        total += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
        seen += 1
    return total if seen == len(cpus) else None


class CoreShare:
    """Threads for the next step: `max_threads` less the cores others kept busy, at least 1.

    Call `threads()` before each step on the thread that runs it; it sets torch's thread count
    (which our CPU kernels read per call) when the count changes."""

    def __init__(self, max_threads: int, interval_s: float = 0.1,
                 stat_path: Path = STAT, cpus: set[int] | None = None) -> None:
        self.max_threads = max_threads
        self.interval_s = interval_s
        self.stat_path = stat_path
        self.cpus = set(cpus if cpus is not None else os.sched_getaffinity(0))
        self.tick = os.sysconf("SC_CLK_TCK")
        self.current = max_threads
        self.others = 0.0                      # cores the other processes kept busy, last look
        self.changes = 0
        self._last: tuple[float, float, int] | None = None

    @classmethod
    def for_worker(cls, threads: int, device: str, tensor_parallel: int) -> CoreShare | None:
        """The share of a worker's engine thread, or None where its thread count stays fixed:
        not on a CPU, one thread, tensor-parallel ranks (each a process with its own count), or
        no readable /proc/stat."""
        if not device.startswith("cpu") or threads <= 1 or tensor_parallel > 1:
            return None
        share = cls(threads)
        if share._sample() is None:
            log.info("cannot read per-CPU times from %s: %d threads every step", STAT, threads)
            return None
        return share

    def _sample(self) -> tuple[float, float, int] | None:
        try:
            busy = _busy_jiffies(self.stat_path.read_text(), self.cpus)
        except OSError:
            return None
        if busy is None:
            return None
        return time.monotonic(), time.process_time(), busy

    def threads(self) -> int:
        now = time.monotonic()
        if self._last is not None and now - self._last[0] < self.interval_s:
            return self.current
        sample = self._sample()
        if sample is None:
            return self.current
        if self._last is not None and sample[0] > self._last[0]:
            wall = sample[0] - self._last[0]
            busy = (sample[2] - self._last[2]) / self.tick
            own = sample[1] - self._last[1]
            self.others = max(0.0, busy - own) / wall
            free = len(self.cpus) - self.others
            n = max(1, min(self.max_threads, int(free + (1.0 - MIN_IDLE))))
            if n != self.current:
                self._set(n)
        self._last = sample
        return self.current

    def _set(self, n: int) -> None:
        import torch

        torch.set_num_threads(n)
        self.current = n
        self.changes += 1
