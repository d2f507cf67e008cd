"""ASGI middleware that reads a request's body within bounds, before any route parses it: 413 for a body
over the size limit, 408 for one that does not arrive in time, 503 while the bodies held by all requests
together would go over their budget."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from .errors import error_response

# A refusal closes the connection (but see BodyLimit's ``proxied``): the rest of the body may still come, and
# would otherwise be read (and thrown away) for as long as the client sends it, or be taken for the next request.
CLOSE = {"Connection": "close"}
# Seconds a client refused for the budget is told to wait: a body in flight takes about that long.
RETRY_AFTER_S = 1
# The methods whose requests may carry a body (this API's routes take one on POST only); the others' bodies
# are refused before they are read, so that a GET cannot hold memory either.
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class BodyLimit:
    """Buffers the whole body (every endpoint needs all of its JSON anyway) and refuses it once it grows
    past ``max_bytes``, or when it has not all arrived ``timeout_s`` seconds after the request's headers.
    The reads are kept as they came and replayed to the route one by one: the body is never copied whole on
    the event loop (joining a 16 MiB body's reads held it for tens of ms; the route takes them through
    ``body_chunks``).

    A declared Content-Length over the limit is refused without reading a byte; counting what arrives
    catches a chunked body, or one whose Content-Length lies. The time limit is for the whole body, not
    per read, so a client trickling a byte at a time cannot hold a connection either (uvicorn bounds only
    the idle time between requests).

    ``budget_bytes`` bounds the bodies of all requests in flight together, so that memory does not grow
    with the number of clients: a request takes the bytes of its body from the budget as they arrive (not
    its declared Content-Length, which costs a client nothing to declare), keeps them until its answer is
    sent, and is answered 503 with Retry-After as soon as the budget cannot cover what arrived. A request
    on a method that takes no body (GET, HEAD, ...) is refused if it has one. So one connection holds at most
    ``max_bytes`` of body, and only what its client sent.

    ``proxied``: a proxy, not this server, holds the client's connection (a Ray Serve replica: HAProxy's).
    Closing a connection whose request body is still arriving resets it (Linux answers a close with unread
    data by an RST), and HAProxy, reset while it forwards the answer, may send the client the answer's
    headers without its body. So there the 503 of a body with a Content-Length (and the refusal of a body on
    a GET) keeps the connection: the server (uvicorn) reads the rest, at most ``max_bytes``, and throws it
    away as it comes. The other refusals still close it, as nothing bounds what would follow (a chunked
    body, one over the limit) or the client is too slow to wait for.
    """

    def __init__(self, app, max_bytes: int, timeout_s: float, budget_bytes: int, proxied: bool = False):
        self.app = app
        self.proxied = proxied
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.budget_bytes = budget_bytes
        self.held_bytes = 0  # by the requests in flight (one event loop: no lock)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"")
        # What follows a refusal is at most max_bytes when the length is declared: see ``proxied``.
        keep = self.proxied and declared.isdigit() and int(declared) <= self.max_bytes
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(f"{int(declared)} bytes", scope, receive, send)
        if scope["method"] not in BODY_METHODS and (declared.strip(b"0") or b"transfer-encoding" in headers):
            detail = f"body: a {scope['method']} request takes none; send it without one"
            return await error_response(413, "body", detail, None if keep else CLOSE)(scope, receive, send)
        held = 0
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.timeout_s
            chunks, size = [], 0
            while True:
                try:
                    message = await asyncio.wait_for(receive(), deadline - loop.time())
                except asyncio.TimeoutError:
                    return await self._too_slow(size, declared, scope, receive, send)
                if message["type"] == "http.disconnect":  # the client left: there is no one to answer
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_bytes:
                    return await self._too_large(f"more than {self.max_bytes} bytes", scope, receive, send)
                # What has arrived, not what is declared: a length declared by a client that sends nothing
                # holds nothing (16 such connections denied every POST for 30 s: issue 49).
                if not self._take(size - held):
                    return await self._over_budget(size, declared, scope, receive, send, close=not keep)
                held = size
                if chunk:
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    break
            await self.app(scope, _replay(chunks, receive), send)
        finally:
            self.held_bytes -= held

    def _take(self, n: int) -> bool:
        if self.held_bytes + n > self.budget_bytes:
            return False
        self.held_bytes += n
        return True

    async def _too_large(self, what: str, scope, receive, send):
        detail = f"body: {what} is over this server's limit of {self.max_bytes} bytes"
        await error_response(413, "body", detail, CLOSE)(scope, receive, send)

    async def _too_slow(self, size: int, declared: bytes, scope, receive, send):
        of = f" of the {int(declared)} declared" if declared.isdigit() else ""
        detail = f"body: {size} bytes{of} arrived in {self.timeout_s:g} s, this server's limit for a body"
        await error_response(408, "body", detail, CLOSE)(scope, receive, send)

    async def _over_budget(self, size: int, declared: bytes, scope, receive, send, close: bool):
        of = f" of the {int(declared)} declared" if declared.isdigit() else ""
        detail = (f"body: {size} bytes{of} would take the request bodies held at once over this server's "
                  f"limit of {self.budget_bytes} bytes ({self.held_bytes} held); retry in {RETRY_AFTER_S} s")
        headers = {"Retry-After": str(RETRY_AFTER_S), **(CLOSE if close else {})}
        await error_response(503, "body", detail, headers)(scope, receive, send)


def _replay(chunks: list[bytes], receive):
    """The ``receive`` a route sees: the body's reads as they came, then whatever comes (only a disconnect
    can)."""
    last = len(chunks) - 1
    messages = iter([{"type": "http.request", "body": chunk, "more_body": i < last} for i, chunk in enumerate(chunks)]
                    or [{"type": "http.request", "body": b"", "more_body": False}])

    async def replay():
        message = next(messages, None)
        return message if message is not None else await receive()

    return replay


async def body_chunks(request: Request) -> list[bytes]:
    """The reads of the body BodyLimit buffered, not joined: Starlette's ``request.body()`` joins them, a copy
    of the whole body on the event loop."""
    return [chunk async for chunk in request.stream() if chunk]
