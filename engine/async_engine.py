"""An Engine on its own thread, driven from one asyncio loop.

Contract: every public method is called from the loop's thread. The engine thread is the only
one that touches the Engine; callers talk to it through a command queue, and outputs come back
through per-request asyncio queues. Forward passes release the GIL, so the loop keeps serving
RPCs while a step runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import deque
from typing import Callable

from engine.engine import Engine
from engine.request import Request, RequestOutput, TokenLogprob

log = logging.getLogger(__name__)


class AsyncEngine:
    def __init__(self, engine: Engine, on_step: Callable | None = None) -> None:
        """on_step(StepStats) is called on the engine thread after every step."""
        self.engine = engine
        self.on_step = on_step
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._open_choices: dict[str, int] = {}       # choices of a stream not finished yet
        self._pending_reserve: deque = deque()         # (Request, Future) waiting for blocks
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stop = threading.Event()

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._cmds.put(None)
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ API (loop thread)
    def _call(self, fn: Callable, *args) -> asyncio.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((fn, args, fut))
        return asyncio.wrap_future(fut)

    def open_stream(self, request_id: str, choices: int = 1) -> asyncio.Queue:
        """The queue of a request's outputs (of all its `choices`: RequestOutput.choice says
        which); it closes once every choice has finished."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use on this worker")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        self._open_choices[request_id] = choices
        return q

    def close_stream(self, request_id: str) -> None:
        """Stop delivering the request's outputs; blocks pinned for transfer by outputs not yet
        read are given back."""
        q = self._streams.pop(request_id, None)
        self._open_choices.pop(request_id, None)
        if q is not None:
            self.drain(q)

    def drain(self, q: asyncio.Queue) -> None:
        """Discard a request's unread outputs, giving back the blocks they pin for transfer."""
        while not q.empty():
            self._unpin_unread(q.get_nowait())

    def pin(self, block_ids: list[int]) -> None:
        """Take an extra reference on blocks (given back with unpin), without waiting."""
        if block_ids:
            self._cmds.put((self.engine.pin, (list(block_ids),), None))

    def unpin(self, block_ids: list[int]) -> None:
        """Give back transfer references (RequestOutput.kv_blocks), without waiting."""
        if block_ids:
            self._cmds.put((self.engine.unpin, (list(block_ids),), None))

    def _unpin_unread(self, out: RequestOutput) -> None:
        if out.kv_blocks:
            self.unpin(out.kv_blocks)

    async def add(self, req: Request) -> asyncio.Queue:
        """Queue a request for computation; its outputs arrive on the returned queue."""
        q = self.open_stream(req.request_id)
        try:
            await self.submit(req)
        except BaseException:
            self.close_stream(req.request_id)
            raise
        return q

    async def submit(self, req: Request) -> None:
        """Queue a request whose stream the caller has opened (open_stream) already."""
        await self._call(self.engine.add_request, req)

    async def reserve(self, req: Request) -> list[int]:
        """Decode role: reserve blocks for a prompt whose KV comes from elsewhere. Waits for
        free blocks if needed. The caller must open_stream first and abort on cancellation."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((self._reserve_or_queue, (req, fut), None))
        return await asyncio.wrap_future(fut)

    async def remote_ready(self, request_id: str, first_token: int,
                           logprob: TokenLogprob | None) -> None:
        await self._call(self._remote_ready, request_id, first_token, logprob)

    async def compute_locally(self, request_id: str) -> bool:
        """Decode role: compute a reserved request's prompt here (its KV will not arrive)."""
        return await self._call(self.engine.scheduler.compute_locally, request_id)

    def fail(self, request_id: str, message: str) -> None:
        """End a request with an error output (its stream gets it), freeing its blocks."""
        def run():
            self._abort(request_id)
            self._emit([RequestOutput(request_id, [], [], "error", message)])
        self._cmds.put((run, (), None))

    def abort_choice(self, request_id: str, choice: int) -> None:
        """Abort one choice of an n > 1 request without waiting; its stream gets an "abort"
        output for it when it was still running."""
        def run():
            out = self.engine.abort_choice(request_id, choice)
            if out is not None:
                self._emit([out])
        self._cmds.put((run, (), None))

    async def abort(self, request_id: str) -> bool:
        self.close_stream(request_id)
        return await self._call(self._abort, request_id)

    def abort_nowait(self, request_id: str) -> None:
        """Abort without waiting: safe in `finally` blocks of cancelled handlers."""
        self.close_stream(request_id)
        self._cmds.put((self._abort, (request_id,), None))

    async def release(self, request_id: str) -> None:
        await self._call(self.engine.release, request_id)

    async def block_table(self, request_id: str) -> list[int]:
        return await self._call(self.engine.block_table, request_id)

    def load(self) -> tuple[int, int, int]:
        """(running, waiting, free blocks): a racy snapshot, good enough for routing."""
        s = self.engine.scheduler
        return len(s.running), len(s.waiting) + len(self._pending_reserve), self.engine.pool.num_free

    # ------------------------------------------------------------------ engine thread
    def _reserve_or_queue(self, req: Request, fut: concurrent.futures.Future) -> None:
        try:
            blocks = self.engine.reserve_remote(req)
        except Exception as exc:
            fut.set_exception(exc)
            return
        if blocks is None:
            self._pending_reserve.append((req, fut))
        else:
            self._resolve(req, fut, blocks)

    def _resolve(self, req: Request, fut: concurrent.futures.Future, blocks: list[int]) -> None:
        if fut.set_running_or_notify_cancel():
            fut.set_result(blocks)
        else:                                   # the caller went away while we waited
            self.engine.abort(req.request_id)

    def _retry_reservations(self) -> None:
        while self._pending_reserve:
            req, fut = self._pending_reserve[0]
            if fut.cancelled():
                self._pending_reserve.popleft()
                continue
            blocks = self.engine.reserve_remote(req)
            if blocks is None:
                return
            self._pending_reserve.popleft()
            self._resolve(req, fut, blocks)

    def _remote_ready(self, request_id, first_token, logprob) -> None:
        out = self.engine.remote_ready(request_id, first_token, logprob)
        if out is not None:
            self._emit([out])

    def _abort(self, request_id: str) -> bool:
        kept = deque(p for p in self._pending_reserve if p[0].request_id != request_id)
        found = len(kept) != len(self._pending_reserve)
        self._pending_reserve = kept
        return self.engine.abort(request_id) or found

    def _emit(self, outputs: list[RequestOutput]) -> None:
        def deliver():
            for o in outputs:
                sid = o.stream_id
                q = self._streams.get(sid)
                if q is None:
                    self._unpin_unread(o)          # nobody will send these blocks
                    continue
                q.put_nowait(o)
                if o.finished:
                    left = self._open_choices.get(sid, 1) - 1
                    self._open_choices[sid] = left
                    if left <= 0:
                        self._streams.pop(sid, None)
                        self._open_choices.pop(sid, None)
        self._loop.call_soon_threadsafe(deliver)

    def _run_command(self, item) -> None:
        fn, args, fut = item
        if fut is None:
            fn(*args)
            return
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except Exception as exc:
            fut.set_exception(exc)

    def _run(self) -> None:
        self.engine.runner.bind_thread()
        while not self._stop.is_set():
            block = not self.engine.has_work()
            try:
                item = self._cmds.get(block=block, timeout=0.5 if block else None)
                while item is not None:
                    self._run_command(item)
                    item = self._cmds.get_nowait()
            except queue.Empty:
                pass
            if self._stop.is_set():
                break
            self._retry_reservations()
            if not self.engine.has_work():
                continue
            try:
                outputs = self.engine.step()
                if self.on_step is not None and self.engine.last_step is not None:
                    self.on_step(self.engine.last_step)
            except Exception as exc:  # a bug must not hang every request: fail them loudly
                log.exception("engine step failed")
                outputs = self._fail_all(f"engine step failed: {exc}")
            if outputs:
                self._emit(outputs)

    def _fail_all(self, message: str) -> list[RequestOutput]:
        s = self.engine.scheduler
        reqs = list(s.waiting) + s.running
        for r in reqs:
            self.engine.abort(r.request_id)
        return [RequestOutput(r.request_id, [], [], "error", message, choice=r.choice,
                              group=r.group) for r in reqs]
