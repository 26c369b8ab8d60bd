"""Every API epp understands, through the request parser: what it keys, what it routes by load,
what it refuses."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from epp.errors import BadRequest, ConfigError, NotFound
from epp.framework.request import ApiKind
from epp.request.apis import BUILTIN, LoadRoutedApi
from epp.request.flatten import completion_prompt
from epp.request.multipart import MAX_PARTS, read_form
from epp.request.native import sglang_generate_prompt, vllm_generate_prompt
from epp.request.parse import RequestParser
from epp.request.settings import ModelTarget, RequestControlConfig, parse_request_control

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def parser(**kw: Any) -> RequestParser:
    return RequestParser(RequestControlConfig(**kw), rng=random.Random(1))


def form(fields: dict[str, str], file: bytes = b"RIFF....WAVEfmt " + bytes(range(256)) * 8,
         boundary: str = "----b0undary") -> tuple[bytes, str]:  # fmt: skip
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
             f"Content-Type: audio/wav\r\n\r\n".encode() + file + b"\r\n"]  # fmt: skip
    for name, value in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


KEYED = [
    ("/v1/completions", {"model": "m", "prompt": "hello"}, ApiKind.COMPLETIONS),
    ("/v1/chat/completions", CHAT, ApiKind.CHAT),
    ("/v1/responses", {"model": "m", "input": "q"}, ApiKind.RESPONSES),
    ("/v1/embeddings", {"model": "m", "input": "e"}, ApiKind.EMBEDDINGS),
    ("/v1/messages", MESSAGES, ApiKind.MESSAGES),
    ("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}}, ApiKind.GENERATE),
    ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {}}, ApiKind.GENERATE),
    ("/inference/v1/generate", {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}, ApiKind.GENERATE),
]
LOAD_ROUTED = [
    ("/v1/messages/count_tokens", MESSAGES),
    ("/tokenize", {"model": "m", "prompt": "hello"}),
    ("/detokenize", {"model": "m", "tokens": [1, 2]}),
    ("/v1/rerank", {"model": "m", "query": "q", "documents": ["a", "b"]}),
    ("/v2/rerank", {"model": "m", "query": "q", "documents": ["a"]}),
    ("/rerank", {"model": "m", "query": "q", "documents": ["a"]}),
    ("/v1/score", {"model": "m", "text_1": "a", "text_2": "b"}),
    ("/score", {"model": "m", "text_1": "a", "text_2": "b"}),
    ("/pooling", {"model": "m", "input": "a"}),
    ("/classify", {"model": "m", "input": "a"}),
    ("/v2/embed", {"model": "m", "texts": ["a"], "input_type": "search_query"}),
    ("/encode", {"model": "m", "text": "a"}),
]


@pytest.mark.parametrize(("path", "doc", "api"), KEYED)
def test_keyed_apis_parse_with_a_key(path: str, doc: dict[str, Any], api: ApiKind) -> None:
    r = parser().parse(path, {}, json.dumps(doc).encode()).request
    assert r.api is api and r.prompt


@pytest.mark.parametrize(("path", "doc"), LOAD_ROUTED)
def test_auxiliary_apis_are_routed_by_load_and_model_never_keyed(path: str, doc: dict[str, Any]) -> None:
    r = parser(base_models=frozenset({"base"})).parse(path, {}, json.dumps(doc).encode()).request
    assert (r.api, r.prompt, r.model, r.adapter) == (ApiKind.AUXILIARY, "", "m", "m")


@pytest.mark.parametrize("path", ["/v1/audio/transcriptions", "/v1/audio/translations"])
def test_audio_uploads_are_read_as_forms_for_their_model(path: str) -> None:
    raw, ctype = form({"model": "whisper", "language": "en"})
    r = parser().parse(path, {"content-type": ctype}, raw).request
    assert (r.api, r.model, r.prompt, r.body) == (ApiKind.AUXILIARY, "whisper", "", None)


def test_a_rewritten_form_model_replaces_only_its_bytes() -> None:
    raw, ctype = form({"model": "whisper", "language": "en"})
    p = parser(model_rewrites={"whisper": (ModelTarget("whisper-large-v3"),)})
    parsed = p.parse("/v1/audio/transcriptions", {"content-type": ctype}, raw)
    assert parsed.body_rewritten and parsed.request.original_model == "whisper"
    assert parsed.body == raw.replace(b"\r\n\r\nwhisper\r\n", b"\r\n\r\nwhisper-large-v3\r\n")
    assert read_form(parsed.body, ctype).fields["model"] == "whisper-large-v3"


MANY_PARTS = b'--b\r\nContent-Disposition: form-data; name="f"\r\n\r\nv\r\n' * (MAX_PARTS + 1) + b"--b--"


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b"no delimiter at all", "no part"),
        (b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n", "closing boundary"),
        (b"--b\r\n" + b"X" * 20_000, "headers"),
        (MANY_PARTS, "parts"),
    ],
)
def test_malformed_forms_are_bad_requests(raw: bytes, words: str) -> None:
    with pytest.raises(BadRequest, match=words):
        read_form(raw, "multipart/form-data; boundary=b")


def test_generate_without_model_routes_as_its_lora_path_adapter() -> None:
    doc = {"text": "hello", "lora_path": "sql-adapter", "sampling_params": {}}
    r = parser().parse("/generate", {}, json.dumps(doc).encode()).request
    assert (r.model, r.adapter) == ("", "sql-adapter")
    r = parser().parse("/generate", {}, json.dumps({"text": "x"}).encode()).request
    assert (r.model, r.adapter) == ("", "")


def test_token_in_apis_key_like_token_id_completions() -> None:
    ids = list(range(100, 400))
    assert sglang_generate_prompt({"input_ids": ids}) == completion_prompt(ids)
    assert vllm_generate_prompt({"token_ids": ids}) == completion_prompt(ids)
    assert sglang_generate_prompt({"text": "a prompt"}) == "a prompt"


def test_token_in_media_are_keyed_at_their_placeholders() -> None:
    ids = list(range(100, 164))

    def key(h: str) -> str:
        features = {"mm_hashes": {"image": [h]}, "mm_placeholders": {"image": [{"offset": 16, "length": 8}]}}
        return vllm_generate_prompt({"token_ids": ids, "features": features})

    a, b = key("img-a"), key("img-b")
    assert a != b and a[:64] == b[:64] == completion_prompt(ids[:16])  # equal up to the image
    assert sglang_generate_prompt({"text": "x", "image_data": "https://x/1.png"}) != \
        sglang_generate_prompt({"text": "x", "image_data": "https://x/2.png"})  # fmt: skip


BAD_FEATURES = {"mm_hashes": {"image": ["h"]}, "mm_placeholders": {"image": [{"offset": 9}]}}


@pytest.mark.parametrize(
    ("path", "doc", "field"),
    [
        ("/v1/embeddings", {"model": "m", "input": [True, False]}, "'input'"),
        ("/v1/completions", {"model": "m", "prompt": [1, False]}, "'prompt'"),
        ("/v1/messages", {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
         r"messages\[0\].content\[0\].text"),
        ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}, "missing 'model'"),
        ("/v1/messages/count_tokens", {"messages": []}, "missing 'model'"),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {}}]}, r"tools\[0\].function.name"),
        ("/generate", {"text": "x", "input_ids": [1]}, "exactly one of"),
        ("/generate", {"sampling_params": {}}, "exactly one of"),
        ("/inference/v1/generate", {"token_ids": []}, "'token_ids'"),
        ("/inference/v1/generate", {"token_ids": [1, -2]}, "'token_ids'"),
        ("/inference/v1/generate", {"token_ids": [1], "features": BAD_FEATURES}, "offset"),
        ("/tokenize", {"model": 7, "prompt": "x"}, "'model' must be"),
        ("/v1/rerank", b"{not json", "not valid JSON"),
    ],
)
def test_bodies_the_server_would_refuse_are_400_naming_the_field(path: str, doc: Any, field: str) -> None:
    raw = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    with pytest.raises(BadRequest, match=field):
        parser().parse(path, {}, raw)


@pytest.mark.parametrize("path", ["/", "/v1", "/v1/chat", "/v1/completion", "/v1/messages/x", "/generate/x",
                                  "/admin", "/v1/chat/completions/../../admin", "/%2e%2e/etc/passwd"])  # fmt: skip
def test_garbage_paths_are_still_not_found(path: str) -> None:
    with pytest.raises(NotFound, match="unknown API path"):
        parser().parse(path, {}, json.dumps(CHAT).encode())


def test_an_operator_adds_a_load_routed_path_in_config() -> None:
    config = parse_request_control({"requestControl": {"loadRoutedPaths": ["/v1/images/generations", "/custom/"]}})
    p = RequestParser(config)
    r = p.parse("/v1/images/generations", {}, b'{"model": "sd", "prompt": "a cat"}').request
    assert (r.api, r.model, r.prompt) == (ApiKind.AUXILIARY, "sd", "")
    # a body that is not JSON under a non-JSON content-type is not read: routed by load alone
    r = p.parse("/custom", {"content-type": "application/octet-stream"}, b"\x00\x01binary").request
    assert (r.api, r.model) == (ApiKind.AUXILIARY, "")
    with pytest.raises(NotFound):
        parser().parse("/v1/images/generations", {}, b'{"model": "sd"}')


@pytest.mark.parametrize(
    ("paths", "field"),
    [
        (["/v1/chat/completions"], r"loadRoutedPaths\[0\].*keyed"),
        (["no-slash"], "loadRoutedPaths"),
        (["/x?y=1"], "loadRoutedPaths"),
    ],
)
def test_load_routed_paths_that_cannot_be_are_refused_at_start(paths: list[str], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse_request_control({"requestControl": {"loadRoutedPaths": paths}})


def test_every_builtin_path_is_documented() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[3] / "docs" / "apis.md").read_text()
    missing = [p for p in BUILTIN if f"`{p}`" not in page]
    assert not missing, missing
    assert all(isinstance(api, LoadRoutedApi) == (api.kind is ApiKind.AUXILIARY) for api in BUILTIN.values())
