"""The P/D sidecar's prefill leg asks for one token: every field that constrains the output's
length or count is made consistent with that, or the server refuses the prefill (vLLM answers
400 to ``max_tokens: 1`` with ``min_tokens: 5``) and disaggregation silently never happens for
such requests. One row per field; the allow-list's entry syntax below."""

from __future__ import annotations

from typing import Any

import pytest

from epp.sidecar.proxy import parse_networks, prefill_fields

ONE_TOKEN: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # field, in the request, what the prefill leg must carry for it (None: absent)
    ("max_tokens", {"max_tokens": 100}, {"max_tokens": 1}),
    ("max_tokens absent", {}, {"max_tokens": 1}),
    ("max_completion_tokens", {"max_completion_tokens": 100}, {"max_completion_tokens": 1}),
    ("min_tokens", {"max_tokens": 100, "min_tokens": 5}, {"min_tokens": None}),
    ("n", {"n": 4}, {"n": 1}),
    ("best_of", {"best_of": 3, "n": 1}, {"best_of": None}),
    ("use_beam_search", {"use_beam_search": True, "n": 2}, {"use_beam_search": None, "n": 1}),
    ("beam_width", {"beam_width": 4}, {"beam_width": None}),
    ("length_penalty", {"length_penalty": 0.5}, {"length_penalty": None}),
    ("SGLang max_new_tokens", {"max_new_tokens": 100}, {"max_new_tokens": 1}),
    ("SGLang min_new_tokens", {"min_new_tokens": 5}, {"min_new_tokens": None}),
    ("stream", {"stream": True, "stream_options": {"include_usage": True}},
     {"stream": False, "stream_options": None}),
]


@pytest.mark.parametrize(("original", "expected"), [(o, e) for _, o, e in ONE_TOKEN],
                         ids=[name for name, _, _ in ONE_TOKEN])  # fmt: skip
def test_each_output_length_field_agrees_with_one_token(
    original: dict[str, Any], expected: dict[str, Any]
) -> None:
    body = {"model": "m", "prompt": "p", **original}
    out = prefill_fields(body)
    for key, value in expected.items():
        if value is None:
            assert key not in out, key
        else:
            assert out[key] == value, key
    assert out["max_tokens"] == 1 and out["n"] == 1 and out["stream"] is False
    assert body == {"model": "m", "prompt": "p", **original}  # the decode keeps the original
    assert out.get("min_tokens", 0) <= out["max_tokens"]


def test_sglang_sampling_params_are_made_one_token_too() -> None:
    body = {"text": "p", "sampling_params": {"max_new_tokens": 64, "min_new_tokens": 8, "n": 2,
                                             "temperature": 0.5}}  # fmt: skip
    nested = prefill_fields(body)["sampling_params"]
    assert nested == {"max_new_tokens": 1, "n": 1, "temperature": 0.5}
    assert body["sampling_params"]["min_new_tokens"] == 8


@pytest.mark.parametrize("text", ["10.0.0.0/8", "10.0.0.0/8:8000", "10.1.2.3:8000",
                                  "[fd00::/8]:8000", "fd00::/8", "127.0.0.1/32", "::1"])  # fmt: skip
def test_allow_list_entries_parse(text: str) -> None:
    assert parse_networks(text) == (text,)


@pytest.mark.parametrize("text", ["10.0.0.0/33", "10.0.0.0/8:0", "10.0.0.0/8:99999",
                                  "10.0.0.0/8:²", "[fd00::/8", "[fd00::/8]8000", "host:8000",
                                  "10.0.0.0/8:"])  # fmt: skip
def test_bad_allow_list_entries_are_named(text: str) -> None:
    with pytest.raises(ValueError, match="NETWORK"):
        parse_networks(f"10.0.0.0/8,{text}")


def test_every_generated_bootstrap_removes_the_clients_prefiller_header_first() -> None:
    """The header the sidecar obeys is one only epp sets; Envoy's first filter drops a client's
    copy (tests/envoy/test_hostile_headers.py shows it with epp down)."""
    from epp.envoyconfig import EPP_ONLY_REQUEST_HEADERS, ROUTINGS, EnvoyOptions, envoy_config
    from epp.request.parse import PREFILLER_HEADER

    assert PREFILLER_HEADER in EPP_ONLY_REQUEST_HEADERS
    for routing in ROUTINGS:
        config = envoy_config(EnvoyOptions(routing=routing, pool=("10.0.0.1:8000",)))
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        first = hcm["typed_config"]["http_filters"][0]["typed_config"]
        assert {"remove": PREFILLER_HEADER} in first["mutations"]["request_mutations"], routing
