"""The body-based router's ext_proc stream: one per HTTP request.

    request headers --GET /v1/models[/MODEL]--> the gateway's list (immediate 200 / 404)
          |        --no body------------------> route by the trusted model header, else 404
          v  BUFFERED: reply CONTINUE; FULL_DUPLEX_STREAMED: no reply yet
    request body chunks ... end_of_stream
          |  read the model (the shared request parser) -> its pool (the catalog)
          v  set x-gateway-model-name, x-gateway-base-model-name; clear the route cache
    BUFFERED: in the body reply (the body passes unchanged);
    FULL_DUPLEX_STREAMED: in the headers reply, then the body streamed back

A model the gateway does not serve gets the OpenAI-style 404 (``error.param: model``); any
other domain error the parser raises gets its status from epp's one error table
(``epp.extproc.errors``), and a bug a 500; the stream then ignores what follows. The router
never sees responses in the bootstrap ``epp envoy-config`` makes; if a gateway sends them,
they pass unchanged.

Trust: the model comes from the body. ``x-gateway-model-name-rewrite`` names it instead only
with ``trust_control_headers`` (as in ``epp serve``, whose pool then serves that model); the
client's own ``x-gateway-model-name`` and ``x-gateway-base-model-name`` are always
overwritten, so a client cannot choose its pool.

Bounds: the body up to the parser's ``max_body_bytes`` per stream (413) and a shared
:class:`~epp.extproc.stream.BodyBudget` over all streams (503).
"""

from __future__ import annotations

import enum
import logging
import time

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from epp.envoyconfig import BASE_MODEL_HEADER, MODEL_HEADER
from epp.errors import BadRequest, EppError, NotFound, PayloadTooLarge, Unavailable
from epp.extproc import convert
from epp.extproc.errors import error_kind, immediate_response
from epp.extproc.stream import STREAMED_CHUNK_BYTES, ProtocolError
from epp.modelrouter.catalog import ModelCatalog, ModelRoute
from epp.modelrouter.listing import ModelLister
from epp.modelrouter.metrics import RouterMetrics
from epp.request.parse import MODEL_REWRITE_HEADER, RequestParser, echo
from epp.requestcontrol.response import BodyBudget

log = logging.getLogger(__name__)

MODELS_PATH = "/v1/models"
MAX_NAMES_IN_ERROR = 8
_NO_REPLY: list[pb.ProcessingResponse] = []


class ModelRouter:
    """What every stream shares: the parser, the catalog, the model list, the metrics."""

    def __init__(
        self,
        parser: RequestParser,
        catalog: ModelCatalog,
        lister: ModelLister,
        metrics: RouterMetrics,
        *,
        default_model: str = "",
        budget: BodyBudget | None = None,
    ) -> None:
        self.parser = parser
        self.catalog = catalog
        self.lister = lister
        self.metrics = metrics
        self.default_model = default_model
        """The model of a request that names none (a load-routed API without ``model``);
        '' = such a request is a 400 (unless the gateway serves one base model)."""
        self.budget = budget if budget is not None else BodyBudget()

    def route_model(self, model: str) -> ModelRoute:
        """The route of ``model`` (its pool), or the OpenAI-style 404."""
        route = self.catalog.lookup(model)
        if route is None:
            raise NotFound(f"The model {echo(model)} does not exist: this gateway serves "
                           f"{self._served()} (GET /v1/models lists them)", param="model")  # fmt: skip
        return route

    def unnamed(self, what: str) -> ModelRoute:
        """The route of a request that names no model."""
        if self.default_model:
            return self.route_model(self.default_model)
        routes = self.catalog.routes
        bases = {r.base_model for r in routes.values()}
        if len(bases) == 1:
            return routes[next(iter(bases))]
        raise BadRequest(f"{what} names no model: this gateway routes each request to the pool "
                         f"of its model ({self._served()}); set 'model'", param="model")  # fmt: skip

    def _served(self) -> str:
        names = list(self.catalog.routes)
        shown = ", ".join(names[:MAX_NAMES_IN_ERROR])
        return shown + (f" and {len(names) - MAX_NAMES_IN_ERROR} more" if len(names) > MAX_NAMES_IN_ERROR else "")

    def list_reply(self, path: str) -> pb.ProcessingResponse | None:
        """``GET /v1/models`` or ``GET /v1/models/MODEL``: the answer; None for other paths."""
        if path == MODELS_PATH:
            return convert.immediate_json(200, self.lister.body())
        if path.startswith(MODELS_PATH + "/"):
            model = path[len(MODELS_PATH) + 1 :]
            card = self.lister.card(model)
            if card is None:
                raise NotFound(f"The model {echo(model)} does not exist: this gateway serves "
                               f"{self._served()}", param="model")  # fmt: skip
            return convert.immediate_json(200, card)
        return None


