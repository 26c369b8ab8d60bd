"""The response summary over a real grpc.aio server (epp.extproc.summary): the routing stream
stops after a streamed answer's first bytes once the proxy's access log reaches epp, and the
access log entry ends the request with its usage. Driven with the messages Envoy sends; the
same through real Envoy is tests/envoy/test_summary.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc

from epp.extproc.summary import SUMMARY_METADATA, USAGE_NAMESPACE, TokenUsage
from tests.integration import envoy_client as ec
from tests.integration.extproc_fixtures import Epp, start_epp, stop_epp

# a chat completions stream: a legacy /v1/completions one is read to its end (Envoy's usage
# filter does not recognise its chunks)
BODY = json.dumps({"model": "m", "stream": True,
                   "messages": [{"role": "user", "content": "the summary " * 100}]}).encode()
CHAT = "/v1/chat/completions"
BUFFERED = (ec.BUFFERED, ec.STREAMED)
SSE = "text/event-stream"


@pytest.fixture
async def epp() -> AsyncIterator[Epp]:
    e = await start_epp()
    yield e
    await stop_epp(e)


def event(text: str) -> bytes:
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def routed(epp: Epp, declared: bool = True) -> tuple[ec.Stream, str, str]:
    """A request routed on a stream declaring the summary: (stream, destination, token)."""
    s = ec.Stream(epp.channel, [SUMMARY_METADATA] if declared else None)
    await s.send(ec.request_headers(CHAT, modes=BUFFERED))
    await s.recv()
    await s.send(ec.request_body(BODY, True))
    reply = await s.recv()
    fields = reply.dynamic_metadata.fields
    token = fields["epp"].struct_value.fields["token"].string_value if "epp" in fields else ""
    dest = ec.destination(reply)
    assert dest is not None
    return s, dest, token


def entry(token: str, *, prompt: int = 0, cached: int | None = None, completion: int = 0,
          left: bool = False) -> als_pb2.StreamAccessLogsMessage:  # fmt: skip
    """One access log message of one entry, as Envoy's http_grpc logger writes it."""
    msg = als_pb2.StreamAccessLogsMessage()
    msg.identifier.log_name = "epp-response-summary"
    e = msg.http_logs.log_entry.add()
    e.response.response_code.value = 200
    e.response.response_body_bytes = 1234
    common = e.common_properties
    common.metadata.filter_metadata["epp"].fields["token"].string_value = token
    common.response_flags.downstream_connection_termination = left
    if prompt or completion:
        usage = TokenUsage()
        usage.input_tokens.value = prompt
        usage.output_tokens.value = completion
        if cached is not None:
            usage.input_token_details.cached_tokens.value = cached
        typed = common.metadata.typed_filter_metadata[USAGE_NAMESPACE]
        typed.type_url = "type.googleapis.com/envoy.data.ai.v3.TokenUsage"
        typed.value = usage.SerializeToString()
    return msg


async def log(epp: Epp, *messages: als_pb2.StreamAccessLogsMessage) -> None:
    call = als_pb2_grpc.AccessLogServiceStub(epp.channel).StreamAccessLogs()
    for m in messages:
        await call.write(m)
    await call.done_writing()
    await call  # the server has read every entry


async def stream_to_end(s: ec.Stream, events: int) -> None:
    await s.send(ec.response_headers(content_type=SSE))
    await s.recv()
    for i in range(events):
        await s.send(ec.response_body(event(f" w{i}"), i == events - 1))
        await s.recv()
    assert await s.close() == grpc.StatusCode.OK


async def test_a_stream_that_does_not_declare_the_summary_gets_no_token(epp: Epp) -> None:
    s, _, token = await routed(epp, declared=False)
    assert token == ""
    s.call.cancel()


async def test_answers_are_read_to_the_end_until_the_access_log_reaches_epp(epp: Epp) -> None:
    handoff = epp.handle.service.handoff
    assert handoff is not None
    s, dest, token = await routed(epp)
    assert token
    await stream_to_end(s, 5)  # no entry of this replica's yet: read it all
    assert handoff.handed_over == 0 and epp.handle.datastore.in_flight()[dest] == 0
    await log(epp, entry(token))  # its entry comes after the end: nothing waits for it
    assert handoff.summarized_here == 0 and handoff.summaries_live(handoff._clock())


