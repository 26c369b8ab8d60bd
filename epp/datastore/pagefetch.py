"""GET one page over a kept-alive HTTP/1.1 connection, with a size bound. For scraping.

A general HTTP client does much more per request than a scraper needs (URL objects, header
multidicts, cookie jars, response objects): for a 56 KB vLLM page that was most of the cost
of a scrape. A :class:`PageFetcher` holds one connection to one endpoint, writes a request
built once, parses the response with ``httptools`` (llhttp, the parser behind uvicorn) and
keeps only the status, three headers and the body.

Bounds: at most ``max_bytes`` of body, counted before and after decompression (a page that
inflates past it is cut off with ``too_large``, after at most ``max_bytes`` of work, ~3 ms
per MiB); a compressed answer is refused (``bad_response``) unless compression was asked
for (``accept_gzip``), so by default a compression bomb costs nothing;
headers are bounded by llhttp. A timeout, a malformed response or a server that closes the
connection gets a ``ScrapeError`` and a fresh connection on the next fetch.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import cast

import httptools

from epp.datastore.metricsparse import ScrapeError

DEFAULT_MAX_BYTES = 4 << 20


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection; one request at a time."""

    def __init__(self, max_bytes: int, accept_gzip: bool) -> None:
        self.transport: asyncio.Transport | None = None
        self._accept_gzip = accept_gzip
        self.closed = False
        self.received = False
        """Any byte of an answer arrived since the last request was sent."""
        self._max_bytes = max_bytes
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[bytes] | None = None
        self._reset()

    def _reset(self) -> None:
        self._chunks: list[bytes] = []
        self._size = 0
        self._status = 0
        self._encoding = b""
        self._length_known = False
        self._headers_done = False
        self._inflater: zlib._Decompress | None = None

    # --- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # a TCP connection's transport: asyncio's, or uvloop's (not a subclass of it)
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        if self._waiter is None or self._waiter.done():
            self._abort()  # bytes nobody asked for: the stream is out of step
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            # a ScrapeError raised in a callback reaches here wrapped by httptools
            cause = exc.__context__
            if isinstance(cause, ScrapeError):
                self._fail(cause)
            else:
                self._fail(ScrapeError("bad_response", str(exc)[:200]))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._headers_done and not self._length_known and self._status:
            self._complete()  # a body delimited by the end of the connection
        else:
            waiter.set_exception(ScrapeError("connection", "closed by the server"))

    # --- httptools callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._reset()

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-encoding":
            self._encoding = value.strip().lower()
        elif lower == b"content-length":
            self._length_known = True
            digits = value.strip()
            if not digits.isdigit() or len(digits) > 19 or int(digits) > self._max_bytes:
                raise ScrapeError("too_large", f"content-length {value[:40]!r}")
        elif lower == b"transfer-encoding":
            self._length_known = True

    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._status = self._parser.get_status_code()
        if self._encoding in (b"gzip", b"x-gzip", b"deflate"):
            if not self._accept_gzip:  # not asked for: inflating costs ~3 ms per MiB
                raise ScrapeError("bad_response", f"content-encoding {self._encoding!r} not asked for")
            self._inflater = zlib.decompressobj(wbits=47)  # gzip or zlib header, detected
        elif self._encoding not in (b"", b"identity"):
            raise ScrapeError("bad_response", f"content-encoding {self._encoding[:40]!r}")

    def on_body(self, body: bytes) -> None:
        inflater = self._inflater
        if inflater is not None:
            room = self._max_bytes - self._size
            try:
                body = inflater.decompress(body, room + 1)
            except zlib.error as exc:
                raise ScrapeError("bad_response", f"content-encoding: {exc}") from None
            if inflater.unconsumed_tail:
                raise ScrapeError("too_large", f"inflates past {self._max_bytes} bytes")
        self._size += len(body)
        if self._size > self._max_bytes:
            raise ScrapeError("too_large", f"body over {self._max_bytes} bytes")
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        self._complete()

    # --- requests ------------------------------------------------------------------------

    def _complete(self) -> None:
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._status != 200:
            waiter.set_exception(ScrapeError("http_status", str(self._status)))
        else:
            waiter.set_result(b"".join(self._chunks))
        self._chunks = []
        if not self._parser.should_keep_alive():
            self._abort()

    def _fail(self, exc: ScrapeError) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)
        self._abort()

    def _abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def request(self, data: bytes) -> asyncio.Future[bytes]:
        assert self.transport is not None
        if self.closed:
            raise ScrapeError("connection", "closed by the server")
        self._waiter = asyncio.get_running_loop().create_future()
        self.received = False
        self.transport.write(data)
        return self._waiter


class PageFetcher:
    """Fetches ``http://host:port/path`` again and again over one kept-alive connection."""

    def __init__(
        self,
        host: str,
        port: int,
        path: str = "/metrics",
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        accept_gzip: bool = False,
    ) -> None:
        self.host = host
        self.port = port
        self.max_bytes = max_bytes
        self._accept_gzip = accept_gzip
        self.set_path(path)
        self._conn: _Connection | None = None
        self._lock = asyncio.Lock()  # one request at a time on the connection
        self.connects = 0

    def set_path(self, path: str) -> None:
        """The path (and query) of the next requests."""
        host, port = self.host, self.port
        host_header = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        encoding = "gzip" if self._accept_gzip else "identity"
        self.path = path
        self._request = (
            f"GET {path} HTTP/1.1\r\nHost: {host_header}\r\nUser-Agent: epp\r\n"
            f"Accept: text/plain\r\nAccept-Encoding: {encoding}\r\n\r\n"
        ).encode("ascii")

    async def fetch(self, timeout_s: float) -> bytes:
        """The page's body; raises ScrapeError (reason: timeout, connection, http_status,
        bad_response, too_large)."""
        try:
            async with self._lock, asyncio.timeout(timeout_s):
                conn = self._conn
                if conn is not None and not conn.closed:
                    try:
                        return await conn.request(self._request)
                    except ScrapeError as exc:
                        # a kept-alive connection the server closed while it sat idle: the
                        # GET is safe to send again, once, on a fresh connection
                        if exc.reason != "connection" or conn.received:
                            raise
                conn = self._conn = await self._connect()
                return await conn.request(self._request)
        except TimeoutError:
            self.close()
            raise ScrapeError("timeout") from None
        except OSError as exc:
            self.close()
            raise ScrapeError("connection", exc.strerror or type(exc).__name__) from None

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        max_bytes, gzip = self.max_bytes, self._accept_gzip
        _, conn = await loop.create_connection(
            lambda: _Connection(max_bytes, gzip), self.host, self.port
        )
        self.connects += 1
        return conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn._abort()
            self._conn = None
