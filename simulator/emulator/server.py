"""The emulator server: one :class:`~simulator.model.engine.Engine` behind vLLM's HTTP API.

An asyncio task drives the engine in real time: it sleeps until the engine's next event
(the model's durations are divided by ``speedup``), advances the engine and resolves the
futures of the requests that got their first token or finished. Handlers submit requests
and wake the task. While streams are open the task also wakes every few milliseconds so
that tokens flow as they are generated, not in one burst at the end.

The task is supervised (``epp.supervise``): if a step raises, the requests in flight are
answered 500 and dropped from the engine, and the loop starts again, so one bad step costs
those requests, not every later one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from epp.prefix.blockhash import VllmBlockHasher
from epp.prefix.tokenize import ModelTokenizer, token_ids
from epp.supervise import spawn
from simulator.emulator import anthropic, auxiliary, openai
from simulator.emulator.config import EmulatorConfig
from simulator.emulator.kvpublish import KvEventPublisher
from simulator.emulator.kvstore import SharedKvStore
from simulator.emulator.metrics import VllmMetrics, restrict_page
from simulator.emulator.openai import Api, ApiError
from simulator.emulator.responses import CANCELLABLE, ResponseStore, StoredResponse
from simulator.model.cache import PrefixCache, model_seed, text_block_hashes
from simulator.model.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    Finished,
    FirstToken,
    RequestTooLarge,
    StepResult,
)
from simulator.model.tokens import CHARS_PER_TOKEN, count_tokens, generate_text

MAX_BODY_BYTES = 64 << 20
"""Largest request body the emulator reads (aiohttp's default is 1 MiB)."""

_EPP_API = {Api.COMPLETIONS: "completions", Api.CHAT: "chat_completions"}
"""The emulator's API kinds as ``epp.prefix.tokenize.token_ids`` names them."""

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_ID_PREFIX = {
    Api.COMPLETIONS: "cmpl-",
    Api.CHAT: "chatcmpl-",
    Api.RESPONSES: "resp_",
    Api.EMBEDDINGS: "embd-",
    Api.MESSAGES: "msg_",
}


@dataclass(slots=True, frozen=True)
class Generated:
    """A generation that ran to its end."""

    rid: str
    text: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(slots=True, eq=False)
class _Pending:
    rid: str
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    text: str
    stream: bool
    first: asyncio.Future[FirstToken]
    done: asyncio.Future[Finished]
    progress: asyncio.Event = field(default_factory=asyncio.Event)
    prompt_blocks: list[int] = field(default_factory=list)
    """The prompt's full blocks (saved to the shared KV store once computed)."""


class Emulator:
    """One emulated vLLM replica. Use :func:`start_emulator` to serve it."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        cost = replace(config.cost, speedup=config.cost.speedup * config.speedup)
        self.engine = Engine(
            PrefixCache(config.num_gpu_blocks, config.block_size),
            cost,
            EngineConfig(config.max_num_seqs, config.max_batched_tokens, config.max_loras),
        )
        self.registry = CollectorRegistry()
        self.sleep_level: int | None = None
        """vLLM's sleep mode (``POST /sleep?level=N``): the level, None while awake."""
        self.metrics = VllmMetrics(self.registry, self.engine, config.model, config.max_loras,
                                   lambda: self.sleep_level)  # fmt: skip
        self._adapters = frozenset(config.lora_adapters)
        self._tokenizer: ModelTokenizer | None = None
        self._hasher: VllmBlockHasher | None = None
        if config.tokenizer:
            self._tokenizer = ModelTokenizer(Path(config.tokenizer))
            self._hasher = VllmBlockHasher(config.block_size, "sha256_cbor")
        self.publisher: KvEventPublisher | None = None
        self.kv_store: SharedKvStore | None = None
        if config.kv_store:
            self.kv_store = SharedKvStore(config.kv_store, config.kv_store_max_blocks)
        self._pending: dict[str, _Pending] = {}
        self._streams: set[_Pending] = set()
        self.responses = ResponseStore()
        """Responses created with ``store`` (vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1)."""
        self._background: set[asyncio.Task[None]] = set()
        """Background responses running (``background: true``)."""
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stream_tick_s = max(0.002, min(0.02, cost.decode_step_s(1)))
        self._created = int(time.time())
        self.requests_received = 0
        """Generation requests that reached this server (tests read it)."""

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._task = spawn("emulator-engine", self._run, on_failure=self._engine_failed)

    def _engine_failed(self, kind: str) -> None:
        """An engine step raised: answer every request in flight 500 and drop it from the
        engine (its state for them cannot be trusted), before the loop restarts."""
        now = self._now()
        for p in list(self._pending.values()):
            with contextlib.suppress(Exception):
                self.engine.abort(p.rid, now)
            for fut in (p.first, p.done):
                if not fut.done():
                    fut.set_exception(
                        ApiError(500, "the emulator's engine failed on this request's step")
                    )
            p.progress.set()
        self._pending.clear()
        self._streams.clear()

    def publish_events(self, endpoint: str, topic: str, replay_endpoint: str = "") -> None:
        """Publish the cache's changes as vLLM's KV-cache events (after the port is known:
        the default topic names it)."""
        self.publisher = KvEventPublisher(endpoint, topic, replay_endpoint, self.config.block_size)
        self.engine.cache.events = self.publisher.cache_event
        self.publisher.start()

    async def stop(self) -> None:
        if self.publisher is not None:
            await self.publisher.close()
            self.engine.cache.events = None
            self.publisher = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for p in list(self._pending.values()):
            for fut in (p.first, p.done):
                if not fut.done():
                    fut.set_exception(ApiError(503, "the server is shutting down"))
            p.progress.set()
        self._pending.clear()

    def app(self) -> web.Application:
        # real servers take images of several MB (vLLM has no 1 MiB body limit); epp's own
        # cap (8 MiB by default) is in front of it
        app = web.Application(middlewares=[_errors], client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self._api(Api.COMPLETIONS))
        app.router.add_post("/v1/chat/completions", self._api(Api.CHAT))
        app.router.add_post("/v1/responses", self._create_response)
        app.router.add_get("/v1/responses/{rid}", self._get_response)
        app.router.add_delete("/v1/responses/{rid}", self._delete_response)
        app.router.add_post("/v1/responses/{rid}/cancel", self._cancel_response)
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_post("/v1/messages", self._api(Api.MESSAGES))
        for path, handler in auxiliary.routes(self).items():
            app.router.add_post(path, handler)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        app.router.add_post("/sleep", self._sleep)
        app.router.add_post("/wake_up", self._wake_up)
        app.router.add_get("/is_sleeping", self._is_sleeping)
        return app

    # -- engine driving --------------------------------------------------------------------

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            target = self.engine.next_event_time()
            timeout: float | None = None
            if target is not None:
                timeout = max(0.0, target - self._now())
            if self._streams:
                timeout = (
                    self._stream_tick_s if timeout is None else min(timeout, self._stream_tick_s)
                )
            woken = False
            try:
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
                    woken = True
            except TimeoutError:
                pass
            now = self._now()
            if not woken and target is not None and target - now < 0.001:
                now = max(now, target)  # timers may fire a hair early
            self._dispatch(self.engine.advance(now))
            for p in self._streams:
                p.progress.set()

    def _sync(self) -> None:
        """Bring the engine up to now (before reading its state)."""
        self._dispatch(self.engine.advance(self._now()))

    def _dispatch(self, result: StepResult) -> None:
        speedup = self.config.speedup
        store = self.kv_store
        for f in result.first_tokens:
            p = self._pending.get(f.request_id)
            if p is None:
                continue
            if store is not None:  # the prompt's KV is computed (or loaded): share it
                store.save(p.prompt_blocks)
            if not p.first.done():
                p.first.set_result(f)
            if not p.stream:
                self.metrics.ttft_s.observe((f.time_s - p.arrival_s) * speedup)
        for d in result.finished:
            p = self._pending.pop(d.request_id, None)
            self.metrics.e2e_s.observe((d.time_s - d.arrival_s) * speedup)
            self.metrics.success_length.inc()
            self.metrics.generation_tokens.inc(d.output_tokens)
            if p is None:
                continue
            self.metrics.prompt_tokens.inc(p.prompt_tokens)
            if not p.done.done():
                p.done.set_result(d)
            p.progress.set()
        if self.publisher is not None:
            self.publisher.flush()

    def _blocks(
        self, model: str, prompt: str, text: str, body: Mapping[str, Any] | None, api: Api
    ) -> tuple[int, list[int], int]:
        """Prompt tokens, block names of prompt + output, and how many are the prompt's. The
        output's last token is sampled, never computed: like vLLM, the cache keeps the full
        blocks of the tokens before it."""
        cfg = self.config
        tok, hasher = self._tokenizer, self._hasher
        if tok is None or hasher is None:
            final = text_block_hashes(prompt + text[:-CHARS_PER_TOKEN], cfg.block_size, model_seed(model))
            return count_tokens(prompt), final, len(prompt) // (cfg.block_size * CHARS_PER_TOKEN)
        ids = None
        if body is not None:
            ids = token_ids(tok, _EPP_API.get(api, ""), body)
        if ids is None:
            ids = tok.encode(prompt, False)
        salt = body.get("cache_salt") if body is not None else None
        out = tok.encode(text, False)
        keys = hasher.keys([*ids, *out[:-1]], cache_salt=salt if isinstance(salt, str) else "")
        return len(ids), keys.keys, len(ids) // cfg.block_size

    def _submit(
        self, model: str, prompt: str, max_tokens: int, stream: bool, id_prefix: str = "cmpl-",
        body: Mapping[str, Any] | None = None, api: Api = Api.COMPLETIONS, rid: str = "",
    ) -> _Pending:  # fmt: skip
        cfg = self.config
        text = generate_text(prompt, max_tokens)
        prompt_tokens, final, n_prompt_blocks = self._blocks(model, prompt, text, body, api)
        if prompt_tokens + max_tokens > cfg.max_model_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {cfg.max_model_len} tokens. However, "
                f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                f"prompt, {max_tokens} for the completion).",
            )
        rid = rid or f"{id_prefix}{next(self._ids):08x}"
        blocks = final[:n_prompt_blocks]
        request = EngineRequest(
            rid,
            prompt_tokens,
            blocks,
            max_tokens,
            final,
            adapter=model if model in self._adapters else "",
        )
        now = self._now()
        engine = self.engine
        load_s = 0.0
        if self.kv_store is not None:  # what another server computed is loaded, not computed
            stored = self.kv_store.leading(blocks)
            local = engine.cache.contains_prefix(blocks)
            if stored > local:
                request = replace(request, external_tokens=stored * cfg.block_size)
                load_s = engine.cost.kv_transfer_s((stored - local) * cfg.block_size)
        try:
            if load_s > 0:  # the request joins the batch once its KV is here
                need = engine.cache.blocks_for(prompt_tokens + max_tokens)
                if need > engine.cache.num_blocks:
                    raise RequestTooLarge(f"request needs {need} KV blocks, the cache holds "
                                          f"{engine.cache.num_blocks}")  # fmt: skip
                asyncio.get_running_loop().call_later(load_s, self._enter, request)
            else:
                engine.submit(request, now)
        except RequestTooLarge as exc:
            raise ApiError(400, f"prompt too long for this server's KV cache: {exc}") from None
        loop = asyncio.get_running_loop()
        pending = _Pending(
            rid,
            now,
            prompt_tokens,
            max_tokens,
            text,
            stream,
            loop.create_future(),
            loop.create_future(),
            prompt_blocks=blocks,
        )
        self._pending[rid] = pending
        self._wake.set()
        return pending

    def _enter(self, request: EngineRequest) -> None:
        """A request whose KV was loading joins the engine (unless its client left)."""
        if request.request_id in self._pending:
            self.engine.submit(request, self._now())
            self._wake.set()

    def _abandon(self, pending: _Pending) -> None:
        """The client went away before the end: drop the request from the engine."""
        if pending.done.done():
            return
        self._pending.pop(pending.rid, None)
        self._streams.discard(pending)
        self.engine.abort(pending.rid, self._now())
        self._wake.set()

    def _check_model(self, model: str) -> None:
        if model != self.config.model and model not in self._adapters:
            raise ApiError(404, f"The model `{model}` does not exist.", "model")

    # -- handlers --------------------------------------------------------------------------

    def _api(self, api: Api) -> Handler:
        async def handle(request: web.Request) -> web.StreamResponse:
            self.requests_received += 1
            if self.sleep_level is not None:  # the emulator's choice: vLLM's is not defined
                raise ApiError(503, "the engine is sleeping (POST /wake_up)")
            body = openai.load_json(await request.read())
            gen = openai.parse_generation(api, body, self.config.model)
            self._check_model(gen.model)
            pending = self._submit(
                gen.model, gen.prompt, gen.max_tokens, gen.stream, _ID_PREFIX[api], body, api
            )
            try:
                if gen.stream:
                    return await self._stream(request, gen, pending)
                await pending.done
                first = pending.first.result()
                use = self._usage(gen.api, pending, first.cached_tokens)
                if gen.api is Api.MESSAGES:
                    body_out = anthropic.message_body(pending.rid, gen.model, pending.text, use)
                else:
                    body_out = openai.completion_body(
                        gen.api, pending.rid, int(time.time()), gen.model, pending.text, use
                    )
                return web.json_response(body_out)
            finally:
                self._abandon(pending)

        return handle

    def _usage(self, api: Api, p: _Pending, cached: int) -> dict[str, Any]:
        if api is Api.MESSAGES:
            return anthropic.usage(p.prompt_tokens, p.max_tokens, cached)
        if api is Api.RESPONSES:
            return openai.responses_usage(p.prompt_tokens, p.max_tokens, cached)
        return openai.usage(p.prompt_tokens, p.max_tokens, cached)

    async def _stream(
        self, request: web.Request, gen: openai.Generation, p: _Pending,
        completed: Callable[[dict[str, Any]], None] | None = None,
    ) -> web.StreamResponse:  # fmt: skip
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        try:
            await self._stream_events(resp, gen, p, completed)
        except (ConnectionResetError, ApiError) as exc:
            # The client left (the caller then aborts the request) or the server stops.
            log.debug("stream %s ended early: %s", p.rid, exc)
        return resp

    async def _stream_events(
        self, resp: web.StreamResponse, gen: openai.Generation, p: _Pending,
        completed: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:  # fmt: skip
        """``completed`` is told of a Responses stream's final response object before it is
        sent (the response store keeps it)."""
        created = int(time.time())
        responses = gen.api is Api.RESPONSES
        messages = gen.api is Api.MESSAGES
        if messages:
            await resp.write(anthropic.stream_start(p.rid, gen.model, p.prompt_tokens))
        if responses:
            head = openai.responses_body(p.rid, created, gen.model, "", "in_progress", None)
            await resp.write(
                openai.sse({"type": "response.created", "response": head}, "response.created")
            )
        self._streams.add(p)
        sent = 0
        try:
            while True:
                await p.progress.wait()
                p.progress.clear()
                finished = p.done.done()
                if finished:
                    p.done.result()  # re-raise a shutdown error
                    n = p.max_tokens
                else:
                    n = self.engine.tokens_generated(p.rid, self._now()) or 0
                if n > sent:
                    piece = p.text[sent * CHARS_PER_TOKEN : n * CHARS_PER_TOKEN]
                    if sent == 0:
                        self.metrics.ttft_s.observe(
                            (self._now() - p.arrival_s) * self.config.speedup
                        )
                    await resp.write(_piece_event(gen, p.rid, created, piece, sent == 0))
                    sent = n
                if finished:
                    break
        finally:
            self._streams.discard(p)
        use = self._usage(gen.api, p, p.first.result().cached_tokens)
        if messages:
            await resp.write(anthropic.stream_end(use))
        elif responses:
            body = openai.responses_body(p.rid, created, gen.model, p.text, "completed", use)
            if completed is not None:
                completed(body)
            await resp.write(
                openai.sse({"type": "response.completed", "response": body}, "response.completed")
            )
        else:
            last = openai.stream_chunk(gen.api, p.rid, created, gen.model, "", "length", False)
            await resp.write(openai.sse(last))
            if gen.include_usage:
                await resp.write(
                    openai.sse(openai.usage_chunk(gen.api, p.rid, created, gen.model, use))
                )
            await resp.write(openai.SSE_DONE)
        await resp.write_eof()

    # -- stored Responses (simulator/emulator/responses.py) -------------------------------

    async def _create_response(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/responses`` as vLLM serves it with a response store: ``store`` (default
        true) keeps the response, ``previous_response_id`` continues a stored one (404 when
        this server holds none), ``background`` (needs ``store``) answers at once with the
        queued response and runs it; streamed or not."""
        body = openai.load_json(await request.read())
        store, background = body.get("store", True), body.get("background", False)
        for name, value in (("store", store), ("background", background)):
            if not isinstance(value, bool):
                raise ApiError(400, f"'{name}' must be a boolean", name)
        if background and not store:
            raise ApiError(400, "background can only be used when `store` is true", "background")
        previous = body.get("previous_response_id")
        history = ""
        if previous is not None:
            if not isinstance(previous, str):
                raise ApiError(400, "'previous_response_id' must be a string", "previous_response_id")
            history = self.responses.get(previous).conversation
        gen = openai.parse_generation(Api.RESPONSES, body, self.config.model)
        self._check_model(gen.model)
        prompt = history + gen.prompt
        rid = f"resp_{uuid.uuid4().hex}"  # vLLM's form: unique across servers
        pending = self._submit(gen.model, prompt, gen.max_tokens, gen.stream, body=body,
                               api=Api.RESPONSES, rid=rid)  # fmt: skip
        created = int(time.time())
        stored: StoredResponse | None = None
        if store:
            status = "queued" if background else "in_progress"
            head = openai.responses_body(rid, created, gen.model, "", status, None)
            stored = StoredResponse(head, prompt + pending.text)
            if background:  # retrievable and cancellable from now on
                self.responses.put(rid, stored)
                stored.cancel = functools.partial(self._stop, pending)

        def completed(final: dict[str, Any]) -> None:
            if stored is not None and stored.body["status"] != "cancelled":
                stored.body, stored.cancel = final, None
                self.responses.put(rid, stored)

        if background and not gen.stream:
            task = asyncio.create_task(self._run_background(gen, pending, created, completed))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return web.json_response(stored.body if stored is not None else {})
        try:
            if gen.stream:
                return await self._stream(request, gen, pending, completed)
            await pending.done
            use = self._usage(Api.RESPONSES, pending, pending.first.result().cached_tokens)
            final = openai.responses_body(rid, created, gen.model, pending.text, "completed", use)
            completed(final)
            return web.json_response(final)
        finally:
            self._abandon(pending)

    async def _run_background(
        self, gen: openai.Generation, pending: _Pending, created: int,
        completed: Callable[[dict[str, Any]], None],
    ) -> None:  # fmt: skip
        try:
            await pending.done
        except ApiError:  # cancelled, or the server stops
            return
        finally:
            self._abandon(pending)
        use = self._usage(Api.RESPONSES, pending, pending.first.result().cached_tokens)
        completed(openai.responses_body(pending.rid, created, gen.model, pending.text,
                                        "completed", use))  # fmt: skip

    def _stop(self, pending: _Pending) -> None:
        """Stop a running request (a cancelled background response): out of the engine, and
        whoever waits for it (its stream, its background task) ends."""
        self._abandon(pending)
        for fut in (pending.first, pending.done):
            if not fut.done():
                fut.set_exception(ApiError(400, "the response was cancelled"))
                fut.exception()  # nobody needs to read it
        pending.progress.set()

    async def _get_response(self, request: web.Request) -> web.StreamResponse:
        return web.json_response(self.responses.get(request.match_info["rid"]).body)

    async def _delete_response(self, request: web.Request) -> web.StreamResponse:
        rid = request.match_info["rid"]
        stored = self.responses.pop(rid)
        if stored.cancel is not None:
            stored.cancel()
        return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})

    async def _cancel_response(self, request: web.Request) -> web.StreamResponse:
        stored = self.responses.get(request.match_info["rid"])
        if stored.body["status"] not in CANCELLABLE:
            raise ApiError(400, "Cannot cancel a synchronous response.", "response_id")
        stored.body = {**stored.body, "status": "cancelled"}
        if stored.cancel is not None:
            stored.cancel()
            stored.cancel = None
        return web.json_response(stored.body)

    # -- for the handlers of other modules (``auxiliary``) ----------------------------------

    def check_model(self, model: str) -> str:
        """``model`` (the served model when empty); 404 for a model it does not serve."""
        model = model or self.config.model
        self._check_model(model)
        return model

    async def pool(self, model: str, texts: list[str], id_prefix: str) -> tuple[str, int]:
        """Prefill each of ``texts`` as a pooling request does (one token out); returns the
        first request's id and the prompt tokens of all."""
        pendings = [self._submit(model, text, 1, False, id_prefix) for text in texts]
        try:
            await asyncio.gather(*(p.done for p in pendings))
        finally:
            for p in pendings:
                self._abandon(p)
        return pendings[0].rid, sum(p.prompt_tokens for p in pendings)

    async def generate(self, model: str, prompt: str, max_tokens: int, id_prefix: str,
                       first: Callable[[], Awaitable[None]] | None = None) -> Generated:  # fmt: skip
        """Run one generation to its end; ``first`` is awaited when its first token is out
        (a stream's first event)."""
        p = self._submit(model, prompt, max_tokens, first is not None, id_prefix)
        try:
            if first is not None:
                await p.first
                await first()
            await p.done
        finally:
            self._abandon(p)
        return Generated(p.rid, p.text, p.prompt_tokens, max_tokens, p.first.result().cached_tokens)

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        job = openai.parse_embeddings(openai.load_json(await request.read()), self.config.model)
        self._check_model(job.model)
        rid, prompt_tokens = await self.pool(job.model, list(job.inputs), "embd-")
        data = [
            {"object": "embedding", "index": i, "embedding": openai.embedding_vector(text)}
            for i, text in enumerate(job.inputs)
        ]
        return web.json_response(
            {
                "id": rid,
                "object": "list",
                "created": int(time.time()),
                "model": job.model,
                "data": data,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            }
        )

    async def _models(self, request: web.Request) -> web.StreamResponse:
        cfg = self.config
        base = {
            "id": cfg.model,
            "object": "model",
            "created": self._created,
            "owned_by": "vllm",
            "root": cfg.model,
            "parent": None,
            "max_model_len": cfg.max_model_len,
        }
        loras = [
            {
                "id": name,
                "object": "model",
                "created": self._created,
                "owned_by": "vllm",
                "root": name,
                "parent": cfg.model,
            }
            for name in cfg.lora_adapters
        ]
        return web.json_response({"object": "list", "data": [base, *loras]})

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return web.Response(status=200)

    async def _reset_prefix_cache(self, request: web.Request) -> web.StreamResponse:
        """vLLM's dev-mode ``POST /reset_prefix_cache``: drop every cached block; refused
        (``success: false``, as vLLM does) while requests hold blocks. Counters stay."""
        self._sync()
        if self._pending:
            return web.json_response({"success": False})
        self.engine.cache.reset()
        return web.json_response({"success": True})

    async def _sleep(self, request: web.Request) -> web.StreamResponse:
        """vLLM's dev-mode ``POST /sleep?level=N`` (0-2): the KV cache is dropped (every
        level frees it), ``vllm:engine_sleep_state`` says so; requests in flight are aborted
        (vLLM's default mode)."""
        try:
            level = int(request.query.get("level", "1"))
        except ValueError:
            level = -1
        if not 0 <= level <= 2:
            raise ApiError(400, "level must be 0, 1 or 2", "level")
        self._sync()
        now = self._now()
        for p in list(self._pending.values()):
            self.engine.abort(p.rid, now)
            for fut in (p.first, p.done):
                if not fut.done():
                    fut.set_exception(ApiError(503, "the engine went to sleep"))
            p.progress.set()
        self._pending.clear()
        self._streams.clear()
        self.sleep_level = level
        self.engine.cache.reset()
        return web.json_response({"status": "sleeping", "level": level})

    async def _wake_up(self, request: web.Request) -> web.StreamResponse:
        self.sleep_level = None
        return web.json_response({"status": "awake", "tags": None})

    async def _is_sleeping(self, request: web.Request) -> web.StreamResponse:
        return web.json_response({"is_sleeping": self.sleep_level is not None})

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self._sync()
        page = generate_latest(self.registry)
        names = request.query.getall("name[]", [])
        if names:  # only those families, as vLLM's page (Prometheus' client) does
            page = restrict_page(page, set(names))
        return web.Response(body=page, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _piece_event(gen: openai.Generation, rid: str, created: int, piece: str, first: bool) -> bytes:
    """A stream's event carrying the next ``piece`` of generated text, in the API's shape."""
    if gen.api is Api.MESSAGES:
        return anthropic.stream_text(piece)
    if gen.api is Api.RESPONSES:
        delta = {
            "type": "response.output_text.delta",
            "item_id": f"msg_{rid}",
            "output_index": 0,
            "content_index": 0,
            "delta": piece,
        }
        return openai.sse(delta, "response.output_text.delta")
    return openai.sse(openai.stream_chunk(gen.api, rid, created, gen.model, piece, None, first))


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        body = exc.body()
        if request.path in ("/v1/messages", "/v1/messages/count_tokens"):  # as vLLM translates its errors
            body = {"type": "error", "error": {"type": body["error"]["type"], "message": exc.message}}
        return web.json_response(body, status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        body = ApiError(exc.status, exc.reason).body()
        return web.json_response(body, status=exc.status)


@dataclass(slots=True)
class RunningEmulator:
    """A started emulator: ``url`` is ``http://host:port`` with the bound port."""

    url: str
    host: str
    port: int
    emulator: Emulator
    _runner: web.AppRunner

    async def close(self) -> None:
        await self.emulator.stop()
        await self._runner.cleanup()


async def start_emulator(config: EmulatorConfig) -> RunningEmulator:
    """Serve one emulated replica on ``config.host:config.port`` (0 = any free port)."""
    emulator = Emulator(config)
    runner = web.AppRunner(emulator.app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    emulator.start()
    if config.kv_events:
        topic = config.kv_events_topic or f"kv@{host}:{port}@{config.model}"
        emulator.publish_events(config.kv_events, topic, config.kv_events_replay)
    url_host = f"[{host}]" if ":" in host else host
    log.info("emulator for %s listening on %s:%d", config.model, host, port)
    return RunningEmulator(f"http://{url_host}:{port}", host, port, emulator, runner)