def _headers_of(route: ModelRoute) -> tuple[tuple[str, str], ...]:
    return ((MODEL_HEADER, route.model), (BASE_MODEL_HEADER, route.base_model))


class Phase(enum.Enum):
    HEADERS = 1
    BODY = 2
    DONE = 3
    ANSWERED = 4


class RouterStream:
    __slots__ = ("_body", "_first", "_headers", "_mode", "_path", "_phase", "_route", "_router")

    def __init__(self, router: ModelRouter, default_mode: int) -> None:
        self._router = router
        self._mode = default_mode
        self._phase = Phase.HEADERS
        self._first = True
        self._path = "/"
        self._headers: dict[str, str] = {}
        self._body = bytearray()
        self._route: ModelRoute | None = None

    @property
    def route(self) -> ModelRoute | None:
        return self._route

    def handle(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if self._first:
            self._first = False
            if msg.HasField("protocol_config"):
                self._mode = msg.protocol_config.request_body_mode
        if self._phase is Phase.ANSWERED:
            return _NO_REPLY
        kind = msg.WhichOneof("request")
        try:
            if kind == "request_headers":
                out = self._request_headers(msg.request_headers)
            elif kind == "request_body":
                out = self._request_body(msg.request_body)
            elif kind == "request_trailers":
                out = self._request_trailers()
            elif kind == "response_headers":
                out = [convert.RESPONSE_HEADERS_CONTINUE]
            elif kind == "response_body":  # not asked for by the bootstrap: passed unchanged
                b = msg.response_body
                out = ([convert.streamed_response_body(b.body, b.end_of_stream)]
                       if self._mode == convert.FULL_DUPLEX_STREAMED
                       else [convert.RESPONSE_BODY_CONTINUE])  # fmt: skip
            elif kind == "response_trailers":
                out = [convert.RESPONSE_TRAILERS_CONTINUE]
            else:
                raise ProtocolError(f"ext_proc message carries no known request ({kind!r})")
        except EppError as exc:
            out = self._answer(exc)
        except ProtocolError:
            raise
        except Exception as exc:  # a bug: answer 500, keep the server alive
            log.exception("model router stream failed on %s", kind)
            out = self._answer(exc)
        return out

    def check_complete(self) -> None:
        if self._phase is Phase.BODY:
            raise ProtocolError("the ext_proc stream was half-closed before the request body's end")

    def close(self) -> None:
        self._drop_body()

    # --- request -----------------------------------------------------------------------

    def _request_headers(self, h: pb.HttpHeaders) -> list[pb.ProcessingResponse]:
        if self._phase is not Phase.HEADERS:
            raise ProtocolError(f"request_headers in phase {self._phase.name}: one per stream")
        headers = self._headers = convert.headers_to_dict(h.headers)
        self._path = headers.get(":path", "/")
        method = headers.get(":method", "").upper()
        router = self._router
        if method in ("GET", "HEAD"):
            path = self._path.partition("?")[0].rstrip("/") or "/"
            listed = router.list_reply(path)
            if listed is not None:
                router.metrics.request(None, "models_list")
                self._phase = Phase.ANSWERED
                return [listed]
        if h.end_of_stream or self._mode == convert.NONE:
            route = self._route = self._model_of_headers(method)
            self._phase = Phase.DONE
            router.metrics.request(route, "routed")
            return [convert.headers_set_response(_headers_of(route))]
        self._phase = Phase.BODY
        router.parser.check_headers(self._path, headers)
        if self._mode == convert.FULL_DUPLEX_STREAMED:
            return _NO_REPLY
        return [convert.REQUEST_HEADERS_CONTINUE]

    def _model_of_headers(self, method: str) -> ModelRoute:
        """A request without a body: the trusted rewrite header's model, the default model,
        the one base model; else a 404 (nothing says which pool could serve it)."""
        router = self._router
        forced = self._headers.get(MODEL_REWRITE_HEADER) if router.parser.trust_control_headers else None
        if forced:
            return router.route_model(forced)
        try:
            return router.unnamed("")
        except BadRequest:
            raise NotFound(f"{method} {echo(self._path.partition('?')[0])}: this gateway routes "
                           "each request to the pool of the model its body names (GET "
                           "/v1/models lists them)") from None  # fmt: skip

    def _request_body(self, b: pb.HttpBody) -> list[pb.ProcessingResponse]:
        if self._phase is not Phase.BODY:
            if self._phase is Phase.HEADERS:
                raise ProtocolError("request_body before request_headers")
            return _NO_REPLY
        parser, budget = self._router.parser, self._router.budget
        chunk = b.body
        if len(self._body) + len(chunk) > parser.max_body_bytes:
            raise PayloadTooLarge(parser.too_large_message(len(self._body) + len(chunk)))
        if budget.used + len(chunk) > budget.max_bytes:
            raise Unavailable(f"the model router holds the most request-body bytes it may "
                              f"buffer ({budget.max_bytes}); retry shortly")  # fmt: skip
        budget.used += len(chunk)
        self._body += chunk
        if b.end_of_stream:
            return self._routed(trailers_follow=False)
        if self._mode != convert.FULL_DUPLEX_STREAMED:
            raise PayloadTooLarge("request body is larger than the proxy's buffer "
                                  "(BUFFERED_PARTIAL sent a part)")  # fmt: skip
        return _NO_REPLY

    def _request_trailers(self) -> list[pb.ProcessingResponse]:
        if self._phase is Phase.BODY and self._mode == convert.FULL_DUPLEX_STREAMED:
            return [*self._routed(trailers_follow=True), convert.REQUEST_TRAILERS_CONTINUE]
        return [convert.REQUEST_TRAILERS_CONTINUE]

    def _routed(self, trailers_follow: bool) -> list[pb.ProcessingResponse]:
        body = bytes(self._body)
        self._drop_body()
        router = self._router
        started = time.perf_counter()
        model = router.parser.model_of(self._path, self._headers, body)
        route = router.route_model(model) if model else router.unnamed(
            f"the {echo(self._path.partition('?')[0])} request")
        router.metrics.duration.observe(time.perf_counter() - started)
        self._route = route
        self._phase = Phase.DONE
        router.metrics.request(route, "routed")
        if self._mode != convert.FULL_DUPLEX_STREAMED:
            return [convert.body_headers_set_response(_headers_of(route))]
        out = [convert.headers_set_response(_headers_of(route), len(body))]
        view = memoryview(body)
        for start in range(0, max(len(body), 1), STREAMED_CHUNK_BYTES):
            last = start + STREAMED_CHUNK_BYTES >= len(body)
            out.append(convert.streamed_request_body(bytes(view[start : start + STREAMED_CHUNK_BYTES]),
                                                     last and not trailers_follow))  # fmt: skip
        return out

    def _drop_body(self) -> None:
        self._router.budget.used -= len(self._body)
        self._body = bytearray()

    def _answer(self, exc: BaseException) -> list[pb.ProcessingResponse]:
        kind = error_kind(exc)
        self._router.metrics.request(self._route, str(kind.status))
        log.info("request answered by the model router: status=%d type=%s path=%s reason=%s",
                 kind.status, kind.type, echo(self._path.partition("?")[0]),
                 exc.message if isinstance(exc, EppError) else type(exc).__name__)  # fmt: skip
        self._phase = Phase.ANSWERED
        self._drop_body()
        return [immediate_response(exc, self._path)]

