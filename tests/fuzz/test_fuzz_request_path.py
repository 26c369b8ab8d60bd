"""Property-based fuzzing of everything a client or a model server sends through ext_proc:
the request parser, the response reader, and the ext_proc state machine driven by arbitrary
message sequences. Each runs a bounded number of examples in CI (``FUZZ_EXAMPLES``, default
300); set it higher locally for a longer run.

Invariants: input never produces anything but a domain error (a clear 4xx) or a protocol
error; the in-flight count and the buffered-body budget return to zero whatever the order of
messages; the response reader forwards exactly the bytes it was given when nothing is
rewritten."""

from __future__ import annotations

import contextlib
import json
import os
import random

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from epp.config.loader import default_config
from epp.datastore.store import Datastore
from epp.errors import EppError
from epp.extproc import convert
from epp.extproc.stream import ProtocolError, RequestStream
from epp.framework.endpoint import Endpoint, Metrics, endpoint_id
from epp.observability.metrics import EppMetrics
from epp.request.parse import RequestParser
from epp.request.settings import RequestControlConfig
from epp.requestcontrol.director import Director
from epp.requestcontrol.response import BodyBudget, ResponseReader
from epp.wiring import build_scheduler
from tests.integration import envoy_client as ec

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings",
         "/v1/models", "/x", "/" + "a" * 300]  # fmt: skip

json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=5),
    max_leaves=30,
)
shaped_doc = st.fixed_dictionaries(
    {},
    optional={
        "model": st.one_of(st.text(max_size=20), json_value),
        "prompt": st.one_of(st.text(max_size=200), st.lists(st.integers(-5, 2**33), max_size=20), json_value),
        "messages": st.one_of(
            st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"])},
                                           optional={"content": json_value}), max_size=4),
            json_value,
        ),
        "input": json_value,
        "cache_salt": json_value,
        "stream": json_value,
    },
)


def body_bytes(data: st.DataObject) -> bytes:
    kind = data.draw(st.sampled_from(["doc", "raw", "mutated"]))
    if kind == "raw":
        return data.draw(st.binary(max_size=300))
    text = json.dumps(data.draw(shaped_doc), ensure_ascii=data.draw(st.booleans()))
    raw = text.encode("utf-8", "surrogatepass")
    if kind == "mutated" and raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + data.draw(st.binary(max_size=8)) + raw[i + 1 :]
    return raw


@FUZZ
@given(st.data())
def test_request_parser_answers_every_body_with_a_request_or_a_domain_error(data: st.DataObject) -> None:
    parser = RequestParser(RequestControlConfig(max_body_bytes=4096), rng=random.Random(0),
                           trust_control_headers=data.draw(st.booleans()))  # fmt: skip
    headers = data.draw(st.dictionaries(
        st.sampled_from(["content-length", "content-encoding", "x-request-id",
                         "x-gateway-model-name-rewrite", "x-gateway-inference-objective"]),
        st.text(max_size=20), max_size=3))  # fmt: skip
    path = data.draw(st.sampled_from(PATHS))
    try:
        parsed = parser.parse(path, headers, body_bytes(data))
    except EppError:
        return
    r = parsed.request
    r.prompt.encode("utf-8")  # what the hasher does next must not fail
    r.model.encode("utf-8")
    assert isinstance(r.model, str) and r.model


@FUZZ
@given(
    sse=st.booleans(),
    rewrite=st.booleans(),
    chunks=st.lists(st.one_of(
        st.binary(max_size=200),
        st.sampled_from([b"data: ", b"\n", b'data: {"usage":{"prompt_tokens":5}}\n',
                         b'{"choices":[{"text":"hi"}],"model":"served"', b"[" * 500,
                         b'"usage":{"prompt_tokens":-1,"completion_tokens":1e400}}']),
    ), max_size=12),
)  # fmt: skip
def test_response_reader_never_raises_and_forwards_what_it_got(
    sse: bool, rewrite: bool, chunks: list[bytes]
) -> None:
    reader = ResponseReader(200, sse, "served", "client" if rewrite else "")
    out = b"".join(reader.feed(c, i == len(chunks) - 1) for i, c in enumerate(chunks))
    if not chunks:
        out = reader.feed(b"", True)
    info = reader.info()
    assert info.prompt_tokens >= 0 and info.completion_tokens >= 0
    assert info.cached_tokens is None or info.cached_tokens >= 0
    if not rewrite:
        assert out == b"".join(chunks)


