"""`pdserve trace-report`: where a run's requests spent their time, from trace-collect's JSON
lines. A request is a trace with the gateway's `pdserve.request` root; a phase's time in a
request is the summed duration of its spans of that name (a retried attempt counts each try)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from cluster.tracing import GEN_AI_E2E, GEN_AI_TTFT

ROOT = "pdserve.request"
# Report order; the leaves (no phase of this list below them) stack up in the plot.
PHASES = (ROOT, "gateway.validate", "gateway.tokenize", "gateway.admission_wait",
          "gateway.route", "gateway.attempt", "gateway.decode", "gateway.prefill",
          "prefill.request", "prefill.queue", "prefill.compute", "kv.transfer",
          "decode.request", "decode.reservation", "decode.kv_wait", "decode.admission",
          "decode.generate")
STACKED = ("gateway.validate", "gateway.tokenize", "gateway.admission_wait", "gateway.route",
           "decode.reservation", "prefill.queue", "prefill.compute", "kv.transfer",
           "decode.kv_wait", "decode.admission", "decode.generate")
QUANTILES = (0.5, 0.9, 0.99)


def load(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q
    low, high = math.floor(at), math.ceil(at)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def _root_of(span: dict, by_id: dict[tuple[str, str], dict]) -> dict | None:
    """The nearest `pdserve.request` at or above `span` (a client's trace may hold several)."""
    seen = set()
    while span is not None and span["span_id"] not in seen:
        if span["name"] == ROOT:
            return span
        seen.add(span["span_id"])
        span = by_id.get((span["trace_id"], span.get("parent_span_id") or ""))
    return None


def requests(spans: list[dict]) -> list[dict]:
    """One entry per `pdserve.request` span: trace id, phase -> seconds of its spans, ttft and
    e2e seconds (the root's gen_ai attributes), whether it failed."""
    by_id = {(s["trace_id"], s["span_id"]): s for s in spans}
    phases: dict[tuple, dict[str, float]] = {}
    for span in spans:
        root = _root_of(span, by_id)
        if root is not None:
            totals = phases.setdefault((root["trace_id"], root["span_id"]), defaultdict(float))
            totals[span["name"]] += (span["end_ns"] - span["start_ns"]) / 1e9
    out = []
    for key, totals in phases.items():
        attrs = by_id[key].get("attributes", {})
        out.append({"trace_id": key[0], "phases": dict(totals),
                    "ttft": attrs.get(GEN_AI_TTFT), "e2e": attrs.get(GEN_AI_E2E),
                    "error": by_id[key].get("status", {}).get("code") == "error"})
    return out


def _row(name: str, values: list[float]) -> dict:
    row = {"phase": name, "count": len(values)}
    for q in QUANTILES:
        row[f"p{round(q * 100)}"] = percentile(values, q)
    return row


def summarize(spans: list[dict], slowest: int = 5) -> dict:
    reqs = requests(spans)
    names = list(PHASES) + sorted({n for r in reqs for n in r["phases"]} - set(PHASES))
    rows = []
    for name in names:
        values = [r["phases"][name] for r in reqs if name in r["phases"]]
        if values:
            rows.append(_row(name, values))
    for key in ("ttft", "e2e"):
        values = [r[key] for r in reqs if r[key] is not None]
        if values:
            rows.append(_row(key, values))
    ranked = sorted(reqs, key=lambda r: r["ttft"] if r["ttft"] is not None
                    else r["phases"][ROOT], reverse=True)
    return {"traces": len({s["trace_id"] for s in spans}), "requests": len(reqs),
            "errors": sum(r["error"] for r in reqs), "spans": len(spans), "phases": rows,
            "slowest": ranked[:slowest]}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f}"


def render(summary: dict) -> str:
    lines = [f"{summary['requests']} requests ({summary['errors']} failed) in "
             f"{summary['traces']} traces, {summary['spans']} spans", "",
             f"{'phase (ms)':<24}{'count':>7}{'p50':>11}{'p90':>11}{'p99':>11}"]
    for row in summary["phases"]:
        lines.append(f"{row['phase']:<24}{row['count']:>7}{_ms(row['p50']):>11}"
                     f"{_ms(row['p90']):>11}{_ms(row['p99']):>11}")
    if summary["slowest"]:
        lines += ["", f"slowest {len(summary['slowest'])} by TTFT (ms):"]
    for req in summary["slowest"]:
        lines.append(f"  trace {req['trace_id']}  ttft {_ms(req['ttft'])}  "
                     f"e2e {_ms(req['e2e'])}")
        parts = [f"{name} {_ms(req['phases'][name])}" for name in STACKED
                 if name in req["phases"]]
        lines.append("    " + ", ".join(parts))
    return "\n".join(lines)


def plot(summary: dict, path: str | Path) -> None:
    """A horizontal stacked bar of the leaf phases per slow request."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    reqs = summary["slowest"]
    fig, ax = plt.subplots(figsize=(10, 1.0 + 0.5 * max(len(reqs), 1)))
    labels = [r["trace_id"][:8] for r in reqs]
    left = [0.0] * len(reqs)
    for name in STACKED:
        widths = [r["phases"].get(name, 0.0) * 1e3 for r in reqs]
        if any(widths):
            ax.barh(labels, widths, left=left, label=name)
            left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title("slowest requests by TTFT: where the time went")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(args) -> int:
    summary = summarize(load(args.file), args.slowest)
    print(json.dumps(summary, indent=2) if args.json else render(summary))
    if args.plot:
        plot(summary, args.plot)
    return 0 if summary["requests"] else 1
