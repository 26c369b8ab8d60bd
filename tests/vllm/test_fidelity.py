"""The emulator caches what real vLLM caches (docs/fidelity.md): one real vLLM server and an
emulator with its cache geometry get the same token-id requests, one at a time
(``bench/bench_fidelity.py``'s two checks, at a CI size)."""

from __future__ import annotations

import pytest

from bench.bench_fidelity import measure
from simulator import vllm

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio]


async def test_the_emulator_caches_what_real_vllm_caches() -> None:
    if reason := vllm.setup_missing() or vllm.available():
        pytest.skip(reason)
    found = await measure(requests=60)
    assert found.equal == len(found.no_pressure), found.no_pressure  # cached_tokens, request by request
    assert found.real[0] > 0 and found.apart <= 0.02, (found.real, found.emulated)  # hit tokens under evictions
