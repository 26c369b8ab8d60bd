"""The gRPC face of ext_proc: ``envoy.service.ext_proc.v3.ExternalProcessor/Process``.

One call per HTTP request. Messages go to a ``RequestStream``; its replies go back in order.
A client that cancels either raises ``CancelledError`` into the generator or (grpc.aio does
this) simply ends the request iterator; either way ``finally`` closes the request so nothing
stays counted in flight.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from epp.extproc.stream import BodyBudget, ProtocolError, RequestStream
from epp.request.parse import RequestParser
from epp.requestcontrol.director import Director
from epp.requestcontrol.response import DEFAULT_LIMITS, ResponseLimits

log = logging.getLogger(__name__)


class ExtProcService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        parser: RequestParser,
        director: Director,
        default_mode: int,
        budget: BodyBudget | None = None,
        limits: ResponseLimits = DEFAULT_LIMITS,
    ) -> None:
        self._parser = parser
        self._limits = limits
        self._director = director
        self._default_mode = default_mode
        self.budget = budget if budget is not None else BodyBudget()
        self.open_streams = 0

    async def Process(self, request_iterator: Any, context: Any) -> None:
        """One ext_proc stream, with the servicer context's ``read`` / ``write`` (cheaper in
        grpc.aio than an async generator of replies; the request iterator is unused)."""
        stream = RequestStream(
            self._parser, self._director, self._default_mode, self.budget, self._limits
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
                stream.check_complete()
            except ProtocolError as exc:
                log.info("ext_proc stream ended for a protocol error: %s", exc)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        finally:
            self.open_streams -= 1
            stream.close()


def add_to_server(service: ExtProcService, server: Any) -> None:
    pb_grpc.add_ExternalProcessorServicer_to_server(service, server)
