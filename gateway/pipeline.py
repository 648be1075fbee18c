"""Drives one request through a decode worker D and a prefill worker P (see proto/pdserve.proto):

    gateway --Decode(DecodeRequest)--> D        stream opens; D reserves KV blocks
    gateway <--reservation (KVDescriptor)-- D
    gateway --Prefill(destination=reservation)--> P     (a task, alongside reading D's stream)
    gateway <--TokenBatch ... finish_reason-- D          detokenize, apply stop strings -> Delta

A worker that goes away (or a KV transfer that fails) before the first token reached the client
makes the request run again on the workers the router picks then (PipelineConfig.max_attempts).
Every exit (finish, stop string, worker error, consumer cancelled or closed) cancels the Decode
stream and an unfinished Prefill call, so both workers free the request's blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from gateway.errors import GatewayError
from gateway.params import PreparedRequest
from gateway.router import PrefillTicket, Router
from gateway.tokenizer import Tokenizer
from pdserve.metrics import GatewayMetrics
from pdserve.registry import WorkerInfo
from proto import pdserve_pb2, pdserve_pb2_grpc

log = logging.getLogger(__name__)

DETOKENIZER_CONTEXT = 4  # prompt tokens that seed the detokenizer (leading-space rules)


@dataclass(frozen=True)
class PipelineConfig:
    reservation_timeout_s: float = 300.0   # D must answer with a reservation within this
    prefill_timeout_s: float = 600.0       # deadline of the Prefill call
    prefill_grace_s: float = 2.0           # wait for P's reply once D has finished
    # Conditional disaggregation: a prompt of at most local_prefill_max_tokens is computed on
    # the decode worker when the chosen prefill worker already has local_prefill_queue or more
    # of this gateway's prompts outstanding. 0 turns it off (every prompt goes to a prefill worker).
    local_prefill_max_tokens: int = 0
    local_prefill_queue: int = 4
    # A request whose worker went away before its first token runs again, up to this many tries.
    max_attempts: int = 3

    def __post_init__(self) -> None:
        if min(self.reservation_timeout_s, self.prefill_timeout_s, self.prefill_grace_s) <= 0:
            raise ValueError("pipeline timeouts must be positive")
        if self.local_prefill_max_tokens < 0 or self.local_prefill_queue < 0:
            raise ValueError("local_prefill_max_tokens and local_prefill_queue must be >= 0")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]   # (token id, logprob), most likely first


@dataclass(frozen=True)
class Delta:
    """What one step of one choice of a request adds. `token_ids` are the new tokens (EOS
    included, its text only with include_stop_str_in_output); `logprobs` has one entry per token
    when asked for; `finish_reason` is None until the choice's last Delta ("stop" or "length");
    `completion_tokens` counts the choice's tokens so far."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None
    completion_tokens: int          # of this choice
    index: int = 0                  # the choice (n > 1)


class StopStrings:
    """Cuts generated text at the first stop string; holds back a tail that may start one.

    `feed(text)` returns (text safe to emit, stopped). Once stopped, the emitted text ends just
    before the stop string. `flush()` returns the held-back tail at the natural end.
    """

    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        self._stops = stops
        self._include = include          # the stop string itself is emitted too
        self._pending = ""

    def _held_tail(self) -> int:
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._pending)), longest, -1):
                if self._pending.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def feed(self, text: str) -> tuple[str, bool]:
        self._pending += text
        if not self._stops:
            out, self._pending = self._pending, ""
            return out, False
        hits = [(i, len(s)) for i, s in ((self._pending.find(s), s) for s in self._stops)
                if i >= 0]
        if hits:
            at, length = min(hits)
            out = self._pending[:at + length] if self._include else self._pending[:at]
            self._pending = ""
            return out, True
        keep = self._held_tail()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


