"""Reading Envoy's access log entries (epp.extproc.summary)."""

from __future__ import annotations

from envoy.data.accesslog.v3 import accesslog_pb2

from epp.extproc.summary import USAGE_NAMESPACE, TokenUsage, declared, summary_of

USAGE_TYPE = "type.googleapis.com/envoy.data.ai.v3.TokenUsage"


def entry(token: str = "t-1", usage: bytes | None = None, **flags: bool) -> accesslog_pb2.HTTPAccessLogEntry:
    e = accesslog_pb2.HTTPAccessLogEntry()
    e.response.response_code.value = 200
    e.response.response_body_bytes = 777
    md = e.common_properties.metadata
    if token:
        md.filter_metadata["epp"].fields["token"].string_value = token
    for name, value in flags.items():
        setattr(e.common_properties.response_flags, name, value)
    if usage is not None:
        md.typed_filter_metadata[USAGE_NAMESPACE].type_url = USAGE_TYPE
        md.typed_filter_metadata[USAGE_NAMESPACE].value = usage
    return e


def usage(prompt: int, completion: int, cached: int | None = None) -> bytes:
    u = TokenUsage()
    u.input_tokens.value, u.output_tokens.value = prompt, completion
    if cached is not None:
        u.input_token_details.cached_tokens.value = cached
    return u.SerializeToString()  # type: ignore[no-any-return]


def test_an_entry_gives_its_token_status_bytes_and_usage() -> None:
    token, info = summary_of(entry(usage=usage(300, 40, 256)))
    assert token == "t-1" and info is not None
    assert (info.status, info.response_bytes) == (200, 777)
    assert (info.prompt_tokens, info.cached_tokens, info.completion_tokens) == (300, 256, 40)
    assert info.generated_text == "" and info.ttft_s is None


def test_usage_without_cached_tokens_reads_as_not_reported() -> None:
    _, info = summary_of(entry(usage=usage(300, 40)))
    assert info is not None and info.cached_tokens is None


def test_an_entry_without_usage_or_with_a_broken_one_still_ends_the_exchange() -> None:
    for raw in (None, b"\xff\xff\xff"):
        token, info = summary_of(entry(usage=raw))
        assert token == "t-1" and info is not None and info.completion_tokens == 0


def test_an_exchange_that_ended_early_has_no_outcome() -> None:
    for flag in ("downstream_connection_termination", "upstream_remote_reset"):
        assert summary_of(entry(**{flag: True})) == ("t-1", None)


def test_an_entry_without_epps_token_is_not_epps() -> None:
    assert summary_of(entry(token="")) == ("", None)


def test_the_declaration_is_one_exact_metadata_pair() -> None:
    assert declared((("x-epp-response", "summary"), ("user-agent", "envoy")))
    assert not declared((("x-epp-response", "full"),)) and not declared(None)
