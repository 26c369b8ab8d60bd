"""``simulator.vllm.free_port``: the ports the stack hands its servers."""

from __future__ import annotations

import random
import socket

import pytest

from simulator import vllm


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range() -> None:
    ports = [vllm.free_port() for _ in range(50)]
    assert len(set(ports)) == 50  # never the same twice, even once released
    low = vllm._ephemeral_low()
    if low > 11_000:  # room below the kernel's range: nothing the kernel picks can take them
        assert all(10_000 <= p < low for p in ports), ports
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_busy_port_is_not_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    real = random.randrange
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 20_000 + real(5_000)))
        busy.listen()
        taken = busy.getsockname()[1]
        first = [taken]  # the first pick is the busy port, the rest are random
        monkeypatch.setattr(random, "randrange", lambda a, b: first.pop() if first else real(a, b))
        monkeypatch.setattr(vllm, "_ephemeral_low", lambda: 32_768)
        assert vllm.free_port() != taken
        assert not first
