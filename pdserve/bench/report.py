"""Tables of bench results, the JSON file, and `pdserve bench compare`.

The report (and the JSON file) is:

    {"label", "created", "config": {...BenchConfig, "model"},
     "runs": [{"point": "c=16", "concurrency": 16 | "request_rate": 4.0, "duration_s",
               "summary": {kind: summary (stats.summarize)},
               "requests": [per-request numbers (RequestResult.to_json)]}]}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

Getter = Callable[[dict], "float | None"]


def _field(key: str) -> Getter:
    return lambda s: s.get(key)


def _stat(metric: str, stat: str) -> Getter:
    return lambda s: (s.get(metric) or {}).get(stat)


ROWS: list[tuple[str, Getter]] = [
    ("completed", _field("completed")),
    ("failed", _field("failed")),
    ("duration (s)", _field("duration_s")),
    ("requests/s", _field("request_throughput")),
    ("output tok/s", _field("output_throughput")),
    ("total tok/s", _field("total_token_throughput")),
    ("goodput (req/s)", _field("goodput")),
] + [(f"{name} {stat} (ms)", _stat(metric, stat))
     for metric, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                          ("e2e_ms", "E2E"))
     for stat in ("mean", "p50", "p90", "p99")]


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.2f}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, rows)])


def columns(report: dict) -> dict[str, dict]:
    """{column name: summary} for every (load point, request kind) of a report."""
    out = {}
    for run in report["runs"]:
        kinds = run["summary"]
        for kind, summary in kinds.items():
            out[run["point"] if len(kinds) == 1 else f"{run['point']} {kind}"] = summary
    return out


def _used_rows(summaries: list[dict]) -> list[tuple[str, Getter]]:
    return [(name, get) for name, get in ROWS
            if any(get(s) is not None for s in summaries) or name == "failed"]


def format_report(report: dict) -> str:
    cfg = report["config"]
    cols = columns(report)
    head = (f"{report['label']}: {cfg['workload']} against {cfg['base_url']} "
            f"(model {cfg['model']}, {_shape(cfg)})")
    rows = [[name] + [_fmt(get(s)) for s in cols.values()]
            for name, get in _used_rows(list(cols.values()))]
    errors = sorted({e for s in cols.values() for e in s.get("errors", [])})
    tail = "".join(f"\n  error: {e}" for e in errors)
    return f"{head}\n{_table(['metric', *cols], rows)}{tail}"


def _shape(cfg: dict) -> str:
    if cfg["workload"] == "shared-prefix":
        return (f"{cfg['num_groups']} groups x {cfg['users_per_group']} users, prefix "
                f"{cfg['prefix_len']} + question {cfg['question_len']} in / "
                f"{cfg['output_len']} out")
    text = f"{cfg['num_prompts']} x {cfg['input_len']} in / {cfg['output_len']} out"
    if cfg["workload"] == "long-burst":
        text += f", long {cfg['long_len']} in at {cfg['long_rate']:g}/s"
    return text


def write_json(report: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))


def load(path: Path) -> dict:
    report = json.loads(Path(path).read_text())
    if "runs" not in report or "config" not in report:
        raise SystemExit(f"{path} is not a `pdserve bench --out` file")
    return report


def _ratio(a, b) -> str:
    if a is None or b is None or not b:
        return "-"
    return f"x{a / b:.2f}"


def format_compare(reports: list[dict]) -> str:
    """Side-by-side tables, one per load point present in every report (or, when every report
    has a single column, those columns), with FIRST / OTHER ratio columns."""
    labels = [r["label"] for r in reports]
    cols = [columns(r) for r in reports]
    keys = [k for k in cols[0] if all(k in c for c in cols[1:])]
    pairs = [(k, [c[k] for c in cols]) for k in keys]
    if not pairs and all(len(c) == 1 for c in cols):
        pairs = [(" vs ".join(next(iter(c)) for c in cols), [next(iter(c.values())) for c in cols])]
    if not pairs:
        return "no load point in common: " + "; ".join(
            f"{lab}: {', '.join(c)}" for lab, c in zip(labels, cols))
    lines = [f"{r['label']}: {r['config']['workload']} against {r['config']['base_url']} "
             f"({_shape(r['config'])})" for r in reports]
    headers = ["metric", *labels, *(f"{labels[0]}/{lab}" for lab in labels[1:])]
    for key, summaries in pairs:
        rows = []
        for name, get in _used_rows(summaries):
            values = [get(s) for s in summaries]
            rows.append([name, *map(_fmt, values), *(_ratio(values[0], v) for v in values[1:])])
        lines += ["", f"== {key}", _table(headers, rows)]
    return "\n".join(lines)


def compare_main(args) -> int:
    reports = [load(Path(f)) for f in args.files]
    labels = [r["label"] for r in reports]
    for report, path in zip(reports, args.files):
        if labels.count(report["label"]) > 1:  # same label twice: tell them apart by file
            report["label"] = f"{report['label']}({Path(path).stem})"
    print(format_compare(reports))
    return 0
