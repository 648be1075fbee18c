"""What every section of `make gpu-check` (pdserve.gpucheck, gpucheck_perf, gpucheck_kv) does on
the device: wait for it, give back what a section held, time a call. torch is imported in the
functions, so the check's modules load without it."""

from __future__ import annotations

import statistics
import time


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def release(device) -> None:
    """Give back what the last section held (runners and their graphs refer to each other: only
    the cycle collector frees them)."""
    import gc

    import torch

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def timed(fn, repeat: int, warmup: int = 3) -> float:
    """The median wall time of `repeat` calls of fn after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
