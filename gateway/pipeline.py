"""Drives one request through a decode worker D and a prefill worker P (see proto/pdserve.proto):

    gateway --Decode(DecodeRequest)--> D        stream opens; D reserves KV blocks
    gateway <--reservation (KVDescriptor)-- D
    gateway --Prefill(destination=reservation)--> P     (a task, alongside reading D's stream)
    gateway <--TokenBatch ... finish_reason-- D          detokenize, apply stop strings -> Delta
                                                         (gateway/choice_text.py)

A worker that goes away (or a KV transfer that fails) before the first token reached the client
makes the request run again on the workers the router picks then (PipelineConfig.max_attempts).
A worker that hangs (alive, silent: gateway/liveness.py finds it within
worker_probe_timeout_s) counts as gone. A decode worker that fails after tokens went out (gone,
hung, stream broken, stalled for stream_stall_timeout_s) hands the stream on
(PipelineConfig.max_migrations): another decode worker (and a prefill worker, as for a new
request) computes the KV of prompt + the tokens sent (DecodeRequest.resume_token_ids) and goes
on from there, feeding the same per-choice text state, so the client sees one stream; sampling
is a function of (seed, output index), so the tokens are the ones the failed worker would have
made. Requests of n > 1 are not moved (their error ends the stream).

A decode worker that gives up on the prompt's KV and computes the prompt itself
(--kv-load-failure recompute) says so on its stream (LocalCompute): from there the attempt is a
local prefill, P's call is ended and its failure (the push D refused) is not the request's. As
that event and P's failure travel different connections, a P that fails with its KV transfer
(ABORTED) is held for prefill_grace_s while D's stream may still say it took over.

Every exit (finish, stop string, worker error, consumer cancelled or closed) cancels the Decode
stream and an unfinished Prefill call, so both workers free the request's blocks. Errors reach
the client as GatewayErrors whose messages name no worker id or address
(gateway/worker_errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import grpc

from cluster.metrics import GatewayMetrics
from cluster.registry import WorkerInfo
from cluster.tracing import NO_SPAN, Span, Tracing
from gateway.choice_text import Choices, Delta, gateway_logprobs
from gateway.errors import GatewayError
from gateway.liveness import Liveness
from gateway.lora_admin import LoRAAdmin
from gateway.params import PreparedRequest
from gateway.router import PrefillTicket, Route, Router
from gateway.timing import RequestTrace
from gateway.tokenizer import Tokenizer
from gateway.worker_errors import scrub, worker_error
from proto import pdserve_pb2, pdserve_pb2_grpc

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length")     # what a worker may end a choice with


@dataclass(frozen=True)
class PipelineConfig:
    reservation_timeout_s: float = 300.0   # D must answer with a reservation within this
    prefill_timeout_s: float = 600.0       # deadline of the Prefill call
    prefill_grace_s: float = 2.0           # wait for P's reply once D has finished
    # Conditional disaggregation: a prompt of at most local_prefill_max_tokens is computed on
    # the decode worker when the chosen prefill worker already has local_prefill_queue or more
    # of this gateway's prompts outstanding and the decode worker's own outstanding prompt
    # tokens (this one included) stay within local_prefill_share of the prefill worker's: in a
    # burst both roles' cores compute prompts, the decode worker some three in seven of them
    # (docs/performance.md#conditional-disaggregation). local_prefill_max_tokens 0 turns it
    # off; local_prefill_queue 0 sends every prompt up to that size to the decode worker.
    local_prefill_max_tokens: int = 1024
    local_prefill_queue: int = 4
    local_prefill_share: float = 0.75
    # A request whose worker went away before its first token runs again, up to this many tries.
    max_attempts: int = 3
    # A stream whose decode worker failed after tokens went out goes on on another decode
    # worker, at most this many times per request (0: the failure ends the stream).
    max_migrations: int = 2
    # A decode stream that sends nothing for this long (once its prompt's KV is computed) has
    # stalled: its worker counts as failed. 0 turns the check off.
    stream_stall_timeout_s: float = 120.0
    # A worker this gateway has calls on that answers no Stats call for this long is hung (see
    # gateway/liveness.py). 0 turns the probes off.
    worker_probe_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if min(self.reservation_timeout_s, self.prefill_timeout_s, self.prefill_grace_s) <= 0:
            raise ValueError("pipeline timeouts must be positive")
        if self.local_prefill_max_tokens < 0 or self.local_prefill_queue < 0:
            raise ValueError("local_prefill_max_tokens and local_prefill_queue must be >= 0")
        if self.local_prefill_share < 0:
            raise ValueError("local_prefill_share must be >= 0")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")
        if min(self.max_migrations, self.stream_stall_timeout_s,
               self.worker_probe_timeout_s) < 0:
            raise ValueError("max_migrations, stream_stall_timeout_s and worker_probe_timeout_s "
                             "must be >= 0")


class _LatencyTimer:
    """Feeds one request's TTFT, inter-token gaps and end-to-end time to the metrics (finish
    reasons per choice; the end-to-end time once, when its last choice ends)."""

    def __init__(self, metrics: GatewayMetrics, choices: int = 1) -> None:
        self.m = metrics
        self.start = self.last = self.first_at = time.perf_counter()
        self.first = True
        self.open = choices             # the request ends with its last choice
        self.tokens = 0

    def delta(self, d: Delta) -> None:
        now = time.perf_counter()
        if d.token_ids:
            if self.first:
                self.m.ttft.observe(now - self.start)
                self.m.observe_slo("ttft", now - self.start)
                self.first, self.first_at = False, now
            else:
                self.m.itl.observe(now - self.last)
            for _ in d.token_ids[1:]:     # tokens that arrived together reach the client together
                self.m.itl.observe(0.0)
            self.m.generated.inc(len(d.token_ids))
            self.tokens += len(d.token_ids)
            self.last = now
        if d.finish_reason:
            self.m.finished.labels(reason=d.finish_reason).inc()
            self.open -= 1
            if self.open == 0:
                self.m.e2e.observe(now - self.start)
                if self.tokens > 1:      # time per output token after the first
                    self.m.observe_slo("tpot", (self.last - self.first_at) / (self.tokens - 1))


class Pipeline:
    """Runs prepared requests on the workers the router picks. Stateless between requests."""

    def __init__(self, router: Router, tokenizer: Tokenizer,
                 config: PipelineConfig = PipelineConfig(),
                 metrics: GatewayMetrics | None = None, tracing: Tracing | None = None) -> None:
        self.router = router
        self.loras = LoRAAdmin(router)       # adapters: load / unload, on demand
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics or GatewayMetrics()
        self.tracing = tracing or Tracing.off()      # the front doors start their traces here
        self.liveness = Liveness(router.channel, self._hung, config.worker_probe_timeout_s)
        self._background: set[asyncio.Task] = set()

    def _hung(self, worker: WorkerInfo, hung: bool) -> None:
        if hung:
            self.metrics.hung.labels(role=worker.role).inc()
        self.router.set_hung(worker, hung)

    async def stop(self) -> None:
        """Stop probing workers (the gateway's shutdown)."""
        await self.liveness.stop()

    async def generate(self, prepared: PreparedRequest,
                       trace: RequestTrace | None = None) -> AsyncIterator[Delta]:
        """Yield the request's Deltas; the last one has finish_reason set.

        Raises GatewayError, and nothing else: 503 when no worker is registered or one is
        unreachable, 429 when a worker is overloaded, 500/504 on other worker failures (a bug
        of the gateway's own is a 500 too). Closing or cancelling the iterator aborts the
        request on both workers. Consume it with `contextlib.aclosing` so that happens promptly.

        `trace`: the request's trace and timing, which the front door started and ends (None:
        one of its own, ended here).
        """
        m = self.metrics
        m.in_flight.inc()
        m.prompt_tokens.inc(len(prepared.prompt_token_ids))
        timer = _LatencyTimer(m, prepared.params.n)
        own, error = trace is None, ""
        if own:
            trace = RequestTrace(self.tracing)
            trace.describe(prepared)
        try:
            async with contextlib.aclosing(self._generate(prepared, trace)) as deltas:
                async for delta in deltas:      # closing us closes the inner stream now
                    timer.delta(delta)
                    if trace.active:
                        _note(trace, delta)
                    yield delta
        except GatewayError as exc:
            m.failed.labels(status=str(exc.status)).inc()
            exc.message = scrub(exc.message, self.router.workers("prefill")
                                + self.router.workers("decode"))     # e.g. the Redis URL
            exc.args = (exc.message,)
            error = exc.message
            raise
        except Exception as exc:                # noqa: BLE001 - a client gets an error, not a hang
            log.exception("request %s failed in the gateway", prepared.request_id)
            m.failed.labels(status="500").inc()
            error = "internal error in the gateway"
            raise GatewayError(error, status=500, code="internal_error") from exc
        finally:
            m.in_flight.dec()
            if own:
                trace.end(error)

    def _prefill_locally(self, prefill_w: WorkerInfo, decode_w: WorkerInfo,
                         num_tokens: int) -> bool:
        cfg, r = self.config, self.router
        if not 0 < num_tokens <= cfg.local_prefill_max_tokens:
            return False
        if cfg.local_prefill_queue == 0:
            return True
        return (r.queued_prompts(prefill_w.id) >= cfg.local_prefill_queue
                and r.queued_tokens(decode_w.id) + num_tokens
                <= cfg.local_prefill_share * r.queued_tokens(prefill_w.id))

    async def _generate(self, prepared: PreparedRequest,
                        trace: RequestTrace) -> AsyncIterator[Delta]:
        """Run the request; when a worker goes away (or the KV transfer fails) before any token
        reached the client, run it again on the workers the router picks now; when the decode
        worker fails after that, go on on another one (see the module docstring)."""
        choices = Choices(self.tokenizer, prepared)
        tried: set[str] = set()
        retries = migrations = 0
        while True:
            attempt = retries + migrations
            rid = prepared.request_id if not attempt else f"{prepared.request_id}-retry{attempt}"
            trace.attempts += 1
            try:
                async for delta in self._attempt(prepared, rid, tried, choices, trace):
                    yield delta
                return
            except GatewayError as exc:
                if not exc.retryable:
                    raise
                if not choices.started:
                    retries += 1
                    if retries >= self.config.max_attempts:
                        raise
                    log.warning("request %s: %s; trying again on other workers",
                                prepared.request_id, exc.message)
                    self.metrics.retries.inc()
                    continue
                why = self._unmovable(prepared, migrations, tried)
                if why:
                    log.warning("request %s: %s; the stream is not moved: %s",
                                prepared.request_id, exc.message, why)
                    raise
                migrations += 1
                log.warning("request %s: %s; moving the stream to another decode worker after "
                            "%d tokens (move %d of at most %d)", prepared.request_id,
                            exc.message, len(choices.resume_token_ids()), migrations,
                            self.config.max_migrations)
                self.metrics.migrations.inc()

    def _unmovable(self, prepared: PreparedRequest, migrations: int, tried: set[str]) -> str:
        """Why a stream whose decode worker failed cannot go on elsewhere ("": it can)."""
        if prepared.params.n > 1:
            return "a request of n > 1 is not moved"
        if prepared.params.beam_search:
            return "a beam search is not moved"
        if migrations >= self.config.max_migrations:
            return f"it was moved {migrations} times already (--max-migrations)"
        if all(w.id in tried for w in self.router.workers("decode")):
            return "no other decode worker is registered"
        return ""

    async def _attempt(self, prepared: PreparedRequest, rid: str, tried: set[str],
                       choices: Choices, trace: RequestTrace) -> AsyncIterator[Delta]:
        """One try on the workers the router picks, avoiding those of failed tries (`tried`,
        extended with this try's workers). A stream that has started resumes after the tokens
        its choice has sent."""
        resume = choices.resume_token_ids()
        tokens = prepared.prompt_token_ids + resume
        with trace.phase("route") as span:
            if prepared.lora_name:          # both roles serve it, loaded on demand if need be
                await self.loras.ensure(prepared.lora_name)
            route = await self.router.route(tokens, prepared.cache_salt, frozenset(tried),
                                            prepared.lora_name)
            if span:
                span.set_many(_route_attributes(route))
        prefill_w, decode_w = route.prefill, route.decode
        tried.update((prefill_w.id, decode_w.id))
        local = self._prefill_locally(prefill_w, decode_w, len(tokens))
        self.metrics.routed.labels(prefill="decode-local" if local else "prefill-worker").inc()
        trace.prefill_worker_id = (decode_w if local else prefill_w).id
        trace.decode_worker_id = decode_w.id
        if not local:
            self.metrics.route_reason.labels(reason=route.reason).inc()
            self.metrics.routed_cached.inc(route.cached_tokens)
            ticket = self.router.enqueue_prefill(prefill_w, len(tokens) - route.cached_tokens)
        else:       # the decode worker's own prompt queue, until its first token
            ticket = self.router.enqueue_prefill(decode_w, len(tokens))
        span = trace.span("gateway.attempt", attributes={
            "pdserve.attempt": trace.attempts, "pdserve.request.worker_request_id": rid,
            "pdserve.worker.prefill": trace.prefill_worker_id,
            "pdserve.worker.decode": decode_w.id, "pdserve.local_prefill": local,
            "pdserve.resume_tokens": len(resume)}) if trace.traced else NO_SPAN
        with self.router.track(*([decode_w] if local else [prefill_w, decode_w])), \
                self.liveness.watch(decode_w) as hung:
            try:
                async for delta in self._stream(prepared, rid, resume, route, local, ticket,
                                                tried, choices, trace, span, hung):
                    yield delta
            except GatewayError as exc:
                span.error(exc.message)
                raise
            finally:
                span.end()
                ticket.release()

    async def _stream(self, prepared: PreparedRequest, rid: str, resume: tuple[int, ...],
                      route: Route, local: bool, ticket: PrefillTicket, tried: set[str],
                      choices: Choices, trace: RequestTrace, attempt: Span,
                      hung: asyncio.Future) -> AsyncIterator[Delta]:
        """The attempt's worker calls: D's Decode stream (and P's Prefill once D reserved);
        `hung` completes if D is found hung."""
        decode_w, want = route.decode, trace.want_timing
        span = trace.span("gateway.decode", attempt, "client",
                          {"pdserve.worker.id": decode_w.id}) if trace.traced else NO_SPAN
        decode = pdserve_pb2_grpc.DecodeWorkerStub(self.router.channel(decode_w.address))
        opened = time.perf_counter()
        call = decode.Decode(pdserve_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=prepared.prompt_token_ids,
            params=_wire_params(prepared, resume), local_prefill=local,
            cache_salt=prepared.cache_salt, resume_token_ids=resume, return_timing=want,
            lora_name=prepared.lora_name), metadata=span.headers() or None)
        prefill: asyncio.Task | None = None
        found: dict[str, pdserve_pb2.WorkerTiming] = {}       # role -> what it reported
        try:
            if not local:
                reservation = await self._reservation(call, decode_w, tried, hung)
                if trace.active:
                    trace.add("reservation", time.perf_counter() - opened)
                    span.event("reservation")
                prefill = asyncio.ensure_future(self._prefill(
                    route.prefill, prepared, rid, resume, reservation, ticket, tried, trace,
                    attempt))
            watched = prefill          # until the first token: then the KV is on D
            while True:
                event = await self._next_event(call, decode_w, watched, tried, hung)
                watched = None
                if event.HasField("local_compute"):       # D took the prompt over
                    log.warning("request %s: decode worker %s computes the prompt itself (%s); "
                                "the prefill worker's call is ended", rid, decode_w.id,
                                event.local_compute.reason)
                    self.metrics.local_computes.inc()
                    _discard(prefill)
                    prefill, local = None, True
                    trace.prefill_worker_id = decode_w.id
                    continue
                tb = event.tokens
                if local:
                    ticket.release()         # its prompt is computed
                if tb.index in choices.done or tb.index >= choices.n:
                    continue                 # a choice stopped here: its last outputs
                if tb.finish_reason and tb.finish_reason not in FINISH_REASONS:
                    log.warning("request %s: decode worker %s ended choice %d with %r",
                                rid, decode_w.id, tb.index, tb.finish_reason)
                    raise GatewayError(f"the decode worker ended the output with "
                                       f"{tb.finish_reason!r}", status=500, code="worker_error")
                if choices.prompt_logprobs is None and \
                        prepared.params.prompt_logprobs_computed is not None:
                    # with the first token: the decode worker's (local prefill) or the
                    # prefill worker's reply, due now that its KV and first token are here
                    choices.prompt_logprobs = gateway_logprobs(
                        tb.prompt_logprobs if local else (await prefill).prompt_logprobs)
                delta = choices.first_of_choice(choices.states[tb.index].consume(tb))
                if local and tb.num_cached_tokens:
                    choices.cached_tokens = tb.num_cached_tokens
                if want and tb.finish_reason and tb.HasField("timing"):
                    found["decode"] = tb.timing
                if delta.finish_reason:
                    choices.done.add(tb.index)
                    if len(choices.done) == choices.n and tb.finish_reason:
                        await self._finish_prefill(prefill)
                    elif len(choices.done) < choices.n and not tb.finish_reason:
                        self._stop_choice(decode_w, rid, tb.index)   # a stop string
                if len(choices.done) == choices.n:
                    if want:
                        _keep_timing(trace, prefill, found)
                    if not local:
                        choices.cached_tokens = _prefill_cached(prefill)
                    yield dataclasses.replace(delta, cached_tokens=choices.cached_tokens)
                    return
                yield delta
        except GatewayError as exc:
            span.error(exc.message)
            raise
        finally:
            call.cancel()
            _discard(prefill)
            span.end()

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

    def _failed(self, what: str, worker: WorkerInfo, exc: grpc.aio.AioRpcError,
                tried: set[str]) -> GatewayError:
        if exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.router.mark_unreachable(worker)
        known = self.router.workers("prefill") + self.router.workers("decode")
        err = worker_error(what, worker, exc, known)
        if err.status == 429:       # another worker of the role may have room: one try there
            err.retryable = any(w.id not in tried for w in self.router.workers(what))
        return err

    async def _reservation(self, call, worker: WorkerInfo, tried: set[str],
                           hung: asyncio.Future) -> pdserve_pb2.KVDescriptor:
        try:
            event = await asyncio.wait_for(_unless_hung(call.read(), hung, "decode"),
                                           self.config.reservation_timeout_s)
        except asyncio.TimeoutError:
            log.warning("decode worker %s at %s reserved no KV blocks within %g s", worker.id,
                        worker.address, self.config.reservation_timeout_s)
            raise GatewayError(f"the decode worker did not reserve KV blocks within "
                               f"{self.config.reservation_timeout_s:g} s",
                               status=504, code="worker_timeout") from None
        except grpc.aio.AioRpcError as exc:
            raise self._failed("decode", worker, exc, tried) from None
        if event is grpc.aio.EOF or not event.HasField("reservation"):
            log.warning("decode worker %s did not open with a KV reservation", worker.id)
            raise GatewayError("the decode worker did not open the request with a KV "
                               "reservation", status=500, code="worker_error")
        return event.reservation

    async def _prefill(self, worker: WorkerInfo, prepared: PreparedRequest, rid: str,
                       resume: tuple[int, ...], reservation: pdserve_pb2.KVDescriptor,
                       ticket: PrefillTicket, tried: set[str], trace: RequestTrace,
                       attempt: Span) -> pdserve_pb2.PrefillReply:
        stub = pdserve_pb2_grpc.PrefillWorkerStub(self.router.channel(worker.address))
        request = pdserve_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prepared.prompt_token_ids,
            params=_wire_params(prepared, resume), destination=reservation,
            cache_salt=prepared.cache_salt, resume_token_ids=resume,
            return_timing=trace.want_timing, lora_name=prepared.lora_name)
        span = trace.span("gateway.prefill", attempt, "client",
                          {"pdserve.worker.id": worker.id}) if trace.traced else NO_SPAN
        start = time.perf_counter()
        try:
            with self.liveness.watch(worker) as hung:
                reply = await _unless_hung(stub.Prefill(
                    request, timeout=self.config.prefill_timeout_s,
                    metadata=span.headers() or None), hung, "prefill")
            if span:
                span.set_many({"pdserve.prefill.prompt_tokens": reply.num_prompt_tokens,
                               "pdserve.prefill.cached_tokens": reply.num_cached_tokens,
                               "pdserve.prefill.blocks_sent": reply.num_blocks_sent})
            return reply
        except grpc.aio.AioRpcError as exc:
            err = self._failed("prefill", worker, exc, tried)
            if exc.code() == grpc.StatusCode.ABORTED:
                err = TransferFailed(err)
            span.error(err.message)
            raise err from None
        except GatewayError as exc:
            span.error(exc.message)
            raise
        finally:
            ticket.release()
            if trace.active:
                trace.add("prefill", time.perf_counter() - start)
            span.end()

    async def _next_event(self, call, decode_w: WorkerInfo, prefill: asyncio.Task | None,
                          tried: set[str], hung: asyncio.Future) -> pdserve_pb2.DecodeEvent:
        """The next token (or LocalCompute) event of D; raises the Prefill call's error as soon
        as it fails (unless D says it took the prompt over), a hang error once D is found hung,
        and a stall error when D sends nothing for stream_stall_timeout_s (once no prefill
        runs)."""
        stall = self.config.stream_stall_timeout_s
        try:
            if prefill is not None and not prefill.done():
                event = await _read_unless_failed(call, prefill, hung,
                                                  self.config.prefill_grace_s)
            else:
                if prefill is not None:
                    prefill.result()
                event = await asyncio.wait_for(_unless_hung(call.read(), hung, "decode"),
                                               stall or None)
        except asyncio.TimeoutError:
            self.metrics.stalls.inc()
            log.warning("decode worker %s at %s sent nothing for %g s", decode_w.id,
                        decode_w.address, stall)
            raise GatewayError(f"the decode stream stalled: nothing for {stall:g} s "
                               "(--stream-stall-timeout)", status=504, code="stream_stalled",
                               retryable=True) from None
        except grpc.aio.AioRpcError as exc:
            raise self._failed("decode", decode_w, exc, tried) from None
        if event is grpc.aio.EOF:
            log.warning("decode worker %s closed the stream early", decode_w.id)
            raise GatewayError("the decode worker closed the stream before the request "
                               "finished", status=503, code="worker_unavailable",
                               retryable=True)
        if not (event.HasField("tokens") or event.HasField("local_compute")):
            raise GatewayError("the decode worker sent an unexpected event", status=500,
                               code="worker_error")
        return event

    async def _finish_prefill(self, prefill: asyncio.Task | None) -> None:
        """After D finished on its own, let P's reply arrive (it is due) rather than abort P."""
        if prefill is not None and not prefill.done():
            await asyncio.wait({prefill}, timeout=self.config.prefill_grace_s)