# --- the ext_proc state machine under arbitrary message sequences --------------------------


def _director() -> tuple[Director, Datastore, RequestParser]:
    ds = Datastore()
    eps = [Endpoint(endpoint_id(f"10.0.0.{i}", 8000), f"10.0.0.{i}", 8000) for i in range(1, 4)]
    ds.replace_all(eps)
    for e in eps:
        ds.update_metrics(e.id, Metrics(waiting=1, kv_usage=0.2, scraped_at_s=1.0))
    cfg = default_config()
    sched = build_scheduler(cfg, rng=random.Random(1))
    director = Director(ds, sched, cfg.saturation, EppMetrics(CollectorRegistry()), clock=lambda: 1.0)
    parser = RequestParser(RequestControlConfig(max_body_bytes=2048), rng=random.Random(2))
    return director, ds, parser


def message(data: st.DataObject) -> pb.ProcessingRequest:
    kind = data.draw(st.sampled_from(
        ["headers", "headers", "body", "body", "body", "req_trailers", "resp_headers",
         "resp_body", "resp_body", "resp_trailers", "empty"]))  # fmt: skip
    if kind == "headers":
        modes = data.draw(st.sampled_from([
            None, (ec.FULL_DUPLEX, ec.FULL_DUPLEX), (ec.BUFFERED, ec.BUFFERED),
            (ec.NONE, ec.NONE), (ec.STREAMED, ec.STREAMED)]))  # fmt: skip
        return ec.request_headers(
            data.draw(st.sampled_from(PATHS)), method=data.draw(st.sampled_from(["POST", "GET"])),
            end_of_stream=data.draw(st.booleans()), modes=modes,
            subset=data.draw(st.one_of(st.none(), st.lists(st.sampled_from(["10.0.0.1:8000", "1.2.3.4:1"]), max_size=2))),
        )  # fmt: skip
    if kind == "body":
        return ec.request_body(body_bytes(data), data.draw(st.booleans()))
    if kind == "req_trailers":
        return ec.request_trailers()
    if kind == "resp_headers":
        return ec.response_headers(data.draw(st.sampled_from([200, 500, 404])),
                                   data.draw(st.sampled_from(["application/json", "text/event-stream"])),
                                   data.draw(st.booleans()))  # fmt: skip
    if kind == "resp_body":
        return ec.response_body(data.draw(st.binary(max_size=100)), data.draw(st.booleans()))
    if kind == "resp_trailers":
        return ec.response_trailers()
    return pb.ProcessingRequest()


@FUZZ
@given(st.data())
def test_any_message_sequence_leaves_no_in_flight_count_and_no_buffered_bytes(data: st.DataObject) -> None:
    director, ds, parser = _director()
    budget = BodyBudget(10_000)
    streams = [RequestStream(parser, director, convert.FULL_DUPLEX_STREAMED, budget)
               for _ in range(data.draw(st.integers(1, 3)))]  # fmt: skip
    ended = [False] * len(streams)
    for _ in range(data.draw(st.integers(0, 12))):
        i = data.draw(st.integers(0, len(streams) - 1))
        if ended[i]:
            continue
        try:
            replies = streams[i].handle(message(data))
            streams[i].after_replies()
        except ProtocolError:
            ended[i] = True  # the gRPC layer aborts the stream, then closes it
            continue
        for r in replies:
            assert r.WhichOneof("response") is not None or r == pb.ProcessingResponse()
            if r.HasField("immediate_response"):  # 500 only for a proxy set to a body mode
                ir = r.immediate_response  # epp cannot work with (documented)
                assert ir.status.code != 500 or b"request_body_mode" in ir.body, r
        if data.draw(st.booleans()):  # Envoy half-closes now
            with contextlib.suppress(ProtocolError):
                streams[i].check_complete()
            ended[i] = True
    for s in streams:
        s.close()
    assert sum(ds.in_flight().values()) == 0
    assert budget.used == 0
