"""The SGLang router as a demo baseline: in front of the servers, and behind the gateway and
the ext_proc path (``--sglang-behind-gateway``: an epp whose only endpoint is the router), so
that it pays the same routing hop as epp. Emulated replicas keep it quick; the router itself is
the real one (installed into the vLLM environment on first use), so the tier's set-up gates it."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from simulator import vllm
from simulator.gateway import UPSTREAM_HOST_HEADER
from simulator.stack import StackOptions, start_stack
from tests.e2e.conftest import post

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(("policy", "behind"),
                         [("sglang", False), ("sglang", True), ("sglang-random", True)])  # fmt: skip
async def test_the_router_serves_with_and_without_the_gateway_hop(
    policy: str, behind: bool, tmp_path: Path
) -> None:
    reason = vllm.setup_missing() or vllm.available()
    if reason:
        pytest.skip(reason)
    stack = await start_stack(StackOptions(
        replicas=2, policy=policy, sglang_behind_gateway=behind, isolation="inline",
        log_dir=tmp_path,
    ))  # fmt: skip
    try:
        body = {"model": stack.options.model, "max_tokens": 4, "stream": False,
                "messages": [{"role": "user", "content": "Which way to the harbour?"}]}  # fmt: skip
        async with aiohttp.ClientSession() as http:
            status, headers, _ = await post(http, f"{stack.gateway_url}/v1/chat/completions", body)
        assert status == 200
        if behind:
            # the gateway proxied to the router, its only upstream (not a server), through
            # the one epp replica
            assert len(stack.epps) == 1 and stack._children[-1].name == "sglang-router"
            upstream = headers[UPSTREAM_HOST_HEADER]
            assert upstream and upstream not in stack.endpoints()
        else:  # the clients talk to the router itself: no gateway, no epp
            assert stack.epps == [] and UPSTREAM_HOST_HEADER not in {h.lower() for h in headers}
        # the router runs the policy asked for (its start-up line names it)
        log = (tmp_path / "sglang-router.log").read_text(errors="replace")
        assert ("policy: Random" if policy == "sglang-random" else "policy: CacheAware") in log
    finally:
        await stack.stop()
