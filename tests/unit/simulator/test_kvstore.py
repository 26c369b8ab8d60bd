"""The emulators' shared KV store (vLLM's ExampleConnector, emulated): what one server saves
another finds, leading blocks only, and each server's share stays bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.emulator.kvstore import SharedKvStore


def test_a_prompt_one_server_saved_is_found_by_another(tmp_path: Path) -> None:
    prefiller, decoder = SharedKvStore(tmp_path), SharedKvStore(tmp_path)
    prefiller.save([11, 12, 13])
    assert decoder.leading([11, 12, 13, 14]) == 3
    assert decoder.leading([11, 99, 13]) == 1  # only the leading run: KV is causal
    assert decoder.leading([99, 11]) == 0
    assert decoder.leading([-5]) == 0  # negative hashes are named like the rest
    decoder.save([-5])
    assert prefiller.leading([-5]) == 1


def test_each_server_keeps_at_most_its_bound(tmp_path: Path) -> None:
    store = SharedKvStore(tmp_path, max_blocks=3)
    store.save([1, 2, 3])
    store.save([1])  # used again: now the newest
    store.save([4, 5])
    assert len(list(tmp_path.iterdir())) == 3
    assert store.leading([1]) == 1 and store.leading([2]) == 0 and store.leading([3]) == 0
    assert store.leading([4, 5]) == 2
    with pytest.raises(ValueError, match="max_blocks"):
        SharedKvStore(tmp_path, max_blocks=0)
