"""The terminal table (figures, then each run's totals), the JSON result file, and run-by-run comparison."""
from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

ROWS: list[tuple[str, str, str]] = [  # (label, key path in figures, number format)
    ("requests ok", "num_ok", "d"), ("errors", "num_errors", "d"), ("duration s", "duration_s", ".2f"),
    ("request/s", "request_throughput", ".3f"), ("input tok/s", "input_tok_s", ".1f"),
    ("output tok/s", "output_tok_s", ".1f"), ("goodput req/s", "goodput", ".3f"),
    ("cache hit rate", "cache_hit_rate", ".3f"),
    *[(f"{name.upper()} {stat} ms", f"{name}.{stat}_ms", ".1f")
      for name in ("ttft", "tpot", "itl", "e2e") for stat in ("mean", "p50", "p90", "p99")],
]
TOTAL_ROWS: list[tuple[str, str, str]] = [  # (label, key in a run's totals, number format)
    ("requests sent", "num_sent", "d"), ("requests failed", "num_failed", "d"),
    ("completion tokens", "num_completion_tokens", "d"), ("expected tokens", "num_expected_tokens", "d"),
    ("short outputs", "num_short", "d"), ("exact", "is_exact", "s"),
]
SUSTAINED_ROWS: list[tuple[str, str, str]] = [  # W6: (label, key in a run's "sustained", number format)
    ("loop output tok/s", "output_tok_s", ".1f"), ("steady ratio", "steady_ratio", ".3f"),
    ("first output tok/s", "first_output_tok_s", ".1f"), ("last output tok/s", "last_output_tok_s", ".1f"),
]
LOWER_IS_BETTER = ("ttft", "tpot", "itl", "e2e", "num_errors", "duration_s")


def lookup(figures: dict[str, Any], path: str) -> Any:
    value: Any = figures
    for key in path.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if fmt == "s":
        return {True: "yes", False: "NO"}.get(value, str(value))
    return format(value, fmt) if fmt != "d" else str(int(value))


def table(runs: list[dict[str, Any]], with_ratios: bool = False) -> str:
    """Runs side by side (one column each); with_ratios adds each run's ratio to the first."""
    header = ["metric", *[r["label"] for r in runs]]
    if with_ratios:
        header += [f"{r['label']} / {runs[0]['label']}" for r in runs[1:]]
    lines = [header]
    for label, path, fmt in ROWS:
        values = [lookup(r["figures"], path) for r in runs]
        row = [label, *[_cell(v, fmt) for v in values]]
        if with_ratios:
            base = values[0]
            row += [f"{v / base:.2f}x" if isinstance(v, (int, float)) and base else "-" for v in values[1:]]
        lines.append(row)
    errors = sorted({k for r in runs for k in r["figures"].get("errors", {})})
    for kind in errors:
        lines.append([f"  {kind}", *[str(r["figures"]["errors"].get(kind, 0)) for r in runs]]
                     + (["-"] * (len(runs) - 1) if with_ratios else []))
    lines += _total_lines(runs, with_ratios)
    if any("sustained" in r for r in runs):
        lines += [[label, *[_cell((r.get("sustained") or {}).get(key), fmt) for r in runs],
                   *(["-"] * (len(runs) - 1) if with_ratios else [])] for label, key, fmt in SUSTAINED_ROWS]
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    out = []
    for n, row in enumerate(lines):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def _total_lines(runs: list[dict[str, Any]], with_ratios: bool) -> list[list[str]]:
    """The totals rows (runs without totals, e.g. older result files, show "-"), then finish reasons."""
    pad = ["-"] * (len(runs) - 1) if with_ratios else []
    lines = [[label, *[_cell((r.get("totals") or {}).get(key), fmt) for r in runs], *pad]
             for label, key, fmt in TOTAL_ROWS]
    reasons = sorted({k for r in runs for k in (r.get("totals") or {}).get("finish_reasons", {})})
    for reason in reasons:
        lines.append([f"  finish {reason}",
                      *[str((r.get("totals") or {}).get("finish_reasons", {}).get(reason, 0)) for r in runs], *pad])
    return lines


