"""An Engine on its own thread, driven from one asyncio loop.

Contract: every public method is called from the loop's thread. The engine thread is the only
one that touches the Engine; callers talk to it through a command queue, and outputs come back
through per-request asyncio queues. Forward passes release the GIL, so the loop keeps serving
RPCs while a step runs. The KV pool is touched only there too: transports' copies into it run
as commands (`run`), checked against the KV connector (engine.kv_connector), which holds every
block reference a transfer needs; senders' reads of the blocks it holds go through `read_blocks`
(on CPUs at once, off the engine thread).

Admission: with `max_waiting`, a request that would find that many waiting already is refused
at once (Overloaded) instead of queueing without bound. If the engine thread dies, every
request fails with the reason, later calls raise EngineDead, and `on_death(reason)` runs on
the loop (the worker reports NOT_SERVING and leaves the registry). A step or command that fails
is the batch's failure (or the command's), unless it left the device unusable (a sticky CUDA
error, engine.device_faults): then the thread ends the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import deque
from typing import Awaitable, Callable

import torch

from engine.core_share import CoreShare
from engine.device_faults import DeviceFailure, sticky_error
from engine.engine import Engine
from engine.parallel import RankFailure
from engine.request import Request, RequestOutput, Status, TokenLogprob

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The engine's queue is full: try again later or elsewhere."""


class EngineDead(RuntimeError):
    """The engine thread has died: this worker cannot compute anything any more."""


