"""Writes ``support-desk.jsonl``: an example request log in the replay's general format
(docs/replay.md, "Request logs"), the kind a user exports from a gateway's access log.

A support desk serving six products, each with a LoRA adapter of its own (``desk-0`` ...
``desk-5``) and a system prompt of its own; customers hold conversations of 2-6 turns (a
``session`` each, ``messages`` growing turn by turn), starting at ~2.5 a second for 30
seconds; one request in five asks the base model (no adapter) to summarise a ticket.

    python docs/examples/make_support_desk.py        # rewrites docs/examples/support-desk.jsonl
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = ["order", "parcel", "refund", "invoice", "delivery", "tracking", "warranty", "battery", "screen", "charger", "replacement", "address", "account", "password", "subscription", "plan", "upgrade", "cancel", "return", "label", "courier", "damaged", "missing", "late", "early", "weekend", "store", "pickup", "receipt", "serial", "number", "model", "firmware", "update", "reset", "settings", "bluetooth", "pairing", "speaker", "volume", "noise"]


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


def main() -> None:
    rng = random.Random(42)
    systems = [f"You are the support assistant for product line {k}. " + " ".join(
        sentence(rng, 12) for _ in range(8)) for k in range(6)]  # fmt: skip
    rows = []
    t = 0.0
    while t < 30.0:
        t += rng.expovariate(2.5)
        if rng.random() < 0.2:  # a one-off summary on the base model
            rows.append({"timestamp": round(t, 3), "model": "support-base", "output_length": 60,
                         "prompt": "Summarise this ticket: " + " ".join(sentence(rng, 14) for _ in range(10))})  # fmt: skip
            continue
        product = min(5, int(rng.paretovariate(1.2)) - 1)  # a few products are most of the traffic
        session = f"c{len(rows)}"
        msgs = [{"role": "system", "content": systems[product]}]
        at = t
        for _ in range(rng.randint(2, 6)):
            msgs.append({"role": "user", "content": " ".join(sentence(rng, 10) for _ in range(rng.randint(1, 3)))})
            rows.append({"timestamp": round(at, 3), "model": "support-base", "adapter": f"desk-{product}",
                         "session": session, "messages": list(msgs), "output_length": rng.randint(40, 160)})  # fmt: skip
            msgs.append({"role": "assistant", "content": " ".join(sentence(rng, 10) for _ in range(2))})
            at += rng.uniform(8.0, 30.0)  # the customer reads and types
    rows.sort(key=lambda r: r["timestamp"])
    out = Path(__file__).with_name("support-desk.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} requests to {out}")


if __name__ == "__main__":
    main()
