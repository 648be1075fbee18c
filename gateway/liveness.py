"""Which workers have stopped answering: a hung worker is found in seconds, a busy one is not.

A worker can stop without going away: a stopped process, a stuck device, a deadlocked
collective, a host swapping. Its sockets stay open, so its calls neither fail nor end; its
registration expires only after the TTL, and gRPC's keepalive gives up after half a minute. A
worker that is merely slow (a long prefill, a large batch on two cores, a tensor-parallel rank
waiting for a peer) is silent on its streams just as long, but its server still answers.

So silence is not the signal; an unanswered question is. While this gateway has calls on a
worker, `Liveness` asks it for its Stats every `interval_s` (the worker's event loop answers
that between steps of its engine thread, whatever the engine is doing). A worker that has not
answered one within `timeout_s` is hung: every watch on it fires (the pipeline moves or
retries its requests), and the router avoids it while it stays silent. A worker that answers
again (resumed) is routed to again.

    watch(w) ──> _Watch(w): refcount, `hung` future, one probe task
                  probe: Stats(timeout_s) ... sleep(interval_s) ... Stats(timeout_s) ...
                  no answer in timeout_s -> hung.set_result(why); router.mark_unreachable(w)
                  then: probe until it answers again -> router.mark_reachable(w)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable, Iterator

import grpc

from cluster.registry import WorkerInfo
from proto import pdserve_pb2, pdserve_pb2_grpc

log = logging.getLogger(__name__)

_STUBS = {"prefill": pdserve_pb2_grpc.PrefillWorkerStub,
          "decode": pdserve_pb2_grpc.DecodeWorkerStub}


class _Watch:
    def __init__(self) -> None:
        self.users = 0
        self.hung: asyncio.Future = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task | None = None


class Liveness:
    """Probes the workers this gateway has calls on (see the module docstring). `channel`:
    address -> the deployment's channel (the router's); `avoid(worker, hung)`: called with
    True when a worker is found hung and False when it answers again. timeout_s 0 turns the
    probes off (a watch then never fires)."""

    def __init__(self, channel: Callable[[str], grpc.aio.Channel],
                 avoid: Callable[[WorkerInfo, bool], None], timeout_s: float = 5.0,
                 interval_s: float = 1.0) -> None:
        if timeout_s < 0 or interval_s <= 0:
            raise ValueError("the probe timeout must be >= 0 and its interval > 0")
        self.channel = channel
        self.avoid = avoid
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self._watches: dict[str, _Watch] = {}
        self._recovering: dict[str, asyncio.Task] = {}

    @contextlib.contextmanager
    def watch(self, worker: WorkerInfo) -> Iterator[asyncio.Future]:
        """A future that completes (with why, a string) if `worker` is found hung while the
        block runs; the worker is probed while any block watches it."""
        w = self._watches.get(worker.id)
        if w is None:
            w = self._watches[worker.id] = _Watch()
            if self.timeout_s:
                w.task = asyncio.ensure_future(self._probe(worker, w))
        w.users += 1
        try:
            yield w.hung
        finally:
            w.users -= 1
            if not w.users and self._watches.get(worker.id) is w:
                del self._watches[worker.id]
                if w.task is not None:
                    w.task.cancel()

    async def _answers(self, worker: WorkerInfo) -> bool:
        """Whether the worker answers a Stats call within timeout_s. A call that fails at once
        (the worker is gone, or refuses) is not a hang: the worker's own calls fail too."""
        stub = _STUBS[worker.role](self.channel(worker.address))
        try:
            await stub.Stats(pdserve_pb2.StatsRequest(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            return exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED
        except grpc.aio.UsageError:          # its channel was closed under it (worker gone)
            pass
        return True

    async def _probe(self, worker: WorkerInfo, w: _Watch) -> None:
        while await self._answers(worker):
            await asyncio.sleep(self.interval_s)
        why = f"it answered no Stats call within {self.timeout_s:g} s (--worker-probe-timeout)"
        log.warning("%s worker %s at %s is hung: %s; moving its requests", worker.role,
                    worker.id, worker.address, why)
        w.hung.set_result(why)
        if self._watches.get(worker.id) is w:
            del self._watches[worker.id]       # later watches start a probe of their own
        self.avoid(worker, True)
        if worker.id not in self._recovering:
            task = asyncio.ensure_future(self._recover(worker))
            self._recovering[worker.id] = task
            task.add_done_callback(lambda _: self._recovering.pop(worker.id, None))

    async def _recover(self, worker: WorkerInfo) -> None:
        """A hung worker is asked again until it answers (then it is routed to again); a
        worker that is gone answers at once with an error, which ends this too."""
        while not await self._answers(worker):
            await asyncio.sleep(self.interval_s)
        log.info("%s worker %s at %s answers again", worker.role, worker.id, worker.address)
        self.avoid(worker, False)

    async def stop(self) -> None:
        tasks = [w.task for w in self._watches.values() if w.task is not None]
        tasks += list(self._recovering.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
