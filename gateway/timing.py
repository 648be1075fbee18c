"""One request's trace and timing block, as the gateway builds them.

`RequestTrace` holds the request's root span (`pdserve.request`, when tracing is on), the
gateway's phase times (when tracing is on or the client asked for its timing) and what the
workers reported (their WorkerTiming, asked for only with the timing). Off (no tracing, no
timing asked) it records nothing: every phase is a no-op and no tracer is called.

Phase times are seconds; a phase that runs once per attempt (route, reservation, prefill) is
summed over the request's attempts (and, for a list of prompts, over its prompts).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Mapping

from cluster import tracing as tr
from cluster.tracing import NO_SPAN, Span, Tracing
from proto import pdserve_pb2

NVEXT_FIELDS = ("timing", "worker_id")      # what nvext.extra_fields may ask for


class RequestTrace:
    """See the module docstring. `parent`: the client's trace context (None: a new trace)."""

    def __init__(self, tracing: Tracing, parent=None, want_timing: bool = False) -> None:
        self.tracing = tracing
        self.traced = tracing.enabled
        self.want_timing = want_timing
        self.active = self.traced or want_timing
        self.received_ns = time.time_ns()
        self._t0 = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.workers: list[pdserve_pb2.WorkerTiming] = []     # the last attempt's, prefill first
        self.attempts = 0
        self.prefill_worker_id = self.decode_worker_id = ""
        self.completion_tokens = 0
        self.finish_reasons: list[str] = []
        self.error = ""                   # why the request failed, for the root span
        self.streaming = False            # a REST stream ends the root when it is over
        self.prompt_tokens = 0
        self.root = (tracing.start("pdserve.request", parent, "server") if self.traced
                     else NO_SPAN)
        self.trace_id = self.root.trace_id

    # ------------------------------------------------------------------ recording
    def span(self, name: str, parent: Span | None = None, kind: str = "internal",
             attributes: Mapping[str, object] | None = None) -> Span:
        """A live child span of `parent` (default: the root); NO_SPAN when not traced."""
        if not self.traced:
            return NO_SPAN
        return self.tracing.start(name, (parent or self.root).context(), kind, attributes)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def phase(self, name: str, parent: Span | None = None) -> Iterator[Span]:
        """Time the block as the gateway phase `name`, in a span `gateway.<name>` when traced."""
        if not self.active:
            yield NO_SPAN
            return
        span = self.span("gateway." + name, parent)
        start = time.perf_counter()
        try:
            yield span
        except BaseException as exc:
            span.error(str(exc) or type(exc).__name__)
            raise
        finally:
            self.add(name, time.perf_counter() - start)
            span.end()

    def since_received(self) -> float:
        return time.perf_counter() - self._t0

    def first_token(self) -> None:
        if "ttft" not in self.seconds:
            self.seconds["ttft"] = self.since_received()

    def finished(self, reason: str, completion_tokens: int) -> None:
        """A choice ended (after `completion_tokens`); the last one sets the total."""
        self.finish_reasons.append(reason)
        self.completion_tokens += completion_tokens
        self.seconds["total"] = self.since_received()

    def describe(self, prepared) -> None:
        """The request's gen_ai attributes on the root span (a PreparedRequest)."""
        if not self.traced:
            return
        p = prepared.params
        self.root.set_many({tr.GEN_AI_REQUEST_ID: prepared.public_id,
                            tr.GEN_AI_MODEL: prepared.model, tr.GEN_AI_MAX_TOKENS: p.max_tokens,
                            tr.GEN_AI_TEMPERATURE: p.temperature, tr.GEN_AI_TOP_P: p.top_p,
                            tr.GEN_AI_N: p.n, "pdserve.request.internal_id": prepared.request_id})
        self.prompt_tokens += prepared.num_prompt_tokens    # a list of prompts: all of them
        self.root.set(tr.GEN_AI_PROMPT_TOKENS, self.prompt_tokens)

    def end(self, error: str = "") -> None:
        """End the root span (the response is out, or failed: `error`, else self.error)."""
        if not self.traced:
            return
        error = error or self.error
        root = self.root
        root.set_many({tr.GEN_AI_COMPLETION_TOKENS: self.completion_tokens,
                       tr.GEN_AI_FINISH_REASONS: self.finish_reasons,
                       tr.GEN_AI_TTFT: self.seconds.get("ttft"),
                       tr.GEN_AI_E2E: self.seconds.get("total"),
                       "pdserve.attempts": self.attempts})
        if error:
            root.error(error)
        root.end()
        self.root = NO_SPAN

    # ------------------------------------------------------------------ reporting
    def to_proto(self) -> pdserve_pb2.RequestTiming:
        out = pdserve_pb2.RequestTiming(received_unix_s=self.received_ns / 1e9,
                                        seconds=self.seconds, attempts=self.attempts,
                                        trace_id=self.trace_id)
        out.workers.extend(self.workers)
        return out

    def timing_json(self) -> dict:
        """The REST timing block (nvext.timing): milliseconds."""
        ms = {k: round(v * 1000, 3) for k, v in self.seconds.items()}
        out = {"request_received_ms": self.received_ns // 1_000_000,
               "ttft_ms": ms.get("ttft"), "total_time_ms": ms.get("total"),
               "phases_ms": ms, "attempts": self.attempts,
               "workers": [{"worker_id": w.worker_id, "role": w.role,
                            "phases_ms": {k: round(v * 1000, 3) for k, v in w.seconds.items()},
                            "counts": dict(w.counts)} for w in self.workers]}
        if self.traced:
            out["trace_id"] = self.trace_id
        return out

    def nvext(self, fields: tuple[str, ...]) -> dict:
        """The response's nvext object for the extra_fields asked for."""
        out: dict = {}
        if "timing" in fields:
            out["timing"] = self.timing_json()
        if "worker_id" in fields:
            out["worker_id"] = {"prefill_worker_id": self.prefill_worker_id,
                                "decode_worker_id": self.decode_worker_id}
        return out
