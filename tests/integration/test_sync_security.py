"""Sync hardening: a restarted replica fetches a peer's index before it reports ready; mutual
TLS admits only peers with a certificate from the configured CA; subscribers are capped."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from epp.framework.endpoint import EndpointId
from epp.sync.gen import sync_pb2, sync_pb2_grpc
from epp.sync.node import SyncTls
from epp.sync.peers import HostPort
from tests.integration.extproc_fixtures import Epp, pool, start_epp, stop_epp
from tests.integration.test_serve_process import log_until_serving
from tests.integration.test_sync import connect, connected, route, sync_of, sync_options, until

PROMPTS = [f"Tenant {i}: you are an assistant for the billing team. " * 20 for i in range(12)]


async def test_a_restarted_replica_starts_warm_from_its_peer() -> None:
    a = await start_epp(pool(4), sync=sync_options())
    b: Epp | None = None
    try:
        for p in PROMPTS:
            await route(a, p)
        index_a = a.handle.index
        await until(lambda: len(index_a) > 0, "a's index filled")
        peer = HostPort("127.0.0.1", a.handle.sync_port)
        b = await start_epp(pool(4), sync=dataclasses.replace(sync_options(), peers=[peer]))
        warm = b.handle.warm
        assert warm is not None and warm.complete and warm.entries == len(index_a)
        index_b = b.handle.index
        for eid in index_a.endpoint_ids():
            assert list(index_b.chunks_of(eid)) == list(index_a.chunks_of(eid))  # LRU order too
        # and it routes each prompt where a would: the lookups find the restored chains
        for p in PROMPTS:
            assert await route(b, p) == await route(a, p)
    finally:
        await stop_epp(a)
        if b is not None:
            await stop_epp(b)


async def test_warm_start_is_bounded_in_size() -> None:
    a = await start_epp(pool(4), sync=sync_options())
    try:
        for p in PROMPTS:
            await route(a, p)
        peer = HostPort("127.0.0.1", a.handle.sync_port)
        opts = dataclasses.replace(sync_options(), peers=[peer], warm_max_entries=10)
        b = await start_epp(pool(4), sync=opts)
        try:
            warm = b.handle.warm
            assert warm is not None and not warm.complete and 10 <= warm.entries < len(a.handle.index)
        finally:
            await stop_epp(b)
    finally:
        await stop_epp(a)


async def test_subscribers_are_capped() -> None:
    a = await start_epp(pool(4), sync=dataclasses.replace(sync_options(), max_subscribers=1))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{a.handle.sync_port}") as ch:
            stub = sync_pb2_grpc.IndexSyncStub(ch)
            first = stub.Subscribe(sync_pb2.SubscribeRequest(replica_id="x1"))
            await first.read()  # the "connected" batch: the stream is open
            second = stub.Subscribe(sync_pb2.SubscribeRequest(replica_id="x2"))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await second.read()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            first.cancel()
    finally:
        await stop_epp(a)


# --- mutual TLS ------------------------------------------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d: Path, name: str) -> SyncTls:
    """A CA and one certificate for the name 'epp-sync' signed by it, in ``d/name``."""
    d = d / name
    d.mkdir()
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", f"/CN={name}-ca", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=DNS:epp-sync\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=epp-sync", cwd=d)
    _openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "tls.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    return SyncTls(str(d / "tls.pem"), str(d / "tls.key"), str(d / "ca.pem"), "epp-sync")


needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl binary")


@needs_openssl
async def test_mutual_tls_sync_works_and_refuses_strangers(tmp_path: Path) -> None:
    tls = make_pki(tmp_path, "pool")
    stranger = make_pki(tmp_path, "stranger")
    opts = dataclasses.replace(sync_options(), tls=tls)
    a = await start_epp(pool(4), sync=opts)
    b = await start_epp(pool(4), sync=opts)
    try:
        connect([a, b])
        await until(lambda: connected(b, [a]), "b follows a over mutual TLS")
        dest = await route(a, PROMPTS[0])
        await until(lambda: bool(b.handle.index.chunks_of(EndpointId(dest))), "write synced")
        target = f"127.0.0.1:{a.handle.sync_port}"
        override = [("grpc.ssl_target_name_override", "epp-sync")]
        # plaintext, and a client certificate from another CA: both refused
        async with grpc.aio.insecure_channel(target) as ch:
            call = sync_pb2_grpc.IndexSyncStub(ch).Subscribe(sync_pb2.SubscribeRequest(replica_id="p"))
            with pytest.raises(grpc.aio.AioRpcError):
                await call.read()
        cert, key, _ = stranger._read()
        _, _, ca = tls._read()
        creds = grpc.ssl_channel_credentials(ca, key, cert)
        async with grpc.aio.secure_channel(target, creds, options=override) as ch:
            call = sync_pb2_grpc.IndexSyncStub(ch).Subscribe(sync_pb2.SubscribeRequest(replica_id="s"))
            with pytest.raises(grpc.aio.AioRpcError):
                await call.read()
        assert sync_of(a).service.subscribers == 1  # b alone
    finally:
        await stop_epp(a)
        await stop_epp(b)


def _serve(*flags: str) -> subprocess.Popen[str]:
    import sys

    argv = [sys.executable, "-m", "epp.cli", "serve", "--endpoints", "10.0.0.1:8000",
            "--grpc-port", "0", "--health-port", "-1", "--metrics-port", "-1", "--sync-port", "0",
            "--log-format", "text", "--peers", "127.0.0.1:1", *flags]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def test_sync_started_by_hand_without_tls_refuses_to_start_unless_insecure_is_chosen() -> None:
    """The public report: ``epp serve --peers ...`` without TLS flags accepted any peer in
    plaintext. Now it does not start; with ``--sync-insecure`` it starts, and says so."""
    refused = _serve()
    _, err = refused.communicate(timeout=60)
    assert refused.returncode == 2
    assert "--sync-insecure" in err and "mutual TLS" in err
    for _start in range(2):  # at every start
        chosen = _serve("--sync-insecure")
        try:
            seen = log_until_serving(chosen)
            assert "INSECURE: index sync is PLAINTEXT and unauthenticated" in seen
            assert "--sync-insecure" in seen
        finally:
            chosen.terminate()
            chosen.wait(timeout=30)
