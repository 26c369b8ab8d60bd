"""Every API epp understands, through `epp serve`'s ext_proc server driven as Envoy drives it
(full-duplex streams, the reply read back): affinity where the prompt is keyed, load routing
where it is not, 404 for the rest.

Requests go in rounds: a round's requests are all in flight together (routed, their replies
not yet sent), then answered, so the pick weighs prefix against the load the round put on
each endpoint, as under concurrent clients.
"""

from __future__ import annotations

import base64
import json
import random
import struct
import time
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from epp.prefix.hasher import ChunkHasher, chain_seed
from epp.request.apis import BUILTIN
from simulator.stack.workload import word_text
from tests.integration import envoy_client as ec
from tests.integration.extproc_fixtures import Epp, start_epp, stop_epp

MODEL = "m"


@pytest.fixture
async def epp() -> AsyncIterator[Epp]:
    e = await start_epp()  # the shipped default profile over 4 endpoints
    yield e
    await stop_epp(e)


def text(rng: random.Random, chars: int) -> str:
    return word_text(rng, chars)


@dataclass
class Sent:
    stream: ec.Stream
    destination: str


async def send(epp: Epp, path: str, body: bytes, content_type: str = "application/json",
               subset: Sequence[str] | None = None) -> Sent:  # fmt: skip
    """Open a stream, send the request; the routing reply names the destination."""
    s = ec.Stream(epp.channel)
    await s.send(ec.request_headers(path, extra={"content-type": content_type}, subset=subset),
                 ec.request_body(body, True))  # fmt: skip
    first = await s.recv()
    kind = first.WhichOneof("response")
    assert kind == "request_headers", f"{path}: {first}"
    await s.recv()  # the streamed body
    dest = ec.destination(first)
    assert dest is not None
    return Sent(s, dest)


async def answer(sent: Sent, reply: dict[str, Any] | None = None) -> None:
    await sent.stream.send(ec.response_headers(), ec.response_body(json.dumps(reply or {}).encode(), True))
    await sent.stream.recv_n(2)
    assert await sent.stream.close() == grpc.StatusCode.OK


async def round_trip(epp: Epp, requests: Sequence[tuple[str, dict[str, Any]]],
                     replies: Sequence[dict[str, Any] | None] | None = None,
                     subsets: Sequence[Sequence[str]] | None = None) -> list[str]:  # fmt: skip
    """One round: every request in flight together, then every reply."""
    sent = [await send(epp, path, json.dumps(doc).encode(), subset=subsets[i] if subsets else None)
            for i, (path, doc) in enumerate(requests)]  # fmt: skip
    for i, s in enumerate(sent):
        await answer(s, replies[i] if replies else None)
    return [s.destination for s in sent]


async def immediate(epp: Epp, path: str, body: bytes) -> int:
    s = ec.Stream(epp.channel)
    await s.send(ec.request_headers(path), ec.request_body(body, True))
    reply = await s.recv()
    assert reply.WhichOneof("response") == "immediate_response", reply
    assert await s.close() == grpc.StatusCode.OK
    return int(reply.immediate_response.status.code)


# --- Anthropic Messages agent sessions -----------------------------------------------------


def agent_tools(rng: random.Random, chars: int) -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    while len(json.dumps(tools)) < chars:
        tools.append({"name": f"tool_{len(tools)}", "description": text(rng, 300), "input_schema": {
            "type": "object", "properties": {"path": {"type": "string", "description": text(rng, 120)}},
            "required": ["path"]}})  # fmt: skip
    return tools


def messages_reply(answer_text: str, cached: int) -> dict[str, Any]:
    return {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL,
            "content": [{"type": "text", "text": answer_text}], "stop_reason": "tool_use",
            "usage": {"input_tokens": 100, "output_tokens": 20, "cache_read_input_tokens": cached}}  # fmt: skip


