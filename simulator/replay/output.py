"""A replay's results as files to keep and share (``epp-sim replay --out-dir DIR``):

* ``report.json``: ``{"inputs": ..., "results": [...]}``, the inputs being everything needed
  to run it again: the command line, epp's version, the trace (path, SHA-256, rows) or the
  generator and its parameters, the replay settings (cost model included), the epp config
  (its name or path and the SHA-256 of its text), the policies, the machine and the date;
* ``report.csv``: one row per policy (and sweep point);
* the PNG plots (``--plot-dir``'s, without a sweep) and ``index.html``, which shows the
  inputs, the table and the plots, with no script and nothing fetched.
"""

from __future__ import annotations

import csv
import dataclasses
import hashlib
import html
import json
import platform
import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import epp
from simulator.replay.replayer import ReplayConfig

COLUMNS = ("sweep", "policy", "hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s",
           "tpot_p90_s", "e2e_p50_s", "e2e_p99_s", "throughput_tok_s", "queue_share", "load_imbalance",
           "split_share", "rejected")  # fmt: skip


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    return str(value)


def inputs_of(workload: Any, trace: str | None, config: ReplayConfig, policies: Sequence[str],
              epp_config: str | None, argv: Sequence[str]) -> dict[str, Any]:  # fmt: skip
    """What a replay ran on, enough to run it again and to tell two runs apart."""
    source: dict[str, Any]
    if trace:
        path = Path(trace)
        source = {"trace": str(path), "sha256": _sha256(path), "rows": len(workload),
                  "format": type(workload).__name__,
                  "time_scale": getattr(workload, "time_scale", 1.0)}  # fmt: skip
    else:
        params = getattr(workload, "p", None)
        source = {"generator": workload.name, "parameters": _jsonable(params), "requests": len(workload)}
    cfg: dict[str, Any] = {"name": epp_config or "default (shipped)"}
    if epp_config and Path(epp_config).is_file():
        cfg["sha256"] = _sha256(Path(epp_config))
    machine = {"python": platform.python_version(), "platform": platform.platform(),
               "processor": platform.processor() or platform.machine()}  # fmt: skip
    return {
        "command": shlex.join(["epp-sim", *argv]),
        "epp_version": epp.__version__,
        "workload": source,
        "replay": _jsonable(config),
        "policies": list(policies),
        "epp_config": cfg,
        "machine": machine,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def write_outputs(out_dir: str | Path, inputs: Mapping[str, Any], rows: Sequence[Mapping[str, Any]],
                  plots: Sequence[Path] = (), bound: Mapping[str, float] | None = None) -> list[Path]:  # fmt: skip
    """Write ``report.json``, ``report.csv`` and ``index.html`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {"inputs": inputs, "results": list(rows), "ttft_bound_s": dict(bound or {})}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    with open(out / "report.csv", "w", encoding="utf-8", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: row.get(k, "") for k in COLUMNS})
    (out / "index.html").write_text(_html(inputs, rows, [p.name for p in plots], bound), encoding="utf-8")
    return [out / "report.json", out / "report.csv", out / "index.html"]


def _cell(key: str, value: Any) -> str:
    if isinstance(value, float):
        if key in ("hit_rate", "queue_share"):
            return f"{100 * value:.1f}%"
        return f"{value:,.3f}" if key.endswith("_s") else f"{value:,.2f}"
    return html.escape(str(value))


def _html(inputs: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], plots: Sequence[str],
          bound: Mapping[str, float] | None) -> str:  # fmt: skip
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{_cell(c, r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows)
    figs = "".join(f'<figure><img src="{html.escape(p)}" alt="{html.escape(p)}"></figure>' for p in plots)
    b = ""
    if bound:
        b = "<p>TTFT no policy beats: " + ", ".join(f"{k} {v:.3f} s" for k, v in bound.items()) + "</p>"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>epp-sim replay</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}th{{background:#eee}}
img{{max-width:48%;margin:4px}}pre{{background:#f6f6f6;padding:1em;overflow:auto}}</style></head>
<body><h1>epp-sim replay</h1>
<p><code>{html.escape(str(inputs.get("command", "")))}</code></p>
<table><tr>{head}</tr>{body}</table>{b}
{figs}
<h2>Inputs</h2><pre>{html.escape(json.dumps(inputs, indent=2))}</pre>
</body></html>
"""
