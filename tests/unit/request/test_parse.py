from __future__ import annotations

import json
import random

import pytest

from epp.errors import BadRequest, NotFound, PayloadTooLarge
from epp.framework.request import ApiKind
from epp.request.parse import CONTROL_HEADERS, RequestParser, api_for_path
from epp.request.settings import ModelTarget, RequestControlConfig

H = {"x-request-id": "r1"}


def parser(trust: bool = False, **kw: object) -> RequestParser:
    return RequestParser(RequestControlConfig(**kw), rng=random.Random(1), trust_control_headers=trust)  # type: ignore[arg-type]


def body(**doc: object) -> bytes:
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("path", "doc", "api", "prompt_has"),
    [
        ("/v1/completions", {"model": "m", "prompt": "hello"}, ApiKind.COMPLETIONS, "hello"),
        ("/v1/completions?x=1", {"model": "m", "prompt": ["a", "b"]}, ApiKind.COMPLETIONS, "b"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, ApiKind.CHAT, "hi"),
        ("/v1/responses", {"model": "m", "input": "q", "instructions": "sys"}, ApiKind.RESPONSES, "q"),
        ("/v1/embeddings", {"model": "m", "input": ["e1", "e2"]}, ApiKind.EMBEDDINGS, "e2"),
    ],
)
def test_each_api_parses(path: str, doc: dict[str, object], api: ApiKind, prompt_has: str) -> None:
    parsed = parser().parse(path, H, json.dumps(doc).encode())
    r = parsed.request
    assert (r.api, r.model, r.request_id, r.adapter) == (api, "m", "r1", "m")
    assert prompt_has in r.prompt
    assert not parsed.body_rewritten


@pytest.mark.parametrize(
    ("raw", "error", "words"),
    [
        (b"{", BadRequest, "not valid JSON"),
        (b"[]", BadRequest, "JSON object"),
        (body(prompt="x"), BadRequest, "missing 'model'"),
        (body(model="", prompt="x"), BadRequest, "'model' must be"),
        (body(model=3, prompt="x"), BadRequest, "'model' must be"),
        (body(model="m"), BadRequest, "missing 'prompt'"),
        (body(model="m", prompt={"a": 1}), BadRequest, "'prompt' must be"),
        (body(model="m", prompt="x", cache_salt=5), BadRequest, "cache_salt"),
        (b'{"model":"m","prompt":"\xe2\x82"}', BadRequest, "UTF-8"),
    ],
)
def test_bad_bodies_say_what_is_wrong(raw: bytes, error: type[Exception], words: str) -> None:
    with pytest.raises(error, match=words):
        parser().parse("/v1/completions", H, raw)


@pytest.mark.parametrize(("raw", "param"), [
    (body(prompt="x"), "model"),
    (body(model="", prompt="x"), "model"),
    (body(model="m", prompt="x", cache_salt=5), "cache_salt"),
])  # fmt: skip
def test_a_bad_model_or_salt_names_its_field_as_openai_param(raw: bytes, param: str) -> None:
    """As the model router's 404 does (``error.param``), for every API."""
    with pytest.raises(BadRequest) as caught:
        parser().parse("/v1/completions", H, raw)
    assert caught.value.param == param


def test_unknown_path_is_not_found_and_size_cap_applies() -> None:
    p = parser(max_body_bytes=10)
    with pytest.raises(NotFound, match="/v9/x"):
        p.check_headers("/v9/x?secret=1", {})
    with pytest.raises(PayloadTooLarge, match="10 bytes"):
        p.check_headers("/v1/completions", {"content-length": "11"})
    with pytest.raises(PayloadTooLarge):
        p.parse("/v1/completions", H, body(model="m", prompt="way too long"))
    assert api_for_path("/v1/chat/completions/") is ApiKind.CHAT


def test_rewrite_header_wins_over_table_and_body_is_reserialized() -> None:
    p = parser(trust=True, model_rewrites={"m": (ModelTarget("table"),)})
    parsed = p.parse("/v1/completions", {"x-gateway-model-name-rewrite": "hdr"}, body(model="m", prompt="ü"))
    assert parsed.request.model == "hdr" and parsed.request.original_model == "m"
    assert json.loads(parsed.body) == {"model": "hdr", "prompt": "ü"}
    parsed = p.parse("/v1/completions", {}, body(model="m", prompt="x"))
    assert parsed.request.model == "table" and parsed.body_rewritten


