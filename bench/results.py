"""Benchmark results as files: ``docs/results/NAME.md`` (the table, with the command line, the
commit, the date and the machine that made it) and ``docs/results/data/NAME.json`` (the
figures). Regenerating a table is running the command at its top again; regenerating every
page is ``./run bench --record-all`` (``scripts/record_results.py``)."""

from __future__ import annotations

import ast
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
DATA = RESULTS / "data"
"""The figures of each page, as JSON (a folder of their own, so that ``docs/results`` lists
the pages)."""


def table(head: Sequence[str], rows: Iterable[Sequence[object]], left: int = 1) -> str:
    """A markdown table; the first ``left`` columns left-aligned, the rest right-aligned."""
    align = ["---" if i < left else "---:" for i in range(len(head))]
    return "\n".join("| " + " | ".join(map(str, r)) + " |" for r in [head, align, *rows])


def machine() -> dict[str, Any]:
    def proc(path: str, key: str) -> str:
        try:
            return next((x.split(":", 1)[1].strip() for x in Path(path).read_text().splitlines() if x.startswith(key)), "")
        except OSError:
            return ""

    return {"cores": os.cpu_count(), "cpu": proc("/proc/cpuinfo", "model name") or platform.processor(),
            "memory_gib": round(int(proc("/proc/meminfo", "MemTotal").split(" ")[0] or 0) / (1 << 20), 1),
            "os": platform.platform(), "python": platform.python_version()}  # fmt: skip


def commit() -> str:
    """HEAD's short hash, ``+changes`` when tracked files differ from it (other pages being
    written under docs/results/ are not changes to the code that made this one)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()

    try:
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs/results")
        return git("rev-parse", "--short", "HEAD") + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_result(name: str, title: str, markdown: str, data: dict[str, Any],
                 argv: list[str] | None = None) -> Path:  # fmt: skip
    """Write ``docs/results/NAME.md`` and ``docs/results/data/NAME.json``; returns the .md path."""
    DATA.mkdir(parents=True, exist_ok=True)
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    script_name = str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else str(script)
    command = "./run python " + " ".join(shlex.quote(a) for a in [script_name, *argv[1:]])
    m = machine()
    stamp = {"command": command, "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
             "machine": m}  # fmt: skip
    md = RESULTS / f"{name}.md"
    md.write_text(f"# {title}\n\nMade by `{command}` at commit {stamp['commit']} on {stamp['date']}, on {m['cores']} "
                  f"cores ({m['cpu'] or 'unknown CPU'}), {m['memory_gib']} GiB, {m['os']}, Python {m['python']}. Run "
                  f"the command again to regenerate this page.\n\n{markdown.rstrip()}\n", encoding="utf-8")  # fmt: skip
    (DATA / f"{name}.json").write_text(json.dumps({**stamp, "results": data}, indent=1) + "\n", encoding="utf-8")
    return md


def record(argv: list[str]) -> int:
    """``python bench/results.py NAME SCRIPT [args]``: run a benchmark that prints its figures
    and keep what it printed as ``docs/results/NAME.md`` (stamped like the pages the
    benchmarks write themselves). ``./run bench NAME --record [args]`` does this for
    ``bench/bench_NAME.py``."""
    if len(argv) < 2:
        print("usage: results.py NAME SCRIPT [args]", file=sys.stderr)
        return 2
    name, script, *args = argv
    done = subprocess.run([sys.executable, script, *args], cwd=ROOT, check=False, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(done.stdout)
    if done.returncode != 0:
        print(f"{script} failed ({done.returncode}): nothing recorded", file=sys.stderr)
        return done.returncode
    doc = (ast.get_docstring(ast.parse((ROOT / script).read_text())) or "").split("\n\n")[0]
    body = f"{' '.join(doc.split())}\n\nWhat it printed:\n\n```\n{done.stdout.rstrip()}\n```\n"
    path = write_result(name, f"{Path(script).stem}: {name}", body,
                        {"stdout": done.stdout}, argv=["bench/results.py", name, script, *args])  # fmt: skip
    print(f"recorded {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(record(sys.argv[1:]))
