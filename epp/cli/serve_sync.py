"""``epp serve``'s index sync between replicas: its flags and the ``SyncOptions`` they make
(docs/sync.md)."""

from __future__ import annotations

import argparse
import os

from epp.cli.flags import number, port, seconds
from epp.errors import ConfigError
from epp.sync.node import SyncOptions, SyncTls
from epp.sync.outbox import DEFAULT_CAPACITY_CHUNKS
from epp.sync.peers import parse_host_port, parse_peers


def add_sync_flags(serve: argparse.ArgumentParser) -> None:
    g = serve.add_argument_group(
        "index sync between replicas",
        "each replica streams the prefix-index writes it made and the prefill it has in "
        "flight per endpoint to its peers, and applies theirs (docs/sync.md); on when "
        "--peers or --peer-dns is given",
    )
    g.add_argument("--peers", default="",
                   help="static peers: comma-separated host:port of the other replicas' "
                   "sync ports (naming this replica too is harmless)")
    g.add_argument("--peer-dns", default="",
                   help="NAME:PORT of a headless Service over the epp pods, resolved every "
                   "--peer-dns-interval-s; every address but --pod-ip is a peer")
    g.add_argument("--pod-ip", default=os.environ.get("POD_IP", ""),
                   help="this pod's IP, skipped in --peer-dns answers (default: env POD_IP)")
    g.add_argument("--sync-port", type=port, default=9004,
                   help="port of the IndexSync gRPC server peers subscribe to (0 = any)")
    g.add_argument("--peer-dns-interval-s", type=seconds(), default=5.0,
                   help="seconds between lookups of --peer-dns")
    g.add_argument("--sync-flush-ms", type=seconds(), default=20.0,
                   help="a peer receives this replica's writes at least this often")
    g.add_argument("--sync-batch-records", type=number(1, strict=False, integer=True), default=256,
                   help="records per message; a full batch is sent without waiting")
    g.add_argument("--sync-cert", default="",
                   help="PEM certificate of this replica for mutual TLS on the sync port "
                   "(with --sync-key and --sync-ca). Sync with peers needs them, or "
                   "--sync-insecure")
    g.add_argument("--sync-key", default="", help="PEM private key for --sync-cert")
    g.add_argument("--sync-ca", default="",
                   help="PEM CA bundle: peers must present a certificate it signed")
    g.add_argument("--sync-insecure", action="store_true",
                   help="run index sync PLAINTEXT AND UNAUTHENTICATED: any process that "
                   "reaches the sync port can read the chunk hashes of every prompt routed "
                   "(and confirm a guessed prompt by its hash) and steer routing. Without "
                   "TLS flags, sync refuses to start unless this is given; with it, every "
                   "start logs a warning")
    g.add_argument("--sync-server-name", default="",
                   help="name the peers' certificate must carry (checked instead of the "
                   "dialled address, which is usually a pod IP)")
    g.add_argument("--sync-max-subscribers", type=number(1, strict=False, integer=True),
                   default=32, help="sync streams served at once; more are refused")
    g.add_argument("--sync-warm-timeout-s", type=seconds(strict=False), default=10.0,
                   help="at start, how long to spend fetching a peer's index before "
                   "reporting ready (0 = start cold)")
    g.add_argument("--sync-warm-max-entries", type=number(1, strict=False, integer=True),
                   default=4_000_000, help="most index entries fetched at start")
    g.add_argument("--no-sync-prefill", action="store_true",
                   help="share the index writes but not the prefill in flight (epp's "
                   "count per endpoint of prompt tokens sent and not prefilled; shared by "
                   "default)")
    g.add_argument("--sync-buffer-records", type=number(1, strict=False, integer=True), default=8192,
                   help="writes kept for slow peers; a peer further behind loses the oldest")
    g.add_argument("--sync-buffer-chunks", type=number(1, strict=False, integer=True),
                   default=DEFAULT_CAPACITY_CHUNKS,
                   help="chain hashes those writes may hold together (~40 bytes each); past "
                   "it the oldest writes go first. Nothing is held while no peer subscribes")


def sync_options(args: argparse.Namespace) -> SyncOptions | None:
    """Index sync from the flags; None when neither --peers nor --peer-dns is given."""
    if not args.peers and not args.peer_dns:
        return None
    if args.sync_buffer_records < args.sync_batch_records:
        raise ConfigError("--sync-buffer-records", "must be at least --sync-batch-records")
    return SyncOptions(
        port=args.sync_port,
        peers=parse_peers(args.peers),
        peer_dns=parse_host_port(args.peer_dns, "--peer-dns") if args.peer_dns else None,
        own_ips=frozenset(ip.strip() for ip in args.pod_ip.split(",") if ip.strip()),
        dns_interval_s=args.peer_dns_interval_s,
        flush_interval_s=args.sync_flush_ms / 1000.0,
        batch_records=args.sync_batch_records,
        buffer_records=args.sync_buffer_records,
        buffer_chunks=args.sync_buffer_chunks,
        tls=_sync_tls(args),
        max_subscribers=args.sync_max_subscribers,
        warm_timeout_s=args.sync_warm_timeout_s,
        share_prefill=not args.no_sync_prefill,
        warm_max_entries=args.sync_warm_max_entries,
    )


def _sync_tls(args: argparse.Namespace) -> SyncTls | None:
    files = (args.sync_cert, args.sync_key, args.sync_ca)
    if args.sync_insecure:
        if any(files):
            raise ConfigError("--sync-insecure", "given with --sync-cert/--sync-key/--sync-ca: "
                              "choose mutual TLS or plaintext, not both")
        return None
    if not any(files):
        raise ConfigError(
            "--sync-cert/--sync-key/--sync-ca",
            "index sync with peers needs mutual TLS (all three), or --sync-insecure to run it "
            "plaintext and unauthenticated: anyone who reaches the sync port could then read "
            "the chunk hashes of every prompt routed and steer routing (docs/sync.md)",
        )
    if not all(files):
        raise ConfigError("--sync-cert/--sync-key/--sync-ca", "mutual TLS needs all three")
    return SyncTls(args.sync_cert, args.sync_key, args.sync_ca, args.sync_server_name)
