"""`epp serve` index-sync flags (docs/sync.md)."""

from __future__ import annotations

import pytest

from epp.cli import build_parser, sync_options
from epp.errors import ConfigError
from epp.sync.peers import HostPort


def test_sync_is_off_without_peers() -> None:
    args = build_parser().parse_args(["serve", "--endpoints", "10.0.0.1:8000"])
    assert args.sync_port == 9004 and sync_options(args) is None


def test_sync_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_IP", "10.1.0.6")
    args = build_parser().parse_args([
        "serve", "--endpoints", "10.0.0.1:8000", "--peer-dns", "epp-peers.models.svc:9004",
        "--sync-flush-ms", "50", "--sync-batch-records", "128", "--sync-port", "9104",
        "--sync-insecure",
    ])
    opts = sync_options(args)
    assert opts is not None
    assert opts.peer_dns == HostPort("epp-peers.models.svc", 9004) and opts.peers == []
    assert opts.own_ips == frozenset({"10.1.0.6"})
    assert (opts.port, opts.flush_interval_s, opts.batch_records) == (9104, 0.05, 128)


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--peers", "epp-0"], "--peers"),
        (["--peer-dns", "epp-peers"], "--peer-dns"),
        (["--peers", "a:1", "--sync-buffer-records", "10"], "--sync-buffer-records"),
        (["--peers", "a:1"], "--sync-insecure"),  # plaintext is never the silent default
        (["--peer-dns", "epp-peers:9004"], "--sync-insecure"),
        (["--peers", "a:1", "--sync-cert", "c.pem"], "all three"),
        (["--peers", "a:1", "--sync-insecure", "--sync-ca", "ca.pem"], "not both"),
    ],
)
def test_bad_sync_flags_name_the_flag(flags: list[str], field: str) -> None:
    args = build_parser().parse_args(["serve", "--endpoints", "10.0.0.1:8000", *flags])
    with pytest.raises(ConfigError, match=field):
        sync_options(args)
