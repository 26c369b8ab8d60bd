"""``epp dry-run`` on a snapshot taken from a running epp (``GET /debug/endpoints``): the same
pick epp makes, each filter's survivors, each scorer's table and the reason; bad input names
what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from epp.cli import main
from epp.framework.endpoint import Metrics
from tests.integration import envoy_client as ec
from tests.integration.extproc_fixtures import pool, start_epp, stop_epp

BODY = {"model": "m", "messages": [{"role": "user", "content": "Which bread keeps longest? " * 30}]}


async def test_a_snapshot_of_a_running_epp_dry_runs_to_the_pick_it_makes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    epp = await start_epp(pool(3), metrics_port=0)
    try:
        ds = epp.handle.datastore
        for i, e in enumerate(ds.snapshot()):  # the third endpoint idle, the others queued
            ds.update_metrics(e.id, Metrics(waiting=0 if i == 2 else 6, running=2, kv_usage=0.3,
                                            scraped_at_s=ds.snapshot()[0].metrics.scraped_at_s or 1.0))  # fmt: skip
        async with aiohttp.ClientSession() as http, http.get(
            f"http://127.0.0.1:{epp.handle.metrics_port}/debug/endpoints"
        ) as r:  # fmt: skip
            snapshot = await r.json()
        s = ec.Stream(epp.channel)
        await s.send(ec.request_headers("/v1/chat/completions"), ec.request_body(json.dumps(BODY).encode(), True))
        served_pick = ec.destination((await s.recv_n(2))[0])
        s.call.cancel()
    finally:
        await stop_epp(epp)
    assert {e["id"] for e in snapshot["endpoints"]} == {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}
    (tmp_path / "pool.json").write_text(json.dumps(snapshot))
    (tmp_path / "body.json").write_text(json.dumps(BODY))
    assert main(["dry-run", "--snapshot", str(tmp_path / "pool.json"), "--body", str(tmp_path / "body.json")]) == 0
    out = capsys.readouterr().out
    pick = next(line for line in out.splitlines() if line.startswith("pick: "))
    assert pick == f"pick: {served_pick}" == "pick: 10.0.0.3:8000"
    table = [line.split() for line in out.splitlines() if line.strip().startswith("10.0.0.")]
    assert len(table) == 3 and table[0][0] == "10.0.0.3:8000" and table[0][-2:] == ["<-", "pick"]
    header = next(line for line in out.splitlines() if line.strip().startswith("endpoint"))
    assert "queue-scorer" in header and "prefix-cache-scorer" in header and "total" in header
    assert "reason: 10.0.0.3:8000 over " in out and "Which bread" not in out


def test_filters_show_their_survivors_and_an_empty_pool_says_what_epp_would_answer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    snapshot = {"endpoints": [
        {"id": "10.0.0.1:8000", "metrics": {"waiting": 40, "kv_usage": 0.99, "age_s": 0.1}},
        {"id": "10.0.0.2:8000", "metrics": {"waiting": 0, "kv_usage": 0.1, "age_s": 0.1}},
    ]}  # fmt: skip
    (tmp_path / "pool.json").write_text(json.dumps(snapshot))
    (tmp_path / "body.json").write_text(json.dumps(BODY))
    argv = ["dry-run", "--snapshot", str(tmp_path / "pool.json"), "--body", str(tmp_path / "body.json")]
    assert main([*argv, "--config", "filter-chain"]) == 0
    out = capsys.readouterr().out
    assert "filter load-threshold-filter: 1 left: 10.0.0.2:8000" in out
    snapshot["endpoints"][0]["metrics"]["age_s"] = 3600  # an hour old: left out
    (tmp_path / "pool.json").write_text(json.dumps(snapshot))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 endpoints, 1 routable" in out and "their metrics stale: 10.0.0.1:8000" in out
    (tmp_path / "pool.json").write_text(json.dumps({"endpoints": []}))
    assert main(argv) == 0
    assert "epp would answer Unavailable: no ready endpoint in the pool" in capsys.readouterr().out


@pytest.mark.parametrize(("snapshot", "named"), [
    ({"pods": []}, '{"endpoints": [...]}'),
    ({"endpoints": [{"id": "nowhere"}]}, "endpoints[0]: endpoint 'nowhere' is not of the form ip:port"),
    ({"endpoints": [{"id": "10.0.0.1:80", "metrics": {"kv_usage": 7, "age_s": 1}}]}, "endpoints[0]: metrics.kv_usage"),
    ({"endpoints": [{"id": "10.0.0.1:80", "in_flight": -1}]}, "endpoints[0]: in_flight must be a count"),
])  # fmt: skip
def test_a_bad_snapshot_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str], snapshot: object, named: str) -> None:
    (tmp_path / "pool.json").write_text(json.dumps(snapshot))
    (tmp_path / "body.json").write_text(json.dumps(BODY))
    assert main(["dry-run", "--snapshot", str(tmp_path / "pool.json"), "--body", str(tmp_path / "body.json")]) == 2
    assert named in capsys.readouterr().err


async def test_a_sleeping_endpoint_is_shown_and_left_out_as_live_epp_leaves_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """QA3 #5: the snapshot says which endpoint is asleep; dry-run never picks it, and with
    only sleeping endpoints answers 503 (or, with flow control, says the request would wait)."""
    epp = await start_epp(pool(2), metrics_port=0)
    try:
        ds = epp.handle.datastore
        for e in ds.snapshot():
            ds.update_metrics(e.id, Metrics(waiting=0 if e.id == "10.0.0.1:8000" else 6, scraped_at_s=1.0,
                                            not_serving="asleep" if e.id == "10.0.0.1:8000" else ""))  # fmt: skip
        async with aiohttp.ClientSession() as http, http.get(
            f"http://127.0.0.1:{epp.handle.metrics_port}/debug/endpoints"
        ) as r:  # fmt: skip
            snapshot = await r.json()
    finally:
        await stop_epp(epp)
    by_id = {e["id"]: e["metrics"]["not_serving"] for e in snapshot["endpoints"]}
    assert by_id == {"10.0.0.1:8000": "asleep", "10.0.0.2:8000": ""}
    (tmp_path / "pool.json").write_text(json.dumps(snapshot))
    (tmp_path / "body.json").write_text(json.dumps(BODY))
    argv = ["dry-run", "--snapshot", str(tmp_path / "pool.json"), "--body", str(tmp_path / "body.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 endpoints, 1 routable" in out and "not serving (no candidates): 10.0.0.1:8000 (asleep)" in out
    assert "pick: 10.0.0.2:8000" in out  # the idle one is asleep: the queued one is picked
    only = {"endpoints": [e for e in snapshot["endpoints"] if e["id"] == "10.0.0.1:8000"]}
    (tmp_path / "pool.json").write_text(json.dumps(only))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "pick:" not in out and "epp would answer Unavailable: no ready endpoint in the pool" in out
    (tmp_path / "flow.yaml").write_text("flowControl: {enabled: true, scaleFromZeroSeconds: 45}\n")
    assert main([*argv, "--config", str(tmp_path / "flow.yaml")]) == 0
    out = capsys.readouterr().out
    assert "pick:" not in out and "epp would queue the request" in out and "up to 45 s" in out


@pytest.mark.parametrize(("text", "named"), [
    ("", "not JSON: Expecting value"),
    ("[1]", '{"endpoints": [...]}'),
])  # fmt: skip
def test_a_snapshot_that_is_not_one_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, named: str) -> None:
    (tmp_path / "bad.json").write_text(text)
    (tmp_path / "body.json").write_text(json.dumps(BODY))
    assert main(["dry-run", "--snapshot", str(tmp_path / "bad.json"), "--body", str(tmp_path / "body.json")]) == 2
    err = capsys.readouterr().err
    assert f"--snapshot {tmp_path / 'bad.json'}: " in err and named in err
