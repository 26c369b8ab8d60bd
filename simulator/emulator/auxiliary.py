"""The emulator's other APIs, enough for tests and load runs through epp: Anthropic
``count_tokens``, tokenize / detokenize (no engine work, as in vLLM), the pooling family
(rerank, score, pooling, classify, Cohere-style embed, SGLang's encode: each text prefilled by
the engine, one token out), audio transcription and translation (a ``multipart/form-data``
upload; answered without engine work), and the token-in generation APIs: SGLang's
``/generate`` (``text`` or ``input_ids``; ``meta_info`` with the cached tokens, a stream's
``text`` cumulative as SGLang sends it) and vLLM's ``/inference/v1/generate`` (``token_ids``
in and out, OpenAI ``usage``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

from aiohttp import web

from simulator.emulator import anthropic, openai
from simulator.emulator.openai import ApiError
from simulator.model.tokens import CHARS_PER_TOKEN, count_tokens, generate_text, token_ids_text

if TYPE_CHECKING:
    from simulator.emulator.server import Emulator

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_DEFAULT_MAX_TOKENS = 16


def routes(emulator: Emulator) -> dict[str, Handler]:
    h = _Handlers(emulator)
    pooling = {path: h.pooling(path) for path in (
        "/v1/rerank", "/v2/rerank", "/rerank", "/v1/score", "/score", "/pooling", "/classify", "/v2/embed",
        "/encode")}  # fmt: skip
    return {
        "/v1/messages/count_tokens": h.count_tokens,
        "/tokenize": h.tokenize,
        "/detokenize": h.detokenize,
        **pooling,
        "/v1/audio/transcriptions": h.audio,
        "/v1/audio/translations": h.audio,
        "/generate": h.sglang_generate,
        "/inference/v1/generate": h.vllm_generate,
    }


def _texts(path: str, body: Mapping[str, Any]) -> list[str]:
    """The texts a pooling request prefills."""
    if "rerank" in path:
        query, docs = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not isinstance(docs, list) or not docs:
            raise ApiError(400, "rerank needs 'query' and a non-empty 'documents' list", "documents")
        return [query + (d if isinstance(d, str) else json.dumps(d)) for d in docs]
    if "score" in path:
        a, b = body.get("text_1", body.get("queries")), body.get("text_2", body.get("documents"))
        if a is None or b is None:
            raise ApiError(400, "score needs 'text_1' and 'text_2'", "text_1")
        return [json.dumps(a) + json.dumps(b)]
    value = body.get("texts", body.get("input", body.get("text")))
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise ApiError(400, "'input' must be a string or a list of strings", "input")


def _max_new_tokens(params: Any, name: str) -> int:
    if params is None:
        return _DEFAULT_MAX_TOKENS
    if not isinstance(params, dict):
        raise ApiError(400, "'sampling_params' must be an object", "sampling_params")
    value = params.get(name, _DEFAULT_MAX_TOKENS)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ApiError(400, f"'sampling_params.{name}' must be a positive integer", "sampling_params")
    return value


class _Handlers:
    def __init__(self, emulator: Emulator) -> None:
        self.e = emulator

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        body = openai.load_json(await request.read())
        self.e.check_model(str(body.get("model") or ""))
        return web.json_response({"input_tokens": count_tokens(anthropic.messages_prompt(body))})

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        body = openai.load_json(await request.read())
        self.e.check_model(str(body.get("model") or ""))
        if "messages" in body:
            text = openai.flatten_messages(body["messages"], "messages", body.get("tools"))
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise ApiError(400, "'prompt' or 'messages' is required", "prompt")
        n = count_tokens(text)
        return web.json_response({"count": n, "max_model_len": self.e.config.max_model_len,
                                  "tokens": [(7 * i + 11) % 32000 for i in range(n)]})  # fmt: skip

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        body = openai.load_json(await request.read())
        tokens = body.get("tokens")
        if not isinstance(tokens, list):
            raise ApiError(400, "'tokens' must be a list of token ids", "tokens")
        return web.json_response({"prompt": generate_text(json.dumps(tokens), len(tokens))})

    def pooling(self, path: str) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            body = openai.load_json(await request.read())
            model = self.e.check_model(str(body.get("model") or ""))
            texts = _texts(path, body)
            rid, prompt_tokens = await self.e.pool(model, texts, "pool-")
            scores = [openai.embedding_vector(t)[0] for t in texts]
            return web.json_response({
                "id": rid, "object": "list", "model": model, "created": int(time.time()),
                "data": [{"index": i, "score": s} for i, s in enumerate(scores)],
                "results": [{"index": i, "relevance_score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            })  # fmt: skip

        return handle

    async def audio(self, request: web.Request) -> web.StreamResponse:
        if not request.content_type.startswith("multipart/"):
            raise ApiError(400, "send the audio as multipart/form-data", "file")
        form = await request.post()
        upload = form.get("file")
        if not isinstance(upload, web.FileField):
            raise ApiError(400, "'file' (the audio) is required", "file")
        model = form.get("model")
        self.e.check_model(model if isinstance(model, str) else "")
        size = len(upload.file.read())
        return web.json_response({"text": generate_text(f"{upload.filename}:{size}", max(1, size // 4096))})

    async def sglang_generate(self, request: web.Request) -> web.StreamResponse:
        body = openai.load_json(await request.read())
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise ApiError(400, "Either text or input_ids should be provided.", "text")
        if text is not None and not isinstance(text, str):
            raise ApiError(400, "the emulator serves one 'text' a request", "text")
        if ids is not None and not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
            raise ApiError(400, "'input_ids' must be a non-empty list of token ids", "input_ids")
        prompt = text if isinstance(text, str) else token_ids_text(list(ids or ()))
        lora = body.get("lora_path")
        model = self.e.check_model(lora if isinstance(lora, str) else "")
        max_tokens = _max_new_tokens(body.get("sampling_params"), "max_new_tokens")

        def meta(g: Any, n: int) -> dict[str, Any]:
            return {"id": g.rid, "prompt_tokens": g.prompt_tokens, "completion_tokens": n,
                    "cached_tokens": g.cached_tokens, "finish_reason": {"type": "length", "length": n}}  # fmt: skip

        if body.get("stream") is not True:
            g = await self.e.generate(model, prompt, max_tokens, "sgl-")
            return web.json_response({"text": g.text, "output_ids": list(range(max_tokens)),
                                      "meta_info": meta(g, g.completion_tokens)})  # fmt: skip
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def first() -> None:
            piece = generate_text(prompt, max_tokens)[:CHARS_PER_TOKEN]
            await resp.write(b"data: " + json.dumps({"text": piece}).encode() + b"\n\n")

        g = await self.e.generate(model, prompt, max_tokens, "sgl-", first)
        last = {"text": g.text, "meta_info": meta(g, g.completion_tokens)}
        await resp.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def vllm_generate(self, request: web.Request) -> web.StreamResponse:
        body = openai.load_json(await request.read())
        ids = body.get("token_ids")
        if not (isinstance(ids, list) and ids and all(isinstance(i, int) and i >= 0 for i in ids)):
            raise ApiError(400, "'token_ids' must be a non-empty list of token ids", "token_ids")
        model = self.e.check_model(str(body.get("model") or ""))
        max_tokens = _max_new_tokens(body.get("sampling_params"), "max_tokens")
        out_ids = list(range(1000, 1000 + max_tokens))
        if body.get("stream") is not True:
            g = await self.e.generate(model, token_ids_text(ids), max_tokens, "gen-")
            return web.json_response({
                "request_id": g.rid, "model": model, "created": int(time.time()),
                "choices": [{"index": 0, "finish_reason": "length", "token_ids": out_ids}],
                "usage": openai.usage(g.prompt_tokens, g.completion_tokens, g.cached_tokens)})  # fmt: skip
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def first() -> None:
            chunk = {"choices": [{"index": 0, "token_ids": out_ids[:1]}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        g = await self.e.generate(model, token_ids_text(ids), max_tokens, "gen-", first)
        last = {"request_id": g.rid, "choices": [{"index": 0, "finish_reason": "length", "token_ids": out_ids[1:]}],
                "usage": openai.usage(g.prompt_tokens, g.completion_tokens, g.cached_tokens)}  # fmt: skip
        await resp.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp
