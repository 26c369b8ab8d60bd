"""The gRPC face of ext_proc: ``envoy.service.ext_proc.v3.ExternalProcessor/Process``.

One call per HTTP request. Messages go to a ``RequestStream``; its replies go back in order.
A client that cancels either raises ``CancelledError`` into the generator or (grpc.aio does
this) simply ends the request iterator; either way ``finally`` closes the request so nothing
stays counted in flight.

Open streams are bounded (``max_open_streams``): each holds ~25 KB even idle, and nothing in
gRPC limits how many one client opens. A stream past the bound gets its first message (Envoy
sends it as it opens the stream) answered with an ImmediateResponse 503, which Envoy returns
to the client, and is ended. A stream that sends nothing within ``REFUSE_READ_S`` is ended
with nothing; while ``max(64, max_open_streams // 16)`` refusals already wait for their first
message, further streams end at once with ``RESOURCE_EXHAUSTED``, so refusing stays bounded
too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.errors import Unavailable
from epp.extproc.errors import immediate_response
from epp.extproc.observer import ResponseHandoff
from epp.extproc.stream import ProtocolError, RequestStream
from epp.extproc.summary import declared
from epp.observability.tracing import Tracing
from epp.request.parse import RequestParser
from epp.requestcontrol.director import Director
from epp.requestcontrol.response import DEFAULT_LIMITS, BodyBudget, ResponseLimits

log = logging.getLogger(__name__)

DEFAULT_MAX_OPEN_STREAMS = 20_000
"""~0.5 GB of idle streams; an HTTP request in flight through Envoy holds one stream."""
REFUSE_READ_S = 1.0
"""How long a stream past the bound may take to send its first message."""


class ExtProcService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        parser: RequestParser,
        director: Director,
        default_mode: int,
        budget: BodyBudget | None = None,
        limits: ResponseLimits = DEFAULT_LIMITS,
        max_open_streams: int = DEFAULT_MAX_OPEN_STREAMS,
        handoff: ResponseHandoff | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._parser = parser
        self._tracing = tracing
        self.handoff = handoff
        """Routed requests whose response another stream reports: an observer filter's
        (``--response-observer``) or the proxy's access log (``epp.extproc.summary``)."""
        self.max_open_streams = max_open_streams
        self.refused_streams = 0
        self._refusing = False
        self._refusals_waiting = 0
        self._limits = limits
        self._director = director
        self._default_mode = default_mode
        self.budget = budget if budget is not None else BodyBudget()
        self.response_budget = BodyBudget(limits.total_bytes)
        """Response bytes held by all streams together (``limits.total_bytes``)."""
        self.open_streams = 0

    async def Process(self, request_iterator: Any, context: Any) -> None:
        """One ext_proc stream, with the servicer context's ``read`` / ``write`` (cheaper in
        grpc.aio than an async generator of replies; the request iterator is unused)."""
        if self.open_streams >= self.max_open_streams:
            await self._refuse(context)
            return
        if self._refusing:
            self._refusing = False
            log.warning("ext_proc streams accepted again (%d open)", self.open_streams)
        stream = RequestStream(
            self._parser, self._director, self._default_mode, self.budget, self._limits,
            self.handoff, self._tracing, self.response_budget,
            declared(context.invocation_metadata()),
        )
        self.open_streams += 1
        read, write, eof = context.read, context.write, grpc.aio.EOF
        try:
            try:
                while (msg := await read()) is not eof:
                    for reply in stream.handle(msg):
                        await write(reply)
                    if (held := stream.awaiting) is not None:
                        error = await self._director.admit_held(held)
                        for reply in stream.resume(error):
                            await write(reply)
                    stream.after_replies()  # the replies are on the wire
                    if stream.ended:  # Envoy goes on without epp (epp.extproc.summary)
                        break
                stream.check_complete()
            except ProtocolError as exc:
                log.info("ext_proc stream ended for a protocol error: %s", exc)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finally:
            self.open_streams -= 1
            stream.close()

    async def _refuse(self, context: Any) -> None:
        self.refused_streams += 1
        if not self._refusing:
            self._refusing = True
            log.warning(
                "%d ext_proc streams open, the most epp holds (--max-open-streams): new ones "
                "are answered 503 until some end", self.open_streams,
            )  # fmt: skip
        self._director.answered(None, "", 503, "max-open-streams")
        message = f"epp has {self.open_streams} requests open, the most it holds; retry shortly"
        if self._refusals_waiting >= max(64, self.max_open_streams // 16):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
        self._refusals_waiting += 1
        try:
            async with asyncio.timeout(REFUSE_READ_S):
                first = await context.read()
        except TimeoutError:
            return
        finally:
            self._refusals_waiting -= 1
        if first is not grpc.aio.EOF:
            await context.write(immediate_response(Unavailable(message)))


def add_to_server(service: ExtProcService, server: Any) -> None:
    pb_grpc.add_ExternalProcessorServicer_to_server(service, server)
