"""Waiting for an event with a deadline, never for a fixed time: a test that sleeps passes or
fails by how loaded the machine is, and a test that waits for nothing passes when the event is
merely late."""

from __future__ import annotations

import asyncio
import inspect
import time
from pathlib import Path


def wait_until(pred, timeout_s: float, what, procs=(), interval_s: float = 0.2) -> None:
    """Return once pred() is true; TimeoutError naming `what` (a string, or a function giving
    one: the state at the deadline) when it is still false after timeout_s. `procs`: (Popen, log
    path) pairs; one that exits ends the wait with its log."""
    deadline = time.monotonic() + timeout_s
    while True:
        for p, log in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{_name(what)}: process exited with {p.returncode}; log:\n"
                                   + Path(log).read_text()[-3000:])
        if pred():
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s}s for {_name(what)}")
        time.sleep(interval_s)


async def wait_until_async(pred, timeout_s: float, what, interval_s: float = 0.01) -> None:
    """wait_until inside an event loop: pred() (a value, or an awaitable of one) is polled
    between the loop's other work."""
    deadline = time.monotonic() + timeout_s
    while not await _value(pred()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s}s for {_name(what)}")
        await asyncio.sleep(interval_s)


def _name(what) -> str:
    return what() if callable(what) else what


async def _value(result):
    return await result if inspect.isawaitable(result) else result
