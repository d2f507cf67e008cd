"""uvicorn's HTTP protocol (httptools) with the bounds uvicorn lacks: a time and a size limit for a request's
headers, and a limit on open connections. ``fedrod-ray serve`` runs uvicorn with it; on Ray Serve, HAProxy
in front of the replicas does the same (api/serve.py).

uvicorn's own ``timeout_keep_alive`` closes a connection idle between requests, but once a byte of a request
has come, nothing limits how long its headers take or how large they grow, and ``limit_concurrency``
answers 503 only once a request's headers are complete: a client could hold any number of connections open
with headers it never finishes.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .errors import error_response

# The request line and headers of one request: uvicorn's h11 parser has the same default limit
# (h11_max_incomplete_event_size); a browser's requests take 1-2 KiB.
MAX_HEADER_BYTES = 16 * 1024
RETRY_AFTER_S = 1


def _raw(status: int, field: str, detail: str, headers: dict | None = None) -> bytes:
    """The error response, as bytes on the wire, with the connection closed after it."""
    response = error_response(status, field, detail, {**(headers or {}), "Connection": "close"})
    head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
    head += [name + b": " + value for name, value in response.raw_headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + response.body


def _too_large() -> bytes:
    return _raw(431, "headers", f"headers: the request line and headers are over this server's limit of "
                                f"{MAX_HEADER_BYTES} bytes")


def bounded_protocol(header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """The protocol class for ``uvicorn.Config(http=...)``: a request's line and headers must all arrive
    within ``header_timeout_s`` of the connection's start or of the previous answer (408 and closed after),
    in at most MAX_HEADER_BYTES (431 and closed); a connection beyond ``max_connections`` open is answered
    503 and closed at once."""

    class Bounded(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _parsed_bytes = 0
        _headers_over = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                detail = f"this server has its limit of {max_connections} connections open; retry later"
                self._refuse(_raw(503, "connections", f"connections: {detail}",
                                  {"Retry-After": str(RETRY_AFTER_S)}))
            else:
                self._await_headers()

        def connection_lost(self, exc) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_timer is None or self.transport.is_closing():
                return
            self._header_bytes += len(data)
            if self._header_bytes > MAX_HEADER_BYTES:
                self._refuse(_too_large())

        def on_message_begin(self) -> None:
            self._begun, self._parsed_bytes = True, 0
            super().on_message_begin()

        # data_received counts the bytes of headers still arriving; these count those parsed, for headers
        # that arrive whole in one read (17 KB of them, or 16 KB then 130 KB, were answered 200: issue 49).
        def on_url(self, url: bytes) -> None:
            self._count_parsed(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_parsed(len(name) + len(value) + 4)  # "name: value\r\n"
            super().on_header(name, value)

        def _count_parsed(self, n: int) -> None:
            self._parsed_bytes += n
            if self._parsed_bytes > MAX_HEADER_BYTES:
                self._headers_over = True
                # httptools raises it from feed_data, and uvicorn answers with send_400_response.
                raise httptools.HttpParserCallbackError("headers over the limit")

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to what httptools cannot parse, in the API's error shape (not plain text)."""
            if self._headers_over:
                self._refuse(_too_large())
            else:
                detail = f"request: not a valid HTTP/1.1 request ({msg.rstrip('.')})"
                self._refuse(_raw(400, "request", detail))

        def on_headers_complete(self) -> None:
            self._stop_header_timer()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Not when the next request (pipelined) has its headers already.
            if not self.transport.is_closing() and self.cycle.response_complete:
                self._await_headers()

        def _await_headers(self) -> None:
            self._stop_header_timer()
            self._begun, self._header_bytes = False, 0
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if not self._begun:  # idle: nothing to answer (keep-alive's own timeout is usually first)
                self.transport.close()
                return
            self._refuse(_raw(408, "headers", f"headers: the request line and headers did not all arrive in "
                                              f"{header_timeout_s:g} s, this server's limit"))

        def _refuse(self, response: bytes) -> None:
            self._stop_header_timer()
            self.transport.write(response)
            self.transport.close()

    return Bounded
