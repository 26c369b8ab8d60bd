"""Why epp moved prompts off the server holding them, from its debug log: for every pick
that left an endpoint holding over half the prompt's chunks (``prefix-cache-scorer`` above
0.5) for one that did not, each scorer's score for the chosen endpoint minus the holder's
(before weights), averaged per policy; and where the log has them, the cost model's inputs
for both (``predicted-ttft-scorer``: uncached tokens ``u``, prefill queued ahead ``q``,
running ``r``, KV use, KV overflow, predicted TTFT and cost in seconds). The logs come from a
stack run with ``EPP_SIM_LOG_LEVEL=DEBUG`` (epp logs each pick's scores at ``--log-level
debug``); the policy of each log is found from the request ids in the run's
``requests.jsonl``.

    python bench/report_pick_scores.py DIR/requests.jsonl EPP_LOG [EPP_LOG ...]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

PICK = re.compile(r"profile \S+ request (\S+) -> (\S+): (.*)$")
FEATURES = re.compile(r"predicted-ttft request (\S+): (.*)$")


def _per_candidate(text: str) -> dict[str, dict[str, float]]:
    """``EID k=v k=v; EID k=v ...`` -> per endpoint its values."""
    out: dict[str, dict[str, float]] = {}
    for part in text.split("; "):
        eid, *values = part.split()
        out[eid] = {k: float(v) for k, v in (s.split("=", 1) for s in values)}
    return out


def picks(log: Path) -> list[tuple[str, str, dict[str, dict[str, float]]]]:
    """(request id, chosen endpoint, per candidate its scores) for each pick logged."""
    return [(m.group(1), m.group(2).split(",")[0], _per_candidate(m.group(3).split(" (+")[0]))
            for line in log.read_text(errors="replace").splitlines()
            if (m := PICK.search(line))]  # fmt: skip


def features(log: Path) -> dict[str, dict[str, dict[str, float]]]:
    """Per request id, per candidate, the cost model's inputs and outputs logged."""
    return {m.group(1): _per_candidate(m.group(2))
            for line in log.read_text(errors="replace").splitlines()
            if (m := FEATURES.search(line))}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("requests", type=Path, help="the run's requests.jsonl")
    ap.add_argument("logs", nargs="+", type=Path, help="epp.log files of its runs")
    args = ap.parse_args()
    policy = {}
    for line in args.requests.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            policy[r["request_id"]] = r["policy"]
    moves: dict[str, list[dict[str, float]]] = defaultdict(list)
    inputs: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = defaultdict(list)
    for log in args.logs:
        rows = picks(log)
        name = next((policy[rid] for rid, _, _ in rows if rid in policy), None)
        if name is None:
            continue
        feats = features(log)
        for rid, chosen, cands in rows:
            holders = [e for e, s in cands.items() if s.get("prefix-cache-scorer", 0) > 0.5]
            if holders and chosen not in holders and chosen in cands:
                held, went = cands[holders[0]], cands[chosen]
                moves[name].append({k: went[k] - held[k] for k in held if k in went})
                f = feats.get(rid, {})
                if holders[0] in f and chosen in f:
                    inputs[name].append((f[holders[0]], f[chosen]))
    for name, diffs in moves.items():
        print(f"{name}: {len(diffs)} picks left an endpoint holding over half the prompt")
        for key in diffs[0]:
            d = [x[key] for x in diffs if key in x]
            print(f"  {key:32} chosen - holder: mean {statistics.fmean(d):+.2f}, "
                  f"min {min(d):+.2f}, max {max(d):+.2f}")
        pairs = inputs.get(name)
        if pairs:
            print(f"  the cost model's inputs, mean over {len(pairs)} of them (holder -> chosen):")
            print("    " + ", ".join(
                f"{k} {statistics.fmean(h[k] for h, _ in pairs):.3g} -> "
                f"{statistics.fmean(c[k] for _, c in pairs):.3g}" for k in pairs[0][0]))


if __name__ == "__main__":
    main()
