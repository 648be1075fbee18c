"""The PNG of a bench report: latency CDFs (TTFT, TPOT, E2E) per load point and request kind;
for a sweep (several load points), output throughput and TPOT/TTFT p50/p99 against the load."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

CDF_METRICS = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("e2e_ms", "E2E (ms)"))


def _cdf(ax, values: list[float], label: str) -> None:
    if not values:
        return
    xs = sorted(values)
    xs = [xs[0], *xs]
    ys = [0.0] + [(i + 1) / len(values) for i in range(len(values))]
    ax.step(xs, ys, where="post", label=label)


def _load_axis(report: dict) -> tuple[str, list[float]]:
    runs = report["runs"]
    if "concurrency" in runs[0]:
        return "concurrency", [r["concurrency"] for r in runs]
    return "request rate (req/s)", [r["request_rate"] for r in runs]


def plot_report(report: dict, path: Path) -> None:
    runs = report["runs"]
    sweep = len(runs) > 1
    fig, axes = plt.subplots(2 if sweep else 1, 3, figsize=(15, 8.5 if sweep else 4.5),
                             squeeze=False)
    for ax, (metric, title) in zip(axes[0], CDF_METRICS):
        for run in runs:
            kinds = run["summary"]
            for kind in kinds:
                values = [r[metric] for r in run["requests"]
                          if r["ok"] and r["kind"] == kind and r[metric] is not None]
                _cdf(ax, values, run["point"] if len(kinds) == 1 else f"{run['point']} {kind}")
        ax.set_xlabel(title)
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if sweep:
        _plot_sweep(axes[1], report)
    fig.suptitle(f"{report['label']}: {report['config']['workload']}, "
                 f"{report['config']['model']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_sweep(axes, report: dict) -> None:
    xlabel, xs = _load_axis(report)
    kinds = list(report["runs"][0]["summary"])
    thr, tpot, ttft = axes
    for kind in kinds:
        summaries = [run["summary"].get(kind, {}) for run in report["runs"]]
        suffix = "" if len(kinds) == 1 else f" {kind}"
        thr.plot(xs, [s.get("output_throughput") for s in summaries], "o-", label="output" + suffix)
        for ax, metric, name in ((tpot, "tpot_ms", "TPOT"), (ttft, "ttft_ms", "TTFT")):
            for stat, style in (("p50", "o-"), ("p99", "s--")):
                ys = [(s.get(metric) or {}).get(stat) for s in summaries]
                ax.plot(xs, [float("nan") if y is None else y for y in ys], style,
                        label=f"{name} {stat}{suffix}")
    thr.set_ylabel("output tokens/s")
    tpot.set_ylabel("TPOT (ms)")
    ttft.set_ylabel("TTFT (ms)")
    for ax in axes:
        ax.set_xlabel(xlabel)
        if xlabel == "concurrency":
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
