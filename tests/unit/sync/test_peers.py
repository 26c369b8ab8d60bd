"""Peer addresses, the followed set as it changes, and DNS discovery."""

from __future__ import annotations

import asyncio

import pytest

from epp.errors import ConfigError
from epp.sync.peers import HostPort, PeerSet, parse_host_port, parse_peers, watch_dns


def test_parse_peers() -> None:
    assert parse_peers("10.0.0.1:9004, epp-1.epp:9004,[fd00::1]:9004,") == [
        HostPort("10.0.0.1", 9004), HostPort("epp-1.epp", 9004), HostPort("fd00::1", 9004)
    ]
    assert str(HostPort("fd00::1", 9004)) == "[fd00::1]:9004"


@pytest.mark.parametrize("bad", ["host", "host:", ":9004", "host:http", "host:70000"])
def test_bad_peer_names_the_flag(bad: str) -> None:
    with pytest.raises(ConfigError, match="--peer-dns"):
        parse_host_port(bad, "--peer-dns")


class Followers:
    def __init__(self) -> None:
        self.running: set[str] = set()
        self.started: list[str] = []

    async def __call__(self, target: str) -> None:
        self.running.add(target)
        self.started.append(target)
        try:
            await asyncio.Event().wait()
        finally:
            self.running.discard(target)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_peer_set_follows_new_peers_and_cancels_departed_ones() -> None:
    followers = Followers()
    peers = PeerSet(followers)
    peers.update(["a:1", "b:1"])
    await settle()
    assert followers.running == {"a:1", "b:1"}
    peers.update(["b:1", "c:1"])
    await settle()
    assert followers.running == {"b:1", "c:1"}
    assert followers.started == ["a:1", "b:1", "c:1"]  # b was not restarted
    peers.update(["b:1", "c:1"])
    await settle()
    assert followers.started == ["a:1", "b:1", "c:1"]
    await peers.close()
    assert followers.running == set() and peers.addresses == frozenset()


async def test_dns_discovery_skips_our_ip_and_keeps_peers_when_lookup_fails() -> None:
    answers: list[list[str] | OSError] = [
        ["10.1.0.5", "10.1.0.6", "10.1.0.7"],
        OSError("no such host"),
        ["10.1.0.5", "10.1.0.7", "10.1.0.8"],
    ]
    seen: list[frozenset[str]] = []
    done = asyncio.Event()
    followers = Followers()
    peers = PeerSet(followers)

    async def resolve(host: str, port: int) -> list[str]:
        assert (host, port) == ("epp-peers.models.svc", 9004)
        seen.append(peers.addresses)
        if not answers:
            done.set()
            await asyncio.Event().wait()
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    task = asyncio.create_task(watch_dns(
        HostPort("epp-peers.models.svc", 9004), peers, frozenset({"10.1.0.6"}), 0.0, resolve
    ))
    await asyncio.wait_for(done.wait(), 5)
    task.cancel()
    await peers.close()
    assert seen == [
        frozenset(),
        frozenset({"10.1.0.5:9004", "10.1.0.7:9004"}),
        frozenset({"10.1.0.5:9004", "10.1.0.7:9004"}),  # a failed lookup changes nothing
        frozenset({"10.1.0.5:9004", "10.1.0.7:9004", "10.1.0.8:9004"}),
    ]