class _RequestText:
    """Per-request text state: incremental detokenizer + stop strings + token count."""

    def __init__(self, tokenizer: Tokenizer, prepared: PreparedRequest, index: int = 0) -> None:
        p = prepared.params
        self._stop_ids = frozenset(p.stop_token_ids) | (
            frozenset() if p.ignore_eos else tokenizer.eos_token_ids)
        self._keep_stop = p.include_stop_str_in_output
        context = prepared.prompt_token_ids[-DETOKENIZER_CONTEXT:]
        self._detok = tokenizer.detokenizer(context, p.skip_special_tokens)
        self._stops = StopStrings(p.stop, p.include_stop_str_in_output)
        self._min_tokens = p.min_tokens
        self._count = 0
        self.index = index

    def consume(self, batch: pdserve_pb2.TokenBatch) -> Delta:
        ids = tuple(batch.token_ids)
        self._count += len(ids)
        finish = batch.finish_reason or None
        text_ids = ids
        if finish == "stop" and ids and ids[-1] in self._stop_ids and not self._keep_stop:
            text_ids = ids[:-1]
        text = self._detok.add(text_ids)
        if finish:
            text += self._detok.flush()
        if self._count < self._min_tokens and not finish:
            stopped = False         # stop strings apply once min_tokens are out
            text = self._stops.flush() + text
        else:
            text, stopped = self._stops.feed(text)
        if stopped:
            finish = "stop"
        elif finish:
            text += self._stops.flush()
        logprobs = tuple(TokenLogprob(lp.token_id, lp.logprob,
                                      tuple((t.token_id, t.logprob) for t in lp.top))
                         for lp in batch.logprobs)
        return Delta(ids, text, logprobs, finish, self._count, self.index)


class _LatencyTimer:
    """Feeds one request's TTFT, inter-token gaps and end-to-end time to the metrics (finish
    reasons per choice; the end-to-end time once, when its last choice ends)."""

    def __init__(self, metrics: GatewayMetrics, choices: int = 1) -> None:
        self.m = metrics
        self.start = self.last = time.perf_counter()
        self.first = True
        self.open = choices             # the request ends with its last choice

    def delta(self, d: Delta) -> None:
        now = time.perf_counter()
        if d.token_ids:
            if self.first:
                self.m.ttft.observe(now - self.start)
                self.first = False
            else:
                self.m.itl.observe(now - self.last)
            for _ in d.token_ids[1:]:          # tokens that arrived together reach the client together
                self.m.itl.observe(0.0)
            self.m.generated.inc(len(d.token_ids))
            self.last = now
        if d.finish_reason:
            self.m.finished.labels(reason=d.finish_reason).inc()
            self.open -= 1
            if self.open == 0:
                self.m.e2e.observe(now - self.start)


def _worker_error(what: str, worker: WorkerInfo, exc: grpc.aio.AioRpcError) -> GatewayError:
    code = exc.code()
    message = f"{what} worker {worker.id} at {worker.address} failed: {code.name}: {exc.details()}"
    if code == grpc.StatusCode.INVALID_ARGUMENT:     # the request's fault: the worker's words
        return GatewayError(exc.details() or message, status=400)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED):
        # the worker is gone, or (ABORTED) the KV transfer between the workers failed
        return GatewayError(message, status=503, code="worker_unavailable", retryable=True)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return GatewayError(message, status=503, code="worker_unavailable")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GatewayError(message, status=504, code="worker_timeout")
    return GatewayError(message, status=500, code="worker_error")