async def test_messages_agent_sessions_stay_on_their_first_endpoint(epp: Epp) -> None:
    """Eight sessions over one system prompt and tool set: each later turn goes where its own
    session's turns are, not merely where the shared 8k characters are. The first turns are
    spread by the proxy's subset hint (in production, load spreads them; here the pool's
    metrics are equal and the shared prefix would pull every session onto one endpoint)."""
    rng = random.Random(1)
    ids = sorted(e.id for e in epp.handle.datastore.snapshot())
    system = "You are a coding agent working in a large repository. " + text(rng, 3000)
    tools = agent_tools(rng, 5000)  # system + tools: ~8k characters, shared by every session
    sessions: list[list[dict[str, Any]]] = [
        [{"role": "user", "content": f"Task {i}: " + text(rng, 400)}] for i in range(8)
    ]
    homes: list[str] = []
    stayed = later = 0
    for turn in range(5):
        bodies = [{"model": MODEL, "max_tokens": 256, "system": system, "tools": tools, "messages": list(m)}
                  for m in sessions]  # fmt: skip
        said = [f"Looking at step {turn} of session {i}." for i in range(len(sessions))]
        pins = [[ids[i % len(ids)]] for i in range(len(bodies))] if turn == 0 else None
        dests = await round_trip(epp, [("/v1/messages", b) for b in bodies],
                                 [messages_reply(s, 2000 * turn) for s in said], pins)  # fmt: skip
        if turn == 0:
            homes = dests
        else:
            later += len(dests)
            stayed += sum(d == h for d, h in zip(dests, homes, strict=True))
        for i, msgs in enumerate(sessions):  # the agent's tool call and its result
            call = f"tu_{turn}_{i}"
            msgs.append({"role": "assistant", "content": [
                {"type": "text", "text": said[i]},
                {"type": "tool_use", "id": call, "name": "tool_1", "input": {"path": f"src/f{turn}.py"}}]})
            msgs.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call, "content": text(rng, 600)}]})  # fmt: skip
    assert stayed / later >= 0.9, (stayed, later)
    # count_tokens is routed (by load), with the same model rules
    count = await round_trip(epp, [("/v1/messages/count_tokens", {"model": MODEL, "system": system,
                                                                  "tools": tools, "messages": sessions[0]})])  # fmt: skip
    assert count[0] in {e.id for e in epp.handle.datastore.snapshot()}


# --- tools in the key ------------------------------------------------------------------


def tool_set(rng: random.Random, name: str, chars: int = 12_000) -> list[dict[str, Any]]:
    tools: list[dict[str, Any]] = []
    while len(json.dumps(tools)) < chars:
        tools.append({"type": "function", "function": {
            "name": f"{name}_{len(tools)}", "description": text(rng, 400),
            "parameters": {"type": "object", "properties": {"q": {"type": "string", "description": text(rng, 200)}}}}})  # fmt: skip
    return tools


async def test_requests_sharing_a_tool_set_share_an_endpoint(epp: Epp) -> None:
    rng = random.Random(2)
    sets = [tool_set(rng, n) for n in ("crm", "shop", "ops")]
    placed: list[list[str]] = [[] for _ in sets]
    for i in range(8):  # interleaved: one request of each tool set a round
        requests = [("/v1/chat/completions", {"model": MODEL, "tools": tools, "messages": [
            {"role": "user", "content": f"question {i}: " + text(rng, 60)}]}) for tools in sets]  # fmt: skip
        for k, dest in enumerate(await round_trip(epp, requests)):
            placed[k].append(dest)
    shares = [Counter(p).most_common(1)[0][1] / len(p) for p in placed]
    assert min(shares) >= 0.8, (shares, placed)


async def test_different_tools_and_equal_messages_match_no_cache(epp: Epp) -> None:
    rng = random.Random(3)
    first, second = tool_set(rng, "a"), tool_set(rng, "b")
    msgs = [{"role": "user", "content": text(rng, 2000)}]
    dest = (await round_trip(epp, [("/v1/chat/completions", {"model": MODEL, "tools": first, "messages": msgs})]))[0]
    other = {"model": MODEL, "tools": second, "messages": msgs}
    prompt = epp.handle.parser.parse("/v1/chat/completions", {}, json.dumps(other).encode()).request.prompt
    hashes = ChunkHasher(64).hashes(prompt, chain_seed(MODEL, MODEL, ""))
    index = epp.handle.index
    assert index.match(hashes, {dest}, time.monotonic()).get(dest, 0) == 0  # no prefix hit
    same = epp.handle.parser.parse("/v1/chat/completions", {}, json.dumps({**other, "tools": first}).encode())
    again = ChunkHasher(64).hashes(same.request.prompt, chain_seed(MODEL, MODEL, ""))
    assert index.match(again, {dest}, time.monotonic())[dest] == len(again)  # the index holds it


