"""PNG plots of a replay (matplotlib, Agg backend: no display needed).

* ``ttft_cdf.png``: TTFT CDF per policy (log time axis);
* ``hit_rate_throughput.png``: hit rate and output throughput bars per policy;
* ``load_<policy>.png``: per-replica requests (running + waiting) over time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from simulator.replay.replayer import ReplayResult
from simulator.replay.report import PolicyStats


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def write_plots(out_dir: str | Path, results: Sequence[ReplayResult], stats: Sequence[PolicyStats]) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        ttft = np.sort([o.first_token_s - o.arrival_s for o in r.outcomes if not o.rejected])
        if ttft.size:
            ax.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=r.policy)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    path = out / "ttft_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    names = [s.policy for s in stats]
    a1.bar(names, [100 * s.hit_rate for s in stats], color="tab:green")
    a1.set_ylabel("prefix cache hit rate (%)")
    a2.bar(names, [s.throughput_tok_s for s in stats], color="tab:blue")
    a2.set_ylabel("output tokens / s")
    for a in (a1, a2):
        a.tick_params(axis="x", rotation=45)
        for label in a.get_xticklabels():
            label.set_horizontalalignment("right")
    fig.tight_layout()
    path = out / "hit_rate_throughput.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(path)

    for r in results:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        for i, series in enumerate(r.replica_load):
            ax.plot(r.sample_times_s[: len(series)], series, lw=0.8, label=f"replica {i}")
        ax.set_xlabel("simulated time (s)")
        ax.set_ylabel("running + waiting")
        ax.set_title(f"per-replica load: {r.policy}")
        if len(r.replica_load) <= 16:
            ax.legend(fontsize=6, ncol=4)
        fig.tight_layout()
        path = out / f"load_{_slug(r.policy)}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
