"""``epp-sim stack --models``: a pool per model behind one real Envoy and epp model-router,
and the demo's per-model run on it."""

from __future__ import annotations

import dataclasses

import aiohttp
import pytest

from simulator.stack.manymodels import model_loads, parse_models, run_policy
from simulator.stack.stack import StackOptions, start_stack
from simulator.stack.workload import SharedPrefixWorkload

pytestmark = pytest.mark.e2e

MODELS = "chat:2:sql-lora,coder:1"


def test_the_models_flag_is_parsed_and_checked() -> None:
    (chat, _coder) = parse_models(MODELS)
    assert (chat.model, chat.replicas, chat.adapters, chat.name) == ("chat", 2, ("sql-lora",), "chat")
    assert parse_models("meta-llama/Llama-3.1-8B:1")[0].name == "meta-llama-llama-3-1-8b"
    for bad in ("chat", "chat:0", "chat:2,chat:1", "chat:1:coder,coder:1"):
        with pytest.raises(ValueError, match="--models"):
            parse_models(bad)


async def test_every_model_is_served_by_its_pool_and_listed_once() -> None:
    stack = await start_stack(StackOptions(models=parse_models(MODELS), isolation="inline",
                                           speedup=20.0))  # fmt: skip
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(stack.gateway_url + "/v1/models") as r:
                ids = [m["id"] for m in (await r.json())["data"]]
            upstreams = {}
            for model in ("chat", "sql-lora", "coder"):
                async with http.post(stack.gateway_url + "/v1/completions",
                                     json={"model": model, "prompt": "hi", "max_tokens": 2}) as r:  # fmt: skip
                    assert r.status == 200, await r.text()
                    upstreams[model] = r.headers["x-upstream-host"]
        pools = {p.name: set(p.endpoints()) for p in stack.pools}
        described = stack.describe()
    finally:
        await stack.stop()
    assert sorted(ids) == ["chat", "coder", "sql-lora"]
    assert upstreams["chat"] in pools["chat"] and upstreams["sql-lora"] in pools["chat"]
    assert upstreams["coder"] in pools["coder"]
    assert [p["name"] for p in described["pools"]] == ["chat", "coder"]


async def test_the_demos_run_reports_each_model_with_nothing_misrouted() -> None:
    options = StackOptions(models=parse_models(MODELS), isolation="inline", speedup=20.0)
    workload = SharedPrefixWorkload(num_groups=8, num_prompts_per_group=2, num_turns=2,
                                    system_prompt_len=300, question_len=20, output_len=8,
                                    concurrency=8)  # fmt: skip
    loads = model_loads(options.models, workload)
    assert [(x.model, x.pool) for x in loads] == [("chat", "chat"), ("sql-lora", "chat"), ("coder", "coder")]
    runs = await run_policy(dataclasses.replace(options, policy="epp"), loads)
    for load in loads:
        run = runs[load.model]
        assert run.summary.requests == load.workload.total_requests
        assert run.summary.errors == 0 and run.misrouted == 0
        assert run.summary.hit_rate > 0.3