# --- media identity ----------------------------------------------------------------------


def png(seed: int, size: int = 48) -> str:
    """A ``size`` x ``size`` RGB PNG of random pixels, as a data URL."""
    rng = random.Random(seed)
    raw = b"".join(b"\x00" + rng.randbytes(size * 3) for _ in range(size))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))  # fmt: skip
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_request(url: str, after: str) -> tuple[str, dict[str, Any]]:
    return ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": after}]}]})  # fmt: skip


async def test_different_images_before_one_long_text_are_not_piled_on_one_endpoint(epp: Epp) -> None:
    rng = random.Random(4)
    long_text = text(rng, 6000)
    images = [png(i) for i in range(12)]
    assert len({len(u) for u in images}) == 1 and len({u[:64] for u in images}) == 1  # same size, same head
    dests: list[str] = []
    for r in range(3):  # rounds of four
        dests += await round_trip(epp, [image_request(u, long_text) for u in images[4 * r : 4 * r + 4]])
    assert Counter(dests).most_common(1)[0][1] <= 6, Counter(dests)


async def test_one_image_with_distinct_questions_stays_together(epp: Epp) -> None:
    rng = random.Random(5)
    image = png(99)
    dests: list[str] = []
    for r in range(4):  # rounds of two, each question its own
        dests += await round_trip(epp, [image_request(image, f"question {r}.{k}: " + text(rng, 80))
                                        for k in range(2)])  # fmt: skip
    assert Counter(dests).most_common(1)[0][1] >= 7, dests


# --- every API routed, garbage paths not ----------------------------------------------------

AUDIO_BOUNDARY = "----epp-test"
AUDIO = (f'--{AUDIO_BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
         "Content-Type: audio/wav\r\n\r\n").encode() + b"RIFF\x00\x00WAVE" + bytes(2048) + (
    f'\r\n--{AUDIO_BOUNDARY}\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n'
    f"--{AUDIO_BOUNDARY}--\r\n").encode()  # fmt: skip
SAMPLES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": MODEL, "prompt": "hello"},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": MODEL, "input": "hi"},
    "/v1/embeddings": {"model": MODEL, "input": "hi"},
    "/v1/messages": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 4}},
    "/inference/v1/generate": {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
    "/detokenize": {"model": MODEL, "tokens": [1, 2]},
    "/v1/rerank": {"model": MODEL, "query": "q", "documents": ["a"]},
    "/v2/rerank": {"model": MODEL, "query": "q", "documents": ["a"]},
    "/rerank": {"model": MODEL, "query": "q", "documents": ["a"]},
    "/v1/score": {"model": MODEL, "text_1": "a", "text_2": "b"},
    "/score": {"model": MODEL, "text_1": "a", "text_2": "b"},
    "/pooling": {"model": MODEL, "input": "a"},
    "/classify": {"model": MODEL, "input": "a"},
    "/v2/embed": {"model": MODEL, "texts": ["a"]},
    "/encode": {"model": MODEL, "text": "a"},
}


@pytest.mark.parametrize("path", sorted(BUILTIN))
async def test_every_api_is_routed(epp: Epp, path: str) -> None:
    if path.startswith("/v1/audio/"):
        sent = await send(epp, path, AUDIO, f"multipart/form-data; boundary={AUDIO_BOUNDARY}")
    else:
        sent = await send(epp, path + "?trace=1", json.dumps(SAMPLES[path]).encode())
    assert sent.destination in {e.id for e in epp.handle.datastore.snapshot()}
    await answer(sent)


@pytest.mark.parametrize("path", ["/v1/chat", "/v1/messages/batches", "/generate/stream", "/admin/reset",
                                  "/v1/completions/../../x", "/V1/COMPLETIONS"])  # fmt: skip
async def test_garbage_paths_are_404(epp: Epp, path: str) -> None:
    assert await immediate(epp, path, json.dumps(SAMPLES["/v1/completions"]).encode()) == 404


async def test_a_body_the_server_would_refuse_is_400(epp: Epp) -> None:
    assert await immediate(epp, "/v1/embeddings", b'{"model": "m", "input": [true, false]}') == 400
