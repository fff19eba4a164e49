"""PNG plots with matplotlib (Agg): latency CDFs of runs, TTFT P50/P90 against the request rate, and W6's
throughput, KV usage and hit rate over time."""
from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

CDF_PANELS = (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "end-to-end latency"))
TIMELINE_PANELS = (("output_tok_s", "output tok/s"), ("kv_cache_usage_perc", "KV cache usage"),
                   ("hit_rate", "prefix-cache hit rate"))


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def latency_cdfs(runs: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """One panel per latency (ms, log x when it spans a decade), one line per run, successes only."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(CDF_PANELS), figsize=(5 * len(CDF_PANELS), 3.8))
    for ax, (key, name) in zip(axes, CDF_PANELS):
        spans = []
        for run in runs:
            values = np.sort([r[key] * 1e3 for r in run["requests"] if r["error_kind"] is None and r[key] is not None])
            if len(values) == 0:
                continue
            fractions = np.arange(0, len(values) + 1) / len(values)
            ax.step(np.concatenate([values[:1], values]), fractions, where="post", label=run["label"])
            spans += [values[0], values[-1]]
        if spans and min(spans) > 0 and max(spans) / min(spans) > 10:
            ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(textwrap.shorten(title, 160), fontsize=10)
    fig.tight_layout()
    return _save(fig, plt, path)


def ttft_vs_rate(runs: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """TTFT P50 (solid) and P90 (dashed) against the offered rate, one line pair per series."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        if run.get("rate") is not None and math.isfinite(run["rate"]):
            series.setdefault(run.get("series", ""), []).append(run)
    for name, points in series.items():
        points.sort(key=lambda r: r["rate"])
        rates = [r["rate"] for r in points]
        for stat, style in (("p50", "-o"), ("p90", "--s")):
            ax.plot(rates, [r["figures"]["ttft"][f"{stat}_ms"] for r in points], style,
                    label=f"{name} TTFT {stat.upper()}".strip())
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(textwrap.fill(textwrap.shorten(title, 120), 60), fontsize=9)
    fig.tight_layout()
    return _save(fig, plt, path)


def timeline(runs: list[dict[str, Any]], path: str | Path, title: str) -> Path:
    """W6: one panel per series against the window's end time, one line per run (e.g. cache on vs off);
    a series the server did not export is left out of its panel, which says so."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(TIMELINE_PANELS), figsize=(5 * len(TIMELINE_PANELS), 3.8))
    for ax, (key, name) in zip(axes, TIMELINE_PANELS):
        is_drawn = False
        for run in runs:
            points = [(w["t_end_s"], w[key]) for w in run.get("samples", []) if w.get(key) is not None]
            if points:
                ax.plot(*zip(*points), "-o", markersize=3, label=run["label"])
                is_drawn = True
        if not is_drawn:
            ax.text(0.5, 0.5, "not reported", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("time (s)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(textwrap.shorten(title, 160), fontsize=10)
    fig.tight_layout()
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
