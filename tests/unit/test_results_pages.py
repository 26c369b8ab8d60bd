"""docs/results/ holds one current page per benchmark the docs quote, each stamped with the
command, commit and date that made it, and ``./run bench --record-all`` regenerates them by
those commands (scripts/record_results.py). Links in the docs resolve."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"


def recorder() -> ModuleType:
    spec = importlib.util.spec_from_file_location("record_results", ROOT / "scripts" / "record_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def guides() -> list[Path]:
    """README and the guides: the pages whose figures must come from docs/results."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def linked_pages(path: Path) -> set[str]:
    """docs/results pages (by stem) a markdown file links to."""
    found = set()
    for target in re.findall(r"\]\(([^)#\s]+)", path.read_text(encoding="utf-8")):
        full = (path.parent / target).resolve()
        if full.parent == RESULTS and full.suffix == ".md":
            found.add(full.stem)
    return found


def test_every_page_has_the_command_commit_and_date_that_made_it() -> None:
    pages = recorder().pages()  # raises naming a page without its stamp
    assert pages
    for page in pages:
        assert page.command.startswith("./run python bench/"), page.name


def bench_rows() -> list[str]:
    """The NAMEs docs/benchmarks.md's table gives (``./run bench NAME``), in its order."""
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    return re.findall(r"^\| `([a-z_]+)` \|", text, flags=re.M)


def test_benchmarks_md_names_every_bench_once_by_the_name_run_takes() -> None:
    scripts = sorted(p.stem.removeprefix("bench_") for p in (ROOT / "bench").glob("bench_*.py"))
    assert sorted(bench_rows()) == scripts


def test_no_more_entries_than_benchmarks_plus_the_index() -> None:
    entries = sorted(p.name for p in RESULTS.iterdir())
    assert len(entries) <= len(bench_rows()) + 1, entries


def test_every_page_is_indexed_and_quoted_by_readme_or_a_guide() -> None:
    pages = {p.name for p in recorder().pages()}
    assert linked_pages(RESULTS / "README.md") == pages
    quoted = set().union(*(linked_pages(g) for g in guides()))
    assert pages - quoted == set(), "a page no guide quotes is a variant: delete it"


FIGURE = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:x\b|%)")
"""A measured-looking figure: a ratio (``1.44x``) or a percentage (``92.9%``)."""
SOURCE = re.compile(r"\]\((?:\.\./)*(?:docs/)?(?:results|research)/|`tests/\w+/test_\w+\.py`")
"""Where a figure comes from: a results page, a research note, or the test that asserts it."""
THRESHOLDS = {
    ("observability.md", "#### EppShedding"): "the alert's threshold, not a measurement",
    ("observability.md", "#### EppTraceExportFailing"): "the alert's threshold, not a measurement",
}


def test_every_figure_in_readme_and_the_guides_links_the_page_that_made_it() -> None:
    """A section of README or a guide that states a ratio or a percentage links a results
    page or a research note, or names the test that asserts it (the figure's source), unless
    its figures are settings."""
    unsourced = []
    for path in guides():
        text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
        for section in re.split(r"\n(?=#{1,4} )", text):
            heading = section.splitlines()[0] if section.strip() else ""
            if (path.name, heading) in THRESHOLDS:
                continue
            if FIGURE.search(section) and not SOURCE.search(section):
                unsourced.append(f"{path.relative_to(ROOT)} {heading!r}: {FIGURE.findall(section)[:4]}")
    assert unsourced == []


def test_relative_links_in_the_docs_resolve() -> None:
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md"),
             *(ROOT / "epp").rglob("*.md")]  # fmt: skip
    broken = []
    for path in files:
        for target in re.findall(r"\]\(([^)#\s]+)", path.read_text(encoding="utf-8")):
            if not target.startswith(("http://", "https://", "mailto:")) and not (path.parent / target).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert broken == []


PAGE = """# a page

Made by `{command}` at commit abc1234 on 2026-01-01 00:00 UTC, on 2 cores. Run the command again.

{body}
"""


@pytest.mark.parametrize(("script", "outcome", "kept"), [
    ("write('figure 1')", "unchanged", False),
    ("write('figure 2')", "changed (2 lines)", False),
    ("print('skipped: no vLLM here'); write('skipped')", "skipped", True),
    ("import sys; sys.exit(3)", "failed", True),
    ("pass", "not rewritten", True),
])  # fmt: skip
def test_record_all_says_which_pages_changed_and_keeps_a_page_a_run_did_not_make(
    tmp_path: Path, script: str, outcome: str, kept: bool
) -> None:
    mod = recorder()
    path = tmp_path / "probe.md"
    bench = tmp_path / "bench.py"
    command = shlex.join([sys.executable, str(bench)])
    bench.write_text(f"import sys\ndef write(body):\n    open({str(path)!r}, 'w').write("
                     f"{PAGE!r}.format(command={command!r}, body=body).replace('2026-01-01', '2026-02-02'))\n"
                     f"{script}\n")  # fmt: skip
    before = PAGE.format(command=command, body="figure 1")
    path.write_text(before)
    page = mod.Page("probe", path, command, "abc1234", "2026-01-01 00:00 UTC")
    assert mod.record(page) == outcome
    assert (path.read_text() == before) is kept


def test_every_bench_answers_help() -> None:
    """Each bench imports and builds its parser: ``./run bench NAME --help`` exits 0 and says
    what the bench takes (the benches run for minutes; their start is what a refactor breaks)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    scripts = sorted((ROOT / "bench").glob("bench_*.py"))
    procs = {script.stem: subprocess.Popen([sys.executable, str(script), "--help"], cwd=ROOT, env=env,
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for script in scripts}  # fmt: skip
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{name} --help: {out[-2000:]}"
        assert "usage:" in out, name