async def test_a_streamed_answer_ends_its_stream_after_the_first_bytes_and_the_log_ends_it(
    epp: Epp,
) -> None:
    handoff = epp.handle.service.handoff
    assert handoff is not None
    first, _, first_token = await routed(epp)
    await stream_to_end(first, 2)
    await log(epp, entry(first_token))  # the access log reaches this replica
    s, dest, token = await routed(epp)
    await s.send(ec.response_headers(content_type=SSE))
    await s.recv()
    await s.send(ec.response_body(event(" first"), False))
    reply = await s.recv()
    assert reply.WhichOneof("response") == "response_body"
    assert await s.call.read() is grpc.aio.EOF  # epp ended the stream: Envoy goes on alone
    assert await s.call.code() == grpc.StatusCode.OK
    assert handoff.handed_over == 1
    assert epp.handle.datastore.in_flight()[dest] == 1  # until the access log says it ended
    await log(epp, entry(token, prompt=300, cached=256, completion=40))
    assert epp.handle.datastore.in_flight()[dest] == 0
    assert handoff.summarized_here == 1 and len(handoff) == 0
    reg = epp.handle.registry
    assert reg.get_sample_value("epp_usage_prompt_tokens_total", {"model": "m"}) == 300
    assert reg.get_sample_value("epp_usage_cached_tokens_total", {"model": "m"}) == 256
    assert reg.get_sample_value("epp_usage_completion_tokens_total", {"model": "m"}) == 40
    # both answers' first bytes: the second one's before its stream ended
    assert reg.get_sample_value("epp_time_to_first_token_seconds_count", {"model": "m"}) == 2


async def test_a_client_that_left_after_the_first_bytes_is_released_as_cancelled(epp: Epp) -> None:
    handoff = epp.handle.service.handoff
    assert handoff is not None
    first, _, first_token = await routed(epp)
    await stream_to_end(first, 1)
    await log(epp, entry(first_token))
    s, dest, token = await routed(epp)
    await s.send(ec.response_headers(content_type=SSE), ec.response_body(event(" a"), False))
    await s.recv_n(2)
    assert await s.call.read() is grpc.aio.EOF
    await log(epp, entry(token, left=True))
    assert epp.handle.datastore.in_flight()[dest] == 0 and len(handoff) == 0
    reg = epp.handle.registry
    assert reg.get_sample_value("epp_requests_total", {"model": "m", "status": "cancelled"}) == 1


async def test_json_answers_and_errors_are_read_to_the_end(epp: Epp) -> None:
    handoff = epp.handle.service.handoff
    assert handoff is not None
    first, _, first_token = await routed(epp)
    await stream_to_end(first, 1)
    await log(epp, entry(first_token))
    for status, content_type in ((200, "application/json"), (500, SSE)):
        s, dest, _ = await routed(epp)
        await s.send(ec.response_headers(status, content_type), ec.response_body(b'{"a":', False))
        await s.recv_n(2)
        await s.send(ec.response_body(b"1}", True))
        await s.recv()
        assert await s.close() == grpc.StatusCode.OK
        assert epp.handle.datastore.in_flight()[dest] == 0
    assert handoff.handed_over == 0


async def test_an_entry_of_another_process_or_without_a_token_changes_nothing(epp: Epp) -> None:
    handoff = epp.handle.service.handoff
    assert handoff is not None
    await log(epp, entry("0123456789ab-1"), entry(""))
    assert handoff.foreign == 1 and not handoff.summaries_live(handoff._clock())


async def test_a_responses_stream_goes_unread_only_once_its_response_id_is_known(epp: Epp) -> None:
    """A stored response lives on its server: a follow-up naming it must reach that server, so
    the stream is read until its response.created event (split here over two chunks) gives
    the id, and only then left to the access log."""
    handoff = epp.handle.service.handoff
    assert handoff is not None
    first, _, first_token = await routed(epp)
    await stream_to_end(first, 2)
    await log(epp, entry(first_token))  # summaries are live on this replica
    body = json.dumps({"model": "m", "stream": True, "input": "plan a picnic " * 50}).encode()
    s = ec.Stream(epp.channel, [SUMMARY_METADATA])
    await s.send(ec.request_headers("/v1/responses", modes=BUFFERED))
    await s.recv()
    await s.send(ec.request_body(body, True))
    home = ec.destination(await s.recv())
    created = b'event: response.created\ndata: ' + json.dumps(
        {"type": "response.created", "response": {"id": "resp_summary1", "object": "response",
                                                  "status": "in_progress", "model": "m"}}).encode()  # fmt: skip
    await s.send(ec.response_headers(content_type=SSE))
    await s.recv()
    await s.send(ec.response_body(created[:40], False))  # the event cut in two
    assert (await s.recv()).WhichOneof("response") == "response_body"
    assert handoff.handed_over == 0  # the id is not known yet: still reading
    await s.send(ec.response_body(created[40:] + b"\n\n", False))
    await s.recv()
    assert await s.call.read() is grpc.aio.EOF and handoff.handed_over == 1  # now unread
    follow = json.dumps({"model": "m", "input": "and then?", "previous_response_id": "resp_summary1"})
    for _ in range(4):  # among four endpoints, every follow-up goes home
        f = ec.Stream(epp.channel)
        await f.send(ec.request_headers("/v1/responses"), ec.request_body(follow.encode(), True))
        headers, _ = await f.recv_n(2)
        assert ec.destination(headers) == home
        f.call.cancel()
