"""Per-request measurements and their summary: percentiles, throughput, goodput under SLOs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    """What one request measured. Times are seconds; `start_s`/`end_s` are from the run start.

    ttft_s: until the first chunk with non-empty text. itl_s: gaps between successive content
    chunks (a chunk may carry several tokens). output_tokens: usage.completion_tokens when the
    server sent usage, else the number of content chunks.
    """

    kind: str
    input_len: int
    output_len: int
    start_s: float = 0.0
    end_s: float = 0.0
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    text: str = ""                 # the streamed text (a multi-turn conversation appends it)

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None below two tokens or on failure."""
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        ms = lambda s: None if s is None else round(s * 1000, 3)  # noqa: E731
        return {"kind": self.kind, "input_len": self.input_len, "output_len": self.output_len,
                "ok": self.ok, "error": self.error, "start_ms": ms(self.start_s),
                "ttft_ms": ms(self.ttft_s), "tpot_ms": ms(self.tpot_s), "e2e_ms": ms(self.e2e_s),
                "itl_ms": [ms(g) for g in self.itl_s], "output_tokens": self.output_tokens,
                "prompt_tokens": self.prompt_tokens, "finish_reason": self.finish_reason}


@dataclass(frozen=True)
class SLO:
    """Latency objectives in ms; None = not set. A request meets the SLO when it succeeded and
    meets every objective that is set (TPOT counts as met for a one-token output)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        checks = ((self.ttft_ms, r.ttft_s), (self.tpot_ms, r.tpot_s), (self.e2e_ms, r.e2e_s))
        return all(limit is None or value is None or value * 1000 <= limit
                   for limit, value in checks)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's
    default method); None for an empty list."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def describe_ms(values_s: list[float]) -> dict[str, float | None]:
    """mean and p50/p90/p99 in ms of values given in seconds."""
    ms = [v * 1000 for v in values_s]
    out = {"mean": sum(ms) / len(ms) if ms else None}
    out.update({f"p{q}": percentile(ms, q) for q in PERCENTILES})
    return out


def summarize(results: list[RequestResult], duration_s: float, slo: SLO) -> dict:
    """The summary of one group of requests over a run lasting duration_s (rates per second of
    the whole run, so groups of one run add up)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.input_len for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    summary = {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration_s, "input_tokens": in_tokens, "output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "goodput": per_s(sum(slo.met(r) for r in results)) if slo.is_set else None,
        "ttft_ms": describe_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": describe_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": describe_ms([g for r in ok for g in r.itl_s]),
        "e2e_ms": describe_ms([r.e2e_s for r in ok]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }
    return summary
