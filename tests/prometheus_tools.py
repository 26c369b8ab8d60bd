"""Debian's ``prometheus`` package's binaries for the tests that run them (``.ci/run``
installs it): a missing one fails the test in CI and skips it on a developer's machine."""

from __future__ import annotations

import os
import shutil

import pytest


def prometheus_tool(name: str) -> str:
    """The path of ``prometheus`` or ``promtool``."""
    found = shutil.which(name)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} missing in CI (.ci/run installs Debian's prometheus package)")
        pytest.skip(f"{name} not installed (apt-get install --no-install-recommends prometheus)")
    return found
