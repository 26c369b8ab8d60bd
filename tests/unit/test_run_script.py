"""``./run``'s first-run install, as a new user sees it: it says how long it takes and shows
pip's progress (a line per package) instead of minutes of silence; a failed install prints
pip's log. A stand-in ``python`` in a fresh ``EPP_VENV`` plays pip, so no package is
installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/bin/sh
if [ "$1 $2" = "-m pip" ]; then
    case "$*" in *--upgrade*|*--force-reinstall*) echo "Requirement already satisfied: pip"; exit 0 ;; esac
    echo "Obtaining file://$PWD"
    echo "Collecting xxhash>=3.4 (from epp==0.1.0)"
    echo "  Downloading xxhash-4.1.0-cp311-manylinux.whl (194 kB)"
    echo "Collecting PyYAML>=6.0 (from epp==0.1.0)"
    echo "Building wheel for epp (pyproject.toml): finished"
    echo "Installing collected packages: xxhash, PyYAML, epp"
    [ -n "$FAIL_INSTALL" ] && { echo "ERROR: no matching distribution for grpcio"; exit 1; }
    echo "Successfully installed PyYAML-6.0.4 epp-0.1.0 xxhash-4.1.0"
    exit 0
fi
exec {python} "$@"
"""


def _run(tmp_path: Path, fail: bool = False) -> subprocess.CompletedProcess[str]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    fake = venv / "bin" / "python"
    fake.write_text(FAKE_PYTHON.replace("{python}", sys.executable))
    fake.chmod(0o755)
    env = {**os.environ, "EPP_VENV": str(venv)}
    if fail:
        env["FAIL_INSTALL"] = "1"
    return subprocess.run([str(ROOT / "run"), "python", "-c", "print('ran')"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip


def test_the_first_install_says_how_long_and_shows_progress(tmp_path: Path) -> None:
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ran"
    err = done.stderr.splitlines()
    assert "first run only: 1-3 min" in err[0] and "install.log" in err[0]
    progress = [line for line in err[1:] if line.startswith("  [")]
    assert [line.split("] ", 1)[1] for line in progress] == [
        "Collecting xxhash>=3.4 (from epp==0.1.0)",
        "Collecting PyYAML>=6.0 (from epp==0.1.0)",
        "Building wheel for epp (pyproject.toml): finished",
        "Installing collected packages: xxhash, PyYAML, epp",
        "Successfully installed PyYAML-6.0.4 epp-0.1.0 xxhash-4.1.0",
    ]
    assert "2 packages" in progress[-1]
    assert "Downloading" in (tmp_path / "venv" / "install.log").read_text()  # the whole log is kept
    again = _run(tmp_path)  # installed: nothing more is said
    assert again.returncode == 0 and again.stderr == ""


def test_a_failed_install_prints_pips_log_and_fails(tmp_path: Path) -> None:
    done = _run(tmp_path, fail=True)
    assert done.returncode == 1
    assert "ERROR: no matching distribution for grpcio" in done.stderr
    assert "install failed" in done.stderr
    assert not list((tmp_path / "venv").glob(".installed-*"))
