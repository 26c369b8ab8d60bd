"""README's install section says where ``epp serve`` and the printed Envoy listen by default,
with the defaults the parsers really have (a changed default fails here until README says so)."""

from __future__ import annotations

import re
from pathlib import Path

from epp.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"^## {title}\n(.*?)(?=^## )", text, re.S | re.M)
    assert match is not None, f"README has no '## {title}' section"
    return match.group(1)


def test_the_install_section_names_the_default_addresses() -> None:
    install = _section("Install")
    serve = build_parser().parse_args(["serve", "--endpoints", "10.0.0.1:8000"])
    assert f"`{serve.host}`" in install and "--host 127.0.0.1" in install
    for port in (serve.grpc_port, serve.health_port, serve.metrics_port, serve.sync_port):
        assert re.search(rf"\b{port}\b", install), f"README's install section omits port {port}"
    envoy = build_parser().parse_args(["envoy-config"])
    assert f"`{envoy.host}:{envoy.port}`" in install
    assert f"`127.0.0.1:{envoy.admin_port}`" in install
