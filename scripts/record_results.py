"""Regenerate every page under docs/results/ by the command written at its top, one after the
other, and say which pages changed.

Each page starts with the line ``Made by `COMMAND` at commit C on DATE ...`` (``bench/results.py``
writes it): that command is the page's recipe, so this script needs no list of its own. It
takes as long as the benchmarks take (hours: the real-vLLM pages run 8 rounds each). A command
that fails, or a benchmark that prints ``skipped: ...`` (real vLLM not installed, a tool
missing), leaves its page as it was and is reported so.

    ./run bench --record-all            # every page
    ./run bench --record-all demo pd    # those pages only
    ./run bench --record-all --list     # print each page's command, run nothing
"""

from __future__ import annotations

import argparse
import difflib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
STAMP = re.compile(r"^Made by `(?P<command>[^`]+)` at commit (?P<commit>\S+) on (?P<date>\d{4}-\d\d-\d\d \d\d:\d\d UTC)")
"""The stamp line ``bench/results.py`` writes under a page's title."""


@dataclass(slots=True, frozen=True)
class Page:
    name: str
    path: Path
    command: str
    commit: str
    date: str


def pages() -> list[Page]:
    """Every result page (not the index), with the command, commit and date of its stamp.
    Raises ValueError naming a page without a stamp."""
    found = []
    for path in sorted(RESULTS.glob("*.md")):
        if path.name == "README.md":
            continue
        match = next((m for line in path.read_text(encoding="utf-8").splitlines()[:5]
                      if (m := STAMP.match(line))), None)  # fmt: skip
        if match is None:
            raise ValueError(f"{path.relative_to(ROOT)}: no 'Made by `COMMAND` at commit C on DATE' line")
        found.append(Page(path.stem, path, match["command"], match["commit"], match["date"]))
    return found


def _body(text: str) -> list[str]:
    """A page without its stamp line (which changes at every run)."""
    return [line for line in text.splitlines() if not STAMP.match(line)]


def record(page: Page) -> str:
    """Run the page's command; returns what became of the page (``changed``, ``unchanged``,
    ``failed``, ``skipped``)."""
    before = page.path.read_text(encoding="utf-8")
    argv = shlex.split(page.command)
    print(f"== {page.name}: {page.command}", flush=True)
    done = subprocess.run(argv, cwd=ROOT, check=False, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(done.stdout)
    after = page.path.read_text(encoding="utf-8") if page.path.exists() else ""
    skipped = any(line.startswith("skipped:") for line in done.stdout.splitlines())
    if done.returncode != 0 or skipped or after == before:
        page.path.write_text(before, encoding="utf-8")  # what a failed or skipped run left
        return "skipped" if skipped else "failed" if done.returncode != 0 else "not rewritten"
    diff = sum(1 for line in difflib.unified_diff(_body(before), _body(after), lineterm="", n=0)
               if line[:1] in "+-" and line[:3] not in ("+++", "---"))  # fmt: skip
    return f"changed ({diff} lines)" if diff else "unchanged"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("names", nargs="*", help="only these pages (docs/results/NAME.md); default: all")
    ap.add_argument("--list", action="store_true", help="print each page's command and stamp, run nothing")
    args = ap.parse_args(argv)
    try:
        todo = pages()
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    unknown = set(args.names) - {p.name for p in todo}
    if unknown:
        ap.error(f"no page {', '.join(sorted(unknown))} (pages: {', '.join(p.name for p in todo)})")
    if args.names:
        todo = [p for p in todo if p.name in args.names]
    if args.list:
        for p in todo:
            print(f"{p.name}: {p.command}  (commit {p.commit}, {p.date})")
        return 0
    outcome = {p.name: record(p) for p in todo}
    print("\n== pages")
    for name, what in outcome.items():
        print(f"{name}: {what}")
    return 1 if any(w in ("failed", "not rewritten") for w in outcome.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