def test_weighted_rewrite_split_follows_weights() -> None:
    p = parser(model_rewrites={"m": (ModelTarget("a", 90), ModelTarget("b", 10))})
    picks = [p.parse("/v1/completions", {}, body(model="m", prompt="x")).request.model for _ in range(2000)]
    assert 0.85 < picks.count("a") / len(picks) < 0.95


def test_priority_from_objective_header_then_model_config() -> None:
    p = RequestParser(
        RequestControlConfig(model_priorities={"batch": -1}, objective_priorities={"gold": 7}),
        trust_control_headers=True,
    )
    def get(hdrs, model):
        return p.parse("/v1/completions", hdrs, body(model=model, prompt="x")).request.priority
    assert get({"x-gateway-inference-objective": "gold"}, "batch") == 7
    assert get({"x-gateway-inference-objective": "unknown"}, "batch") == -1
    assert get({}, "other") == 0
    p.set_objective_lookup(lambda name: -5 if name == "dyn" else None)
    assert get({"x-gateway-inference-objective": "dyn"}, "other") == -5
    # llm-d's name, and it wins over the x-gateway- alias when both come
    assert get({"x-llm-d-inference-objective": "dyn"}, "other") == -5
    assert get({"x-llm-d-inference-objective": "dyn", "x-gateway-inference-objective": "gold"},
               "other") == -5


def test_base_model_is_not_an_adapter_and_stream_salt_are_read() -> None:
    p = parser(base_models=frozenset({"base"}))
    r = p.parse("/v1/completions", {}, body(model="base", prompt="x", stream=True, cache_salt="s")).request
    assert (r.adapter, r.stream, r.cache_salt) == ("", True, "s")


def test_headers_only_request() -> None:
    r = parser().headers_only("/v1/models", {"x-request-id": "q"})
    assert (r.api, r.prompt, r.request_id) == (ApiKind.NONE, "", "q")


def test_control_headers_from_untrusted_clients_are_ignored() -> None:
    p = parser(model_priorities={"m": 3}, objective_priorities={"gold": 9})
    hdrs = {"x-gateway-model-name-rewrite": "stolen", "x-gateway-inference-objective": "gold",
            "x-llm-d-inference-objective": "gold", "x-epp-explain": "1"}
    r = p.parse("/v1/completions", hdrs, body(model="m", prompt="x")).request
    assert (r.model, r.priority) == ("m", 3)
    assert not p.explains(hdrs)  # the pick's reason names the pool: only a trusted proxy asks
    assert set(CONTROL_HEADERS) == set(hdrs)  # all of them are stripped before forwarding
    assert p.headers_only("/v1/models", hdrs).model == ""


# --- hostile clients: every odd body is a clear 400, never a 500 ---------------------------


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b'{"model":"m","prompt":' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (b'{"model":"m","prompt":"\\ud800"}', "lone surrogate"),
        (b'{"model":"\\udfff","prompt":"x"}', "lone surrogate"),
        (b'{"model":"m","prompt":"x","cache_salt":"\\ud800"}', "lone surrogate"),
        (b'{"model":"m","prompt":"x","max_tokens":' + b"9" * 5000 + b"}", "not usable JSON"),
        (b'{"model":"m","prompt":[' + b"1" * 5000 + b"]}", "not usable JSON"),
    ],
)
def test_hostile_bodies_are_bad_requests(raw: bytes, words: str) -> None:
    with pytest.raises(BadRequest, match=words):
        parser().parse("/v1/completions", H, raw)


@pytest.mark.parametrize("length", ["abc", "²", "-1", "1" * 40, "1e3", " "])
def test_content_length_that_is_not_a_number_is_a_bad_request(length: str) -> None:
    with pytest.raises(BadRequest, match="content-length"):
        parser().check_headers("/v1/completions", {"content-length": length})


def test_compressed_body_is_refused_by_name_not_as_bad_utf8() -> None:
    with pytest.raises(BadRequest, match="content-encoding 'gzip'"):
        parser().check_headers("/v1/completions", {"content-encoding": "gzip"})


