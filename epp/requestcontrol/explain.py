"""Why epp picked an endpoint, from the profile runs a cycle recorded (``ProfileRun``).

* ``pick_reason``: one line for the ``x-epp-pick-reason`` response header: the winner, the
  runner-up and the weighted scorer differences that separated them, largest first::

      10.0.0.2:8000 over 10.0.0.1:8000 (total 2.41 vs 1.10, profile default):
      prefix-cache-scorer 0.92 vs 0.05 x3, queue-scorer 0.50 vs 0.40 x1

  (one line in the header; wrapped here).
* ``run_tables``: every profile run as text: each filter's survivors, then one row per
  candidate with each scorer's score (before its weight), the weighted total and the pick;
  what ``epp dry-run`` prints.

Neither ever sees prompt text: a run holds endpoint ids and numbers only.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.framework.types import ProfileRun

PICK_REASON_HEADER = "x-epp-pick-reason"
MAX_REASON_CHARS = 1024


def primary_run(runs: Sequence[ProfileRun], target: str) -> ProfileRun | None:
    """The run that picked ``target`` (the last such: a handler may run profiles twice)."""
    for run in reversed(runs):
        if run.picked and run.picked[0] == target:
            return run
    return None


def pick_reason(runs: Sequence[ProfileRun], target: str, prefiller: str = "") -> str:
    """The one-line reason ``target`` was picked (module docstring); '' when no run picked it."""
    run = primary_run(runs, target)
    if run is None:
        return ""
    prefill = f"; prefill on {prefiller}" if prefiller else ""
    i = run.candidates.index(run.picked[0])
    others = [j for j in range(len(run.candidates)) if j != i]
    if not others:
        cut = next((f.name for f in run.filters if len(f.survivors) == 1), "")
        left = f", {cut} left it alone" if cut else ""
        text = (f"{target}, the only candidate of {len(run.endpoints)} (profile {run.profile}"
                f"{left}){prefill}")  # fmt: skip
        return text[:MAX_REASON_CHARS]
    j = max(others, key=lambda k: run.totals[k])
    gaps = sorted(
        ((c.weight * (c.scores[i] - c.scores[j]), c) for c in run.scorers if c.scores[i] != c.scores[j]),
        key=lambda g: -abs(g[0]),
    )  # fmt: skip
    parts = [f"{c.name} {c.scores[i]:.2f} vs {c.scores[j]:.2f} x{c.weight:g}" for _, c in gaps]
    why = ", ".join(parts) if parts else f"every score equal: {run.picker} chose"
    text = (f"{target} over {run.candidates[j]} (total {run.totals[i]:.2f} vs {run.totals[j]:.2f}, "
            f"profile {run.profile}): {why}{prefill}")  # fmt: skip
    return text[:MAX_REASON_CHARS]


def run_tables(runs: Sequence[ProfileRun]) -> str:
    """Every run as text (module docstring)."""
    out: list[str] = []
    for run in runs:
        out.append(f"profile {run.profile}: {len(run.endpoints)} endpoints")
        for step in run.filters:
            names = ", ".join(step.survivors) if step.survivors else "none"
            out.append(f"  filter {step.name}: {len(step.survivors)} left: {names}")
        if not run.candidates:
            out.append("  no candidate left: the request would get 503")
            out.append("")
            continue
        head = ["endpoint", *(f"{c.name} x{c.weight:g}" for c in run.scorers), "total", "picked"]
        rows = []
        for k, endpoint in enumerate(run.candidates):
            pick = run.picked.index(endpoint) if endpoint in run.picked else -1
            mark = "" if pick < 0 else ("<- pick" if pick == 0 else f"fallback {pick}")
            rows.append([endpoint, *(f"{c.scores[k]:.3f}" for c in run.scorers),
                         f"{run.totals[k]:.3f}", mark])  # fmt: skip
        order = sorted(range(len(rows)), key=lambda k: -run.totals[k])
        widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
        for r in [head, *(rows[k] for k in order)]:
            out.append("  " + "  ".join(v.ljust(w) if c == 0 else v.rjust(w)
                                        for c, (v, w) in enumerate(zip(r, widths, strict=True))).rstrip())  # fmt: skip
        out.append(f"  picker {run.picker}: {', '.join(run.picked)}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
