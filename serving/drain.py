"""A worker's graceful drain: what SIGTERM starts (serving.worker).

    SIGTERM --> health NOT_SERVING (readiness fails) --> leave the registry (the gateway stops
    routing here within its poll) --> refuse new work (UNAVAILABLE: the gateway tries another
    worker) --> wait for the calls running to end, at most --drain-timeout --> stop the server
    (calls still running end; the gateway moves a decode stream to another decode worker)

Only the calls that start work are refused while draining (`WORK_METHODS`: Decode, Prefill):
the KV a prefill worker pushes for a reservation made here (PushKV), Abort, Stats and health go
on, so a request accepted before the drain finishes. A second SIGTERM or SIGINT ends the wait.
"""

from __future__ import annotations

import asyncio
import time

import grpc

from cluster.auth import refusal

# method -> handler kind: the calls that start a request's work on a worker
WORK_METHODS = {"/pdserve.v1.DecodeWorker/Decode": "unary_stream",
                "/pdserve.v1.PrefillWorker/Prefill": "unary_unary"}
DRAINING_MESSAGE = "this worker is draining (shutting down): send the request to another worker"


class Drain(grpc.aio.ServerInterceptor):
    """Counts the work calls running and, once `start()` was called, refuses new ones."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._changed = asyncio.Event()

    async def intercept_service(self, continuation, details):
        kind = WORK_METHODS.get(details.method or "")
        if kind is None:
            return await continuation(details)
        if self.draining:
            return refusal(kind, grpc.StatusCode.UNAVAILABLE, DRAINING_MESSAGE)
        handler = await continuation(details)
        return None if handler is None else self._counted(handler, kind)

    def _counted(self, handler, kind: str):
        if kind == "unary_stream":
            inner = handler.unary_stream

            async def stream(request, context):
                self._enter()
                try:
                    async for reply in inner(request, context):
                        yield reply
                finally:
                    self._leave()
            return handler._replace(unary_stream=stream)
        inner = handler.unary_unary

        async def unary(request, context):
            self._enter()
            try:
                return await inner(request, context)
            finally:
                self._leave()
        return handler._replace(unary_unary=unary)

    def _enter(self) -> None:
        self.in_flight += 1

    def _leave(self) -> None:
        self.in_flight -= 1
        self._changed.set()

    def start(self) -> None:
        """From now on new work calls are refused."""
        self.draining = True

    async def wait(self, timeout_s: float, cut_short: asyncio.Event | None = None) -> int:
        """Wait until no work call runs, at most timeout_s (or until `cut_short` is set); ->
        how many still run."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight > 0 and (cut_short is None or not cut_short.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
            except asyncio.TimeoutError:
                pass
        return self.in_flight