class AsyncEngine:
    def __init__(self, engine: Engine, on_step: Callable | None = None,
                 max_waiting: int = 0, on_death: Callable[[str], None] | None = None,
                 on_load_timeout: Callable[[str], None] | None = None,
                 cores: CoreShare | None = None) -> None:
        """on_step(StepStats) is called on the engine thread after every step; max_waiting
        (0: no bound) bounds the requests waiting for a place in the batch; decode role:
        on_load_timeout(request_id) runs on the loop for each reservation whose KV did not
        arrive in time (its load has ended, its request waits for the decision); cores: on a
        CPU, sets each step's thread count (engine.core_share)."""
        self.engine = engine
        self.cores = cores
        self.on_step = on_step
        self.max_waiting = max_waiting
        self.on_death = on_death
        self._on_load_timeout = on_load_timeout
        self.dead: str | None = None                  # why the engine thread died
        self._admitted = 0         # admission commands queued (loop thread writes)
        self._taken = 0            # ... and taken by the engine thread (engine thread writes)
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
        if not self._thread.is_alive():      # else it may be inside a collective: leave it
            self.engine.close()

    # ------------------------------------------------------------------ API (loop thread)
    def _call(self, fn: Callable, *args) -> asyncio.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.dead is not None:
            fut.set_exception(EngineDead(self.dead))
        else:
            self._cmds.put((fn, args, fut))
        return asyncio.wrap_future(fut)

    def _admit(self) -> None:
        """Refuse a new request now when the engine cannot take it (dead, or queue full)."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        if self.max_waiting:
            # queued to the engine thread and not yet taken by it count too (a burst during
            # one long step all passes the check otherwise)
            waiting = self.load()[1] + self._admitted - self._taken
            if waiting >= self.max_waiting:
                raise Overloaded(f"{waiting} requests are waiting on this worker (its bound, "
                                 f"--max-waiting-requests {self.max_waiting}); try again later")

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
        """Stop delivering the request's outputs."""
        q = self._streams.pop(request_id, None)
        self._open_choices.pop(request_id, None)
        if q is not None:
            self.drain(q)

    def drain(self, q: asyncio.Queue) -> None:
        """Discard a request's unread outputs (the blocks they name for transfer are the
        connector's until save_done: nothing to give back here)."""
        while not q.empty():
            q.get_nowait()

    def configure_loads(self, one_sided: bool, load_timeout_s: float, lease_s: float,
                        on_timeout: Callable[[str], None] | None = None) -> None:
        """Decode role, before the first reservation: the load policy (Engine.configure_loads)
        and what becomes of a reservation whose KV did not arrive in time (`on_timeout`, as
        the constructor's on_load_timeout)."""
        self.engine.configure_loads(one_sided, load_timeout_s, lease_s)
        if on_timeout is not None:
            self._on_load_timeout = on_timeout

    def run(self, fn: Callable, *args) -> asyncio.Future:
        """fn(*args) on the engine thread, between steps, queued now (in order with every other
        command); await the result. For the KV connector's worker side (kvtransfer.connector)
        and the senders' reads: what touches the pool runs here."""
        return self._call(fn, *args)

    def read_blocks(self, fn: Callable, *args) -> Awaitable:
        """fn(*args), a read of pool blocks that a transfer holds (engine.kv_connector: handed
        out, final, referenced until save_done); await the result. On a CPU pool it runs at
        once on a worker thread: no step writes those blocks, and a step's CPU writes are done
        before its outputs (which name the blocks) leave the engine thread, so the read need
        not wait for the step running now (a whole prefill step on a busy prefill worker). On
        a device it is `run`: the read is queued on the engine's stream, behind the step that
        wrote the blocks; so it is under tensor parallelism, where a read of the pool
        (engine.parallel.ShardedKV) is a command every rank runs."""
        kv = self.engine.kv
        if isinstance(kv, torch.Tensor) and kv.device.type == "cpu":
            return asyncio.to_thread(fn, *args)
        return self.run(fn, *args)

    def run_nowait(self, fn: Callable, *args) -> None:
        """fn(*args) on the engine thread, without waiting (its result is dropped)."""
        if self.dead is None:
            self._cmds.put((fn, args, None))

    def save_done(self, request_id: str) -> None:
        """Prefill role: the request's KV transfer has ended (sent, failed or cancelled); the
        connector's references for it go back. Without waiting: safe in `finally` blocks."""
        self.run_nowait(self.engine.save_done, request_id)

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
        self._admit()
        self._admitted += 1
        await self._call(self._take, self.engine.add_request, req)

    def _take(self, fn: Callable, req: Request):
        """Engine thread: run an admission command, counting it as taken off the queue."""
        self._taken += 1
        return fn(req)

    async def reserve(self, req: Request) -> list[int]:
        """Decode role: reserve blocks for a prompt whose KV comes from elsewhere. Waits for
        free blocks if needed. The caller must open_stream first and abort on cancellation."""
        self._admit()
        self._admitted += 1
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((self._reserve_or_queue, (req, fut), None))
        return await asyncio.wrap_future(fut)

    async def remote_ready(self, request_id: str, first_token: int,
                           logprob: TokenLogprob | None) -> None:
        await self._call(self.remote_ready_now, request_id, first_token, logprob)

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

    async def cancel(self, request_id: str, message: str) -> bool:
        """Abort a request whose stream a handler is reading: the stream gets an error output
        with `message` (so its reader ends) instead of being closed under it."""
        def run():
            found = self._abort(request_id)
            self._emit([RequestOutput(request_id, [], [], "error", message)])
            return found
        streaming = request_id in self._streams
        return await self._call(run) or streaming

    def abort_nowait(self, request_id: str) -> None:
        """Abort without waiting: safe in `finally` blocks of cancelled handlers."""
        self.close_stream(request_id)
        self._cmds.put((self._abort, (request_id,), None))

    async def block_table(self, request_id: str) -> list[int]:
        return await self._call(self.engine.block_table, request_id)

    def load(self) -> tuple[int, int, int]:
        """(running, waiting, free blocks): a racy snapshot, good enough for routing."""
        s = self.engine.scheduler
        return len(s.running), len(s.waiting) + len(self._pending_reserve), self.engine.pool.num_free

    def backlog(self) -> tuple[int, int]:
        """(prompt tokens still to compute here, tokens still to generate at most) of the
        requests queued and running: a racy snapshot for the autoscaling signals. A request
        whose KV another worker computes has no prompt work here; a prefill worker generates
        only first tokens."""
        s, cfg = self.engine.scheduler, self.engine.cfg
        here = [*list(s.waiting), *list(s.running)]
        prompt = sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in here
                     if r.status is not Status.WAITING_FOR_REMOTE_KV)
        if cfg.role == "prefill":
            return prompt, 0
        # and those whose KV a prefill worker computes: reserved, or waiting for blocks
        reqs = here + list(s.remote.values()) + [r for r, _ in list(self._pending_reserve)]
        decode = sum(max(min(r.params.max_tokens - len(r.output_token_ids),
                             cfg.max_model_len - r.num_tokens), 0) for r in reqs)
        return prompt, decode

    # ------------------------------------------------------------------ engine thread
    def _reserve_or_queue(self, req: Request, fut: concurrent.futures.Future) -> None:
        self._taken += 1
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
                self.engine.abort(req.request_id)    # a restore it began ends with it
                continue
            blocks = self.engine.reserve_remote(req)
            if blocks is None:
                return
            self._pending_reserve.popleft()
            self._resolve(req, fut, blocks)

    def remote_ready_now(self, request_id: str, first_token: int,
                         logprob: TokenLogprob | None) -> None:
        """Engine thread: the request's KV is in; it joins the batch, its first token out."""
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
                if q is None:           # closed: its KV references are the connector's
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
            try:
                fn(*args)
            except RankFailure:
                raise
            except Exception as exc:   # nobody waits for it: say so, and keep the engine going
                log.exception("engine command %s failed", getattr(fn, "__qualname__", fn))
                self._stop_if_device_lost(exc)
            return
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except RankFailure as exc:         # the engine cannot go on: _run ends it
            fut.set_exception(exc)
            raise
        except Exception as exc:
            fut.set_exception(exc)
            self._stop_if_device_lost(exc)

    def _stop_if_device_lost(self, exc: Exception) -> None:
        """A sticky device error (engine.device_faults) ends the engine thread: _run fails
        every request and tells the worker, which reports NOT_SERVING."""
        why = sticky_error(exc, self.engine.device)
        if why is not None:
            raise DeviceFailure(f"the device is unusable after a CUDA error: {why}") from exc

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:   # the thread is gone: nobody may wait on it any more
            log.critical("the engine thread died", exc_info=True)
            self._die(f"the worker's engine stopped: {type(exc).__name__}: {exc}")
            if isinstance(exc, (RankFailure, DeviceFailure)):
                try:                   # the other ranks go (they hold their shards' memory)
                    self.engine.close()
                except Exception:      # the device that failed may fail this too
                    log.exception("closing the engine after its failure")

    def _die(self, reason: str) -> None:
        self.dead = reason
        try:
            outputs = self._fail_all(reason)
        except Exception:                   # the engine's state may be what broke
            outputs = []
        pending, self._pending_reserve = list(self._pending_reserve), deque()
        self._refuse_commands(reason)
        for _, fut in pending:
            if not fut.done():
                fut.set_exception(EngineDead(reason))

        def on_loop():
            self._refuse_commands(reason)      # queued by the loop before it saw `dead`
            for o in outputs:
                q = self._streams.get(o.stream_id)
                if q is not None:
                    q.put_nowait(o)
            for sid, q in list(self._streams.items()):   # streams of no request (reserving)
                if not any(o.stream_id == sid for o in outputs):
                    q.put_nowait(RequestOutput(sid, [], [], "error", reason))
            if self.on_death is not None:
                self.on_death(reason)
        self._loop.call_soon_threadsafe(on_loop)

    def _refuse_commands(self, reason: str) -> None:
        """Commands nobody will run: their callers get EngineDead."""
        while True:
            try:
                item = self._cmds.get_nowait()
            except queue.Empty:
                return
            if item is None:
                continue
            fn, args, fut = item
            if fn == self._reserve_or_queue:       # its future travels in its arguments
                fut = args[1]
            if fut is not None and not fut.done():
                fut.set_exception(EngineDead(reason))

    def _serve(self) -> None:
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
            self._expire_loads()
            if not self.engine.has_work():
                continue
            try:
                if self.cores is not None:
                    self.cores.threads()
                outputs = self.engine.step()
                if self.on_step is not None and self.engine.last_step is not None:
                    self.on_step(self.engine.last_step)
            except RankFailure:
                raise                 # the ranks may be out of step: the engine stops (_run)
            except Exception as exc:  # a bug must not hang every request: fail them loudly
                log.exception("engine step failed")
                self._stop_if_device_lost(exc)      # a sticky CUDA error: the engine stops
                outputs = self._fail_all(f"engine step failed: {exc}")
            if outputs:
                self._emit(outputs)

    def _expire_loads(self) -> None:
        """Reservations whose KV did not arrive in time end (engine.kv_connector.expire); the
        loop decides what becomes of each (on_load_timeout: fail it, or compute it here)."""
        late = self.engine.expire_loads()
        if late and self._on_load_timeout is not None:
            for rid in late:
                self._loop.call_soon_threadsafe(self._on_load_timeout, rid)

    def _fail_all(self, message: str) -> list[RequestOutput]:
        s = self.engine.scheduler
        reqs = list(s.waiting) + s.running
        for r in reqs:
            self.engine.abort(r.request_id)
        return [RequestOutput(r.request_id, [], [], "error", message, choice=r.choice,
                              group=r.group) for r in reqs]