def test_long_paths_and_ids_are_cut_in_messages() -> None:
    with pytest.raises(NotFound) as info:
        parser().check_headers("/" + "a" * 200_000, {})
    assert len(info.value.message) < 400
    r = parser().headers_only("/v1/models", {"x-request-id": "i" * 100_000})
    assert len(r.request_id) == 256


@pytest.mark.parametrize(
    ("raw", "expect"),
    [
        # documents orjson refuses and the standard library reads: still accepted, as is
        (b'{"model":"m","prompt":"x","temperature":NaN}', "nan"),
        (b'{"model":"m","prompt":"x","top_p":1e400}', "inf"),
    ],
)
def test_what_the_standard_library_accepts_stays_accepted(raw: bytes, expect: str) -> None:
    parsed = parser().parse("/v1/completions", H, raw)
    assert parsed.request.prompt == "x" and parsed.body == raw
    assert expect in repr(parsed.request.body)


def test_a_rewritten_body_keeps_integers_beyond_64_bits_exact() -> None:
    big = 2**70 + 1
    p = parser(model_rewrites={"m": (ModelTarget("served"),)})
    parsed = p.parse("/v1/completions", H, body(model="m", prompt="x", seed=big))
    assert json.loads(parsed.body) == {"model": "served", "prompt": "x", "seed": big}


def test_a_body_in_another_unicode_encoding_is_refused() -> None:
    with pytest.raises(BadRequest, match="UTF-8"):
        parser().parse("/v1/completions", H, json.dumps({"model": "m", "prompt": "x"}).encode("utf-16"))


@pytest.mark.parametrize("path", [
    "/v1/responses/resp_1", "/v1/responses/resp_1/cancel", "/v1/responses/resp_1/input_items?limit=2",
    "/v1/conversations", "/v1/conversations/conv_1/items",
])  # fmt: skip
def test_a_stored_object_path_is_routed_with_its_body_as_it_came(path: str) -> None:
    """A stored response or conversation (cancel sent with a body, a conversation created):
    routed by load (and by the response-affinity filter), the body never parsed."""
    raw = b'{"anything": [1, 2'  # not even JSON: the model server judges it
    parsed = parser().parse(path, {":path": path, ":method": "POST", **H}, raw)
    assert (parsed.request.api, parsed.request.prompt, parsed.body) == (ApiKind.NONE, "", raw)
    assert parser().headers_only(path, {":method": "POST"}).api is ApiKind.NONE
    with pytest.raises(PayloadTooLarge):
        parser(max_body_bytes=4).parse(path, H, raw)


@pytest.mark.parametrize("path", ["/v1/responses/a/b", "/v1/responses/a/cancel/x", "/v1/conversationsx"])
def test_other_paths_under_the_stored_apis_stay_unknown(path: str) -> None:
    with pytest.raises(NotFound):
        parser().check_headers(path, {})


@pytest.mark.parametrize(
    ("path", "raw", "model"),
    [
        ("/v1/chat/completions", body(model="m", messages=[{"role": "user", "content": "hi"}]), "m"),
        ("/v1/messages", body(model="claude-ish", max_tokens=4, messages="not checked here"), "claude-ish"),
        ("/generate", body(text="hi", lora_path="sql-lora"), "sql-lora"),
        ("/generate", body(text="hi"), ""),
        ("/v1/responses/resp_1", b"", ""),
    ],
)
def test_model_of_reads_the_model_without_the_prompt(path: str, raw: bytes, model: str) -> None:
    headers = {**H, ":method": "GET" if path.startswith("/v1/responses/") else "POST"}
    assert parser().model_of(path, headers, raw) == model


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", body(prompt="no model"), "model"),
        ("/v1/completions", body(model=7, prompt="x"), "model"),
    ],
)
def test_model_of_refuses_a_bad_model_as_parse_does(path: str, raw: bytes, param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parser().model_of(path, {**H, ":method": "POST"}, raw)
    assert caught.value.param == param
    with pytest.raises(BadRequest):
        parser().model_of(path, {**H, ":method": "POST"}, b"[1, 2]")