def _wire_params(prepared: PreparedRequest, resume: tuple[int, ...]) -> pdserve_pb2.SamplingParams:
    """The request's parameters for a worker; a moved stream's prompt logprobs went out
    already, so its new workers do not score them again."""
    msg = prepared.params.to_proto()
    if resume:
        msg.ClearField("prompt_logprobs")
    return msg


def _note(trace: RequestTrace, delta: Delta) -> None:
    if delta.token_ids:
        trace.first_token()
    if delta.finish_reason:
        trace.finished(delta.finish_reason, delta.completion_tokens)


def _keep_timing(trace: RequestTrace, prefill: asyncio.Task | None,
                 found: dict[str, pdserve_pb2.WorkerTiming]) -> None:
    """The finishing attempt's worker timings (prefill first), as far as the workers sent any."""
    if prefill is not None and prefill.done() and not prefill.cancelled() \
            and prefill.exception() is None and prefill.result().HasField("timing"):
        found["prefill"] = prefill.result().timing
    trace.workers.extend(found[role] for role in ("prefill", "decode") if role in found)


def _route_attributes(route: Route) -> dict:
    return {"pdserve.route.reason": route.reason,
            "pdserve.route.cached_tokens": route.cached_tokens,
            "pdserve.route.prefill_worker": route.prefill.id,
            "pdserve.route.decode_worker": route.decode.id,
            "pdserve.route.candidates": [f"{wid} cached={cached} load={load}"
                                         for wid, cached, load in route.candidates]}


