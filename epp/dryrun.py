"""``epp dry-run``: what epp would do with one request, offline, and why.

    curl -s http://EPP:9090/debug/endpoints > pool.json         # the pool as epp saw it
    epp dry-run --config default --snapshot pool.json --body request.json

It builds the config's scheduler (the same plugins ``epp serve`` builds), loads the snapshot's
endpoints with their metrics and requests in flight, parses the body as ``epp serve`` parses
it (``--path`` names the API), and routes it through the same Director, recording each
profile run. It prints each filter's survivors, each scorer's table (scores before their
weights, the weighted total, the pick and the fallbacks) and the one-line reason
(``x-epp-pick-reason``), or the error epp would answer. The prefix index starts empty:
``--warm FILE`` routes the bodies of a JSONL file first (their picks recorded, as in
``epp serve``), so a conversation's earlier turns count. Nothing is sent anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from typing import Any

from prometheus_client import CollectorRegistry

MAX_INPUT_BYTES = 64 << 20
"""Largest snapshot, body or warm-up file read."""


def register(sub: Any, formatter: type[argparse.HelpFormatter]) -> None:
    p = sub.add_parser(
        "dry-run",
        help="show what epp would pick for a request, with every filter's and scorer's view",
        description="Route one request body offline, as epp serve would, from a config and a "
        "snapshot of the pool (GET /debug/endpoints on epp's metrics port); print each "
        "filter's survivors, each scorer's table and the pick's reason. Sends nothing. See "
        "docs/observability.md.",
        formatter_class=formatter,
    )  # fmt: skip
    p.add_argument("--config", default="default",
                   help="YAML config file or shipped profile name (as epp serve --config)")
    p.add_argument("--snapshot", required=True, metavar="FILE",
                   help="the pool: JSON as GET /debug/endpoints serves it")
    p.add_argument("--body", required=True, metavar="FILE", help="the request body (JSON); - reads stdin")
    p.add_argument("--path", default="/v1/chat/completions", help="the request's API path")
    p.add_argument("--header", action="append", default=[], metavar="NAME:VALUE",
                   help="a request header (repeatable), e.g. x-session-id:abc")
    p.add_argument("--warm", default="", metavar="FILE",
                   help="JSONL of earlier request bodies routed first, in order (the prefix "
                   "index learns their picks)")
    p.add_argument("--seed", type=int, default=0, help="seed of the pickers' random choices")
    p.set_defaults(run=run)


def _read(path: str) -> bytes:
    if path == "-":
        data = sys.stdin.buffer.read(MAX_INPUT_BYTES + 1)
    else:
        with open(path, "rb") as f:
            data = f.read(MAX_INPUT_BYTES + 1)
    if len(data) > MAX_INPUT_BYTES:
        raise ValueError(f"{path}: larger than {MAX_INPUT_BYTES} bytes")
    return data


def _headers(items: list[str], path: str) -> dict[str, str]:
    headers = {":path": path, ":method": "POST", "content-type": "application/json",
               "x-request-id": "dry-run"}  # fmt: skip
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--header {item!r}: expected NAME:VALUE")
        headers[name.strip().lower()] = value.strip()
    return headers


def run(args: argparse.Namespace) -> int:
    """Print the dry run (module docstring); 0, or 2 with the reason on a bad input."""
    from epp.errors import ConfigError, EppError
    from epp.framework.types import ProfileRun
    from epp.observability.metrics import EppMetrics
    from epp.request.parse import RequestParser
    from epp.requestcontrol.director import Director
    from epp.requestcontrol.explain import pick_reason, run_tables
    from epp.wiring import build_scheduler

    try:
        cfg, body, headers, warm, ds = _inputs(args)
    except (OSError, ValueError, ConfigError) as exc:
        print(f"epp dry-run: {exc}", file=sys.stderr)
        return 2
    scheduler = build_scheduler(cfg, random.Random(args.seed))
    for e in ds.snapshot():
        scheduler.observe_endpoint(e)
    director = Director(ds, scheduler, cfg.saturation, EppMetrics(CollectorRegistry()),
                        fallbacks=cfg.request_control.fallbacks)  # fmt: skip
    parser = RequestParser(cfg.request_control, trust_control_headers=True)
    for n, line in enumerate(warm, 1):  # earlier turns: routed and recorded, then finished
        if line.strip():
            try:
                routing = director.route(parser.parse(args.path, headers, line).request, None)
            except EppError as exc:
                print(f"epp dry-run: --warm line {n}: epp would answer {exc}", file=sys.stderr)
                continue
            director.abandon(routing, "200")
    try:
        parsed = parser.parse(args.path, headers, body)
    except EppError as exc:
        print(f"epp would answer {type(exc).__name__}: {exc.message}")
        return 0
    r = parsed.request
    if director.prepares:
        scheduler.prepare_request(r)
    print(f"request: {args.path} model={r.model} api={r.api.value} stream={r.stream} "
          f"priority={r.priority} prompt={len(r.prompt)} chars; {len(ds.snapshot())} endpoints, "
          f"{len(ds.routable())} routable (config {cfg.source})")  # fmt: skip
    left = [e.id for e in ds.snapshot() if e.stale]
    asleep = [f"{e.id} ({e.metrics.not_serving})" for e in ds.snapshot() if e.metrics.not_serving]
    if asleep:
        print(f"not serving (no candidates): {', '.join(asleep)}")
    print(f"their metrics stale: {', '.join(left)}\n" if left else "")
    if director.no_ready_endpoint() and _queued_for_first_endpoint(cfg.flow_control, r):
        return 0
    runs: list[ProfileRun] = []
    try:
        routing = director.route(r, None, len(body), record=True)
    except EppError as exc:
        # the runs of a cycle that found no endpoint are still shown: which filter left none
        _failed_runs(scheduler, r, ds, runs)
        print(run_tables(runs) if runs else "", end="")
        print(f"epp would answer {type(exc).__name__}: {exc.message}")
        return 0
    runs = routing.result.state.runs or []
    print(run_tables(runs))
    prefiller = routing.result.prefiller
    print(f"pick: {routing.destination}" + (f"; prefill on {prefiller.id}" if prefiller else "")
          + (f" ({routing.result.decision})" if routing.result.decision else ""))  # fmt: skip
    print(f"reason: {pick_reason(runs, routing.target_id, prefiller.id if prefiller else '')}")
    return 0


def _inputs(args: argparse.Namespace) -> tuple[Any, bytes, dict[str, str], list[bytes], Any]:
    """The config, body, headers, warm-up lines and the datastore loaded from the snapshot;
    raises OSError, ValueError or ConfigError naming the input at fault."""
    from epp.config.loader import default_config, load_config
    from epp.datastore.snapshot import load_snapshot
    from epp.datastore.store import Datastore

    cfg = load_config(args.config) if args.config else default_config()
    body = _read(args.body)
    headers = _headers(args.header, args.path)
    warm = _read(args.warm).splitlines() if args.warm else []
    ds = Datastore(stale_after_s=cfg.saturation.metrics_staleness_seconds)
    snapshot = _read(args.snapshot)  # its errors name the file
    try:
        load_snapshot(json.loads(snapshot), ds, time.monotonic())
    except ValueError as exc:  # not JSON (JSONDecodeError), not UTF-8, not a snapshot
        what = "not JSON: " if isinstance(exc, json.JSONDecodeError) else ""
        raise ValueError(f"--snapshot {args.snapshot}: {what}{exc}") from None
    return cfg, body, headers, warm, ds


def _queued_for_first_endpoint(flow: Any, request: Any) -> bool:
    """With no endpoint that can serve: epp serve's flow control (when on) holds the request
    for the first one; say so and for how long (True), else False (it answers 503 at once)."""
    if not flow.enabled or flow.cold_seconds <= 0:
        return False
    limit = max(flow.queue_seconds(request), flow.cold_seconds)
    print(f"epp would queue the request: no endpoint can serve now; flow control holds it up to "
          f"{limit:g} s for one, then answers Unavailable (503 queue-timeout): flow control: "
          f"waited {limit:g} s and no endpoint became ready")  # fmt: skip
    return True


def _failed_runs(scheduler: Any, request: Any, ds: Any, runs: list[Any]) -> None:
    """Run the cycle again to keep its profile runs (the Director's raised with them)."""
    from epp.errors import EppError

    with contextlib.suppress(EppError):
        scheduler.schedule(request, ds.serving(), time.monotonic(), commit=False, runs=runs)
