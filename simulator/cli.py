"""``epp-sim``: the simulator's command line. One subcommand per tool.

Each subcommand lives next to the code it runs and exposes ``register(subparsers)``, which
adds its parser and sets ``run=<function(args) -> exit code>``. Add a new one to
:data:`SUBCOMMANDS` (``gateway``, ``stack`` and ``replay`` go here).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

from epp.clihelp import no_abbreviations


def _require_extras() -> None:
    """epp-sim's dependencies are the ``sim`` extra: say so instead of an ImportError."""
    import importlib.util

    missing = [m for m in ("rich", "matplotlib") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"epp-sim needs {', '.join(missing)}: pip install 'epp[sim]'")


def _emulate(subparsers: Any) -> None:
    from simulator.emulator.cli import register

    register(subparsers)


def _gateway(subparsers: Any) -> None:
    from simulator.gateway.cli import register

    register(subparsers)


def _stack(subparsers: Any) -> None:
    from simulator.stack.cli import register

    register(subparsers)


def _replay(subparsers: Any) -> None:
    from simulator.replay import register

    register(subparsers)


def _trace(subparsers: Any) -> None:
    from simulator.replay.tracecli import register

    register(subparsers)


def _calibrate(subparsers: Any) -> None:
    from simulator.calibrate import register

    register(subparsers)


def _otlp(subparsers: Any) -> None:
    from simulator.otlp import register

    register(subparsers)


def _load(subparsers: Any) -> None:
    from simulator.load import register

    register(subparsers)


SUBCOMMANDS: dict[str, Callable[[Any], None]] = {
    "emulate": _emulate,
    "gateway": _gateway,
    "stack": _stack,
    "replay": _replay,
    "trace": _trace,
    "calibrate": _calibrate,
    "load": _load,
    "otlp": _otlp,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epp-sim", description="Emulated model servers, dev gateway and trace replay for epp."
    )
    from epp import package_version

    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument(
        "--log-level", type=str.lower, choices=["debug", "info", "warning", "error"],
        default="warning", help="log level of epp-sim itself (default: warning)",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS.values():
        add(subparsers)
    no_abbreviations(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    _require_extras()
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    """The command line, for tools that record what they ran (``replay --out-dir``)."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