class TransferFailed(GatewayError):
    """P's call ended ABORTED: its KV transfer to D failed. D may have answered that by
    computing the prompt itself (its LocalCompute event may still be on its way)."""

    def __init__(self, err: GatewayError) -> None:
        super().__init__(err.message, status=err.status, code=err.code,
                         retryable=err.retryable)


def _hang_error(role: str, hung: asyncio.Future) -> GatewayError:
    return GatewayError(f"the {role} worker stopped responding: {hung.result()}", status=503,
                        code="worker_unavailable", retryable=True)


async def _unless_hung(aw, hung: asyncio.Future, role: str):
    """`aw`'s result, unless its worker is found hung first: then `aw` is cancelled (a call
    ends) and a retryable GatewayError is raised."""
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.wait({task, hung}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise _hang_error(role, hung)
        return task.result()
    finally:
        _discard(task)


async def _read_unless_failed(call, prefill: asyncio.Task, hung: asyncio.Future,
                              grace_s: float):
    """D's next event while P's call runs: P's error as soon as it fails, unless P's KV
    transfer failed and D answers within `grace_s` (it took the prompt over, or has the KV)."""
    read = asyncio.ensure_future(call.read())
    try:
        await asyncio.wait({read, prefill, hung}, return_when=asyncio.FIRST_COMPLETED)
        if not read.done() and prefill.done():
            if isinstance(prefill.exception(), TransferFailed):
                await asyncio.wait({read, hung}, timeout=grace_s)
                if read.done() and read.exception() is None:
                    return read.result()
            prefill.result()  # raises the Prefill error; a success falls through to the read
        return await _unless_hung(read, hung, "decode")
    finally:
        _discard(read)


def _prefill_cached(prefill: asyncio.Task | None) -> int:
    """The prompt tokens the prefill worker found cached (0 when its reply is not there)."""
    if prefill is None or not prefill.done() or prefill.cancelled() or prefill.exception():
        return 0
    return prefill.result().num_cached_tokens


def _discard(task: asyncio.Future | None) -> None:
    """Cancel a task if still running; mark a failed one's exception as seen."""
    if task is None:
        return
    if not task.done():
        task.cancel()
    elif not task.cancelled():
        task.exception()
