"""What a client sees when epp dies, restarts, or one of two replicas dies, through real
Envoy with ``epp envoy-config``'s bootstrap, fail-open and fail-closed.

Closed-loop load on emulated servers while the only epp is killed (SIGKILL) for
``--outage-s`` seconds and restarted, fail-open and fail-closed: the requests sent meanwhile
that got a 200, and how soon epp routed again; then one of two epp replicas killed. Writes
docs/results/failover.md; the assertions are in tests/envoy/test_failover.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import table, write_result  # noqa: E402


@contextlib.asynccontextmanager
async def loaded(workers: int, **pool_options: Any) -> AsyncIterator[tuple[Any, Any]]:
    """tests/envoy's pool (emulated servers, epp, real Envoy) under closed-loop load: yields
    (the pool, the load), and stops the load at the end."""
    import aiohttp

    from tests.envoy.conftest import Load, pool

    with tempfile.TemporaryDirectory() as tmp:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http, \
                pool(Path(tmp), **pool_options) as p:  # fmt: skip
            stop = asyncio.Event()
            load = Load(p.url, http, workers=workers)
            task = asyncio.create_task(load.run_until(stop))
            try:
                yield p, load
            finally:
                stop.set()
                await task


async def outage(failure: str, outage_s: float, workers: int) -> dict[str, Any]:
    extra = {} if failure == "open" else {"request_body": "full-duplex", "failure": "closed"}
    async with loaded(workers, **extra) as (p, load):
        epp = p.epps[0]
        await asyncio.sleep(1.0)
        killed_at = time.monotonic()
        epp.kill()
        await epp.proc.wait()
        await asyncio.sleep(outage_s)
        back_at = time.monotonic()
        await epp.start()
        before = await epp.routed()
        while await epp.routed() <= before and time.monotonic() - back_at < 30:
            await asyncio.sleep(0.02)  # poll
        resumed_s = time.monotonic() - back_at
        await asyncio.sleep(0.5)
    during = [o for o in load.outcomes if killed_at <= o.started_s < back_at]
    return {"failure": failure, "during": len(during), "ok_during": sum(o.status == 200 for o in during),
            "servers_during": len({o.upstream for o in during if o.upstream}),
            "resumed_s": resumed_s, "failed_total": sum(o.status != 200 for o in load.outcomes),
            "requests": len(load.outcomes)}  # fmt: skip


async def replica_killed(workers: int, after_s: float) -> dict[str, Any]:
    async with loaded(workers, epps=2) as (p, load):
        await asyncio.sleep(1.5)
        in_flight = load.in_flight
        killed_at = time.monotonic()
        p.epps[0].kill()
        await asyncio.sleep(after_s)
        survivor = await p.epps[1].routed()
    after = [o for o in load.outcomes if o.started_s > killed_at]
    return {"in_flight_at_kill": in_flight, "after": len(after), "failed_after": sum(o.status != 200 for o in after),
            "failed_total": sum(o.status != 200 for o in load.outcomes), "requests": len(load.outcomes),
            "survivor_routed": survivor}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--outage-s", type=float, default=3.0, help="seconds epp stays down")
    p.add_argument("--workers", type=int, default=6, help="closed-loop clients")
    args = p.parse_args()
    runs = [asyncio.run(outage(f, args.outage_s, args.workers)) for f in ("open", "closed")]
    killed = asyncio.run(replica_killed(args.workers + 2, args.outage_s))
    md = table(["epp killed for the outage, then restarted", "requests sent during the outage", "got a 200",
                "servers that answered them", "routed by epp again after the restart", "failed in all"],
               [[f"fail-{r['failure']}", r["during"], f"{r['ok_during']} ({100 * r['ok_during'] / max(1, r['during']):.1f}%)",
                 r["servers_during"], f"{r['resumed_s']:.2f} s", f"{r['failed_total']} of {r['requests']}"] for r in runs])  # fmt: skip
    md += "\n\n" + table(["one of two epp replicas killed", "in flight at the kill", "requests started after",
                           "of them failed", "failed in all"],
                          [["fail-open", killed["in_flight_at_kill"], killed["after"], killed["failed_after"],
                            f"{killed['failed_total']} of {killed['requests']}"]])  # fmt: skip
    print(md)
    md += (f"\n\nReal Envoy (one worker) with `epp envoy-config`'s bootstrap, `epp serve` processes, 3 emulated "
           f"servers; {args.workers} closed-loop clients ({args.workers + 2} for the replica kill), chat requests of "
           f"~600 characters; outage {args.outage_s:g} s. 'Routed by epp again': from epp's restart until its first "
           "routed request (its own start-up included). 'Failed in all' counts requests in flight through epp when "
           "it was killed.")  # fmt: skip
    path = write_result("failover", "epp down, epp back, one of two replicas killed: through real Envoy", md,
                        {"fail_open": runs[0], "fail_closed": runs[1], "replica_killed": killed})  # fmt: skip
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