def result_record(command: str, workload: str, settings: dict[str, Any], target: dict[str, Any],
                  runs: list[dict[str, Any]], server_hardware: str | None) -> dict[str, Any]:
    client = client_hardware()
    return {"command": command, "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "hardware": {"client": client, "server": server_hardware or _server_guess(target, client)},
            "target": target, "workload": workload, "settings": settings, "runs": runs}


def write_json(record: dict[str, Any], out_dir: str | Path, stem: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(record, indent=1, default=str))
    return path


def load_runs(paths: list[str]) -> list[dict[str, Any]]:
    """Every run of every result file, labelled file-stem:run-label (just the stem for single-run files)."""
    runs = []
    for path in paths:
        record = json.loads(Path(path).read_text())
        for run in record["runs"]:
            label = Path(path).stem if len(record["runs"]) == 1 else f"{Path(path).stem}:{run['label']}"
            runs.append({**run, "label": label, "source": str(path)})
    return runs


def client_hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = ""
    if shutil.which("nvidia-smi"):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True, timeout=10).stdout.split("\n")
            gpus = ", " + ", ".join(n.strip() for n in names if n.strip())
        except (OSError, subprocess.TimeoutExpired):
            pass
    return f"{cpu}, {cores} cores{gpus}, {platform.system()} {platform.release()}"


def _server_guess(target: dict[str, Any], client: str) -> str:
    host = target.get("base_url", "").split("://", 1)[-1].split("/", 1)[0].split(":", 1)[0]
    if host in ("127.0.0.1", "localhost", "::1", "[::1]"):
        return f"same machine as the client: {client}"
    return "unknown (pass --hardware)"


def commit() -> str:
    """The checkout's commit, read from .git without running git; "unknown" outside a checkout."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        git = root / ".git"
        try:
            head = (git / "HEAD").read_text().strip()
        except OSError:
            continue
        if not head.startswith("ref: "):
            return head[:12]
        ref = head[5:]
        try:
            return (git / ref).read_text().strip()[:12]
        except OSError:
            pass
        try:
            for line in (git / "packed-refs").read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0][:12]
        except OSError:
            pass
    return "unknown"


def with_slo(run: dict[str, Any], slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict[str, Any]:
    """run with goodput re-counted from its stored requests under another SLO (the other figures stay)."""
    from radixserve.bench.metrics import RequestRecord, meets_slo

    names = set(RequestRecord.__dataclass_fields__)
    records = [RequestRecord(**{k: v for k, v in r.items() if k in names}) for r in run.get("requests", [])]
    num_good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in records)
    duration_s = run["figures"].get("duration_s") or 0.0
    figures = {**run["figures"], "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms, "num_good": num_good,
               "goodput": num_good / duration_s if duration_s > 0 else None}
    return {**run, "figures": figures}


def answer(runs: list[dict[str, Any]]) -> str:
    """Which deployment to choose: the highest goodput under the SLO the runs were scored with, or, without
    an SLO, the highest output throughput; with the two tail latencies the seed asks about."""
    def fig(run: dict[str, Any], path: str) -> float:
        value = lookup(run["figures"], path)
        return float(value) if isinstance(value, (int, float)) else float("nan")

    has_slo = all(lookup(r["figures"], "goodput") is not None for r in runs)
    key = "goodput" if has_slo else "output_tok_s"
    best = max(runs, key=lambda r: (fig(r, key), -fig(r, "tpot.p99_ms")))
    rows = "; ".join(f"{r['label']}: TTFT P90 {fig(r, 'ttft.p90_ms'):.0f} ms, TPOT P99 {fig(r, 'tpot.p99_ms'):.1f} ms, "
                     f"{fig(r, 'output_tok_s'):.1f} out tok/s, goodput {_cell(lookup(r['figures'], 'goodput'), '.3f')}"
                     for r in runs)
    if has_slo:
        f = best["figures"]
        slo = " and ".join(s for s in (f"TTFT <= {f['slo_ttft_ms']:g} ms" if f.get("slo_ttft_ms") else "",
                                       f"TPOT <= {f['slo_tpot_ms']:g} ms" if f.get("slo_tpot_ms") else "") if s)
        why = f"highest goodput under {slo}"
    else:
        why = "highest output throughput (no SLO given: pass --slo-ttft-ms/--slo-tpot-ms to score goodput)"
    return f"answer: choose {best['label']} ({why}). {rows}"