class Pipeline:
    """Runs prepared requests on the workers the router picks. Stateless between requests."""

    def __init__(self, router: Router, tokenizer: Tokenizer,
                 config: PipelineConfig = PipelineConfig(),
                 metrics: GatewayMetrics | None = None) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self._background: set[asyncio.Task] = set()

    async def generate(self, prepared: PreparedRequest) -> AsyncIterator[Delta]:
        """Yield the request's Deltas; the last one has finish_reason set.

        Raises GatewayError: 503 when no worker is registered or one is unreachable, 500/504 on
        other worker failures. Closing or cancelling the iterator aborts the request on both
        workers. Consume it with `contextlib.aclosing` so that happens promptly.
        """
        m = self.metrics
        m.in_flight.inc()
        m.prompt_tokens.inc(len(prepared.prompt_token_ids))
        timer = _LatencyTimer(m, prepared.params.n)
        try:
            async with contextlib.aclosing(self._generate(prepared)) as deltas:
                async for delta in deltas:      # closing us closes the inner stream now
                    timer.delta(delta)
                    yield delta
        except GatewayError as exc:
            m.failed.labels(status=str(exc.status)).inc()
            raise
        finally:
            m.in_flight.dec()

    def _prefill_locally(self, prefill_w: WorkerInfo, prepared: PreparedRequest) -> bool:
        cfg = self.config
        return (0 < len(prepared.prompt_token_ids) <= cfg.local_prefill_max_tokens
                and self.router.queued_prompts(prefill_w.id) >= cfg.local_prefill_queue)

    async def _generate(self, prepared: PreparedRequest) -> AsyncIterator[Delta]:
        """Run the request; when a worker goes away (or the KV transfer fails) before any token
        reached the client, run it again on the workers the router picks now."""
        emitted = False
        tried: set[str] = set()
        for attempt in range(self.config.max_attempts):
            rid = prepared.request_id if not attempt else f"{prepared.request_id}-retry{attempt}"
            try:
                async for delta in self._attempt(prepared, rid, tried):
                    emitted = True
                    yield delta
                return
            except GatewayError as exc:
                if emitted or not exc.retryable or attempt + 1 >= self.config.max_attempts:
                    raise
                log.warning("request %s: %s; trying again on other workers",
                            prepared.request_id, exc.message)
                self.metrics.retries.inc()

    async def _attempt(self, prepared: PreparedRequest, rid: str,
                       tried: set[str]) -> AsyncIterator[Delta]:
        """One try on the workers the router picks, avoiding those of failed tries (`tried`,
        extended with this try's workers)."""
        route = await self.router.route(prepared.prompt_token_ids, prepared.cache_salt,
                                        frozenset(tried))
        prefill_w, decode_w = route.prefill, route.decode
        tried.update((prefill_w.id, decode_w.id))
        local = self._prefill_locally(prefill_w, prepared)
        self.metrics.routed.labels(prefill="decode-local" if local else "prefill-worker").inc()
        ticket = None
        if not local:
            self.metrics.route_reason.labels(reason=route.reason).inc()
            self.metrics.routed_cached.inc(route.cached_tokens)
            uncached = len(prepared.prompt_token_ids) - route.cached_tokens
            ticket = self.router.enqueue_prefill(prefill_w, uncached)
        with self.router.track(*([decode_w] if local else [prefill_w, decode_w])):
            decode = pdserve_pb2_grpc.DecodeWorkerStub(self.router.channel(decode_w.address))
            call = decode.Decode(pdserve_pb2.DecodeRequest(
                request_id=rid, prompt_token_ids=prepared.prompt_token_ids,
                params=prepared.params.to_proto(), local_prefill=local,
                cache_salt=prepared.cache_salt))
            prefill: asyncio.Task | None = None
            try:
                if not local:
                    reservation = await self._reservation(call, decode_w)
                    prefill = asyncio.ensure_future(
                        self._prefill(prefill_w, prepared, rid, reservation, ticket))
                n = prepared.params.n
                states = [_RequestText(self.tokenizer, prepared, i) for i in range(n)]
                done: set[int] = set()
                while True:
                    event = await self._next_event(call, decode_w, prefill)
                    index = event.tokens.index
                    if index in done or index >= n:
                        continue                 # a choice stopped here: its last outputs
                    delta = states[index].consume(event.tokens)
                    if delta.finish_reason:
                        done.add(index)
                        if len(done) == n and event.tokens.finish_reason:
                            await self._finish_prefill(prefill)
                        elif len(done) < n and not event.tokens.finish_reason:
                            self._stop_choice(decode_w, rid, index)   # a stop string
                    yield delta
                    if len(done) == n:
                        return
            finally:
                call.cancel()
                _discard(prefill)
                if ticket is not None:
                    ticket.release()

    def _stop_choice(self, worker: WorkerInfo, rid: str, index: int) -> None:
        """Abort one choice on the decode worker (it hit a stop string; the others go on)."""
        stub = pdserve_pb2_grpc.DecodeWorkerStub(self.router.channel(worker.address))

        async def run():
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Abort(pdserve_pb2.AbortRequest(request_id=rid, choice=index),
                                 timeout=5.0)
        task = asyncio.ensure_future(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _failed(self, what: str, worker: WorkerInfo, exc: grpc.aio.AioRpcError) -> GatewayError:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.router.mark_unreachable(worker)
        return _worker_error(what, worker, exc)

    async def _reservation(self, call, worker: WorkerInfo) -> pdserve_pb2.KVDescriptor:
        try:
            event = await asyncio.wait_for(call.read(), self.config.reservation_timeout_s)
        except asyncio.TimeoutError:
            raise GatewayError(f"decode worker {worker.id} at {worker.address} did not reserve KV "
                               f"blocks within {self.config.reservation_timeout_s:g} s",
                               status=504, code="worker_timeout") from None
        except grpc.aio.AioRpcError as exc:
            raise self._failed("decode", worker, exc) from None
        if event is grpc.aio.EOF or not event.HasField("reservation"):
            raise GatewayError(f"decode worker {worker.id} did not open the request with a KV "
                               f"reservation", status=500, code="worker_error")
        return event.reservation

    async def _prefill(self, worker: WorkerInfo, prepared: PreparedRequest, rid: str,
                       reservation: pdserve_pb2.KVDescriptor,
                       ticket: PrefillTicket) -> pdserve_pb2.PrefillReply:
        stub = pdserve_pb2_grpc.PrefillWorkerStub(self.router.channel(worker.address))
        request = pdserve_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prepared.prompt_token_ids,
            params=prepared.params.to_proto(), destination=reservation,
            cache_salt=prepared.cache_salt)
        try:
            return await stub.Prefill(request, timeout=self.config.prefill_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise self._failed("prefill", worker, exc) from None
        finally:
            ticket.release()

    async def _next_event(self, call, decode_w: WorkerInfo,
                          prefill: asyncio.Task | None) -> pdserve_pb2.DecodeEvent:
        """The next token event of D; raises the Prefill call's error as soon as it fails."""
        try:
            if prefill is None:
                event = await call.read()
            elif prefill.done():
                prefill.result()
                event = await call.read()
            else:
                event = await _read_unless_failed(call, prefill)
        except grpc.aio.AioRpcError as exc:
            raise self._failed("decode", decode_w, exc) from None
        if event is grpc.aio.EOF:
            raise GatewayError(f"decode worker {decode_w.id} closed the stream before the request "
                               f"finished", status=500, code="worker_error")
        if not event.HasField("tokens"):
            raise GatewayError(f"decode worker {decode_w.id} sent an unexpected event",
                               status=500, code="worker_error")
        return event

    async def _finish_prefill(self, prefill: asyncio.Task | None) -> None:
        """After D finished on its own, let P's reply arrive (it is due) rather than abort P."""
        if prefill is not None and not prefill.done():
            await asyncio.wait({prefill}, timeout=self.config.prefill_grace_s)


async def _read_unless_failed(call, prefill: asyncio.Task):
    read = asyncio.ensure_future(call.read())
    try:
        await asyncio.wait({read, prefill}, return_when=asyncio.FIRST_COMPLETED)
        if not read.done():
            prefill.result()  # raises the Prefill error; a success falls through to the read
        return await read
    finally:
        _discard(read)


def _discard(task: asyncio.Future | None) -> None:
    """Cancel a task if still running; mark a failed one's exception as seen."""
    if task is None:
        return
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()
