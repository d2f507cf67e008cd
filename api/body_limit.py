"""ASGI middleware that reads a request's body within bounds, before any route parses it: 413 for a body
over the size limit, 408 for one that does not arrive in time."""

from __future__ import annotations

import asyncio

from .errors import error_response


class BodyLimit:
    """Buffers the whole body (every endpoint needs all of its JSON anyway) and refuses it once it grows
    past ``max_bytes``, or when it has not all arrived ``timeout_s`` seconds after the request's headers.

    A declared Content-Length over the limit is refused without reading a byte; counting what arrives
    catches a chunked body, or one whose Content-Length lies. The time limit is for the whole body, not
    per read, so a client trickling a byte at a time cannot hold a connection either (uvicorn bounds only
    the idle time between requests).
    """

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(f"{int(declared)} bytes", scope, receive, send)
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
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # only a disconnect can come now
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, what: str, scope, receive, send):
        detail = f"body: {what} is over this server's limit of {self.max_bytes} bytes"
        await error_response(413, "body", detail)(scope, receive, send)

    async def _too_slow(self, size: int, declared: bytes, scope, receive, send):
        of = f" of the {int(declared)} declared" if declared.isdigit() else ""
        detail = f"body: {size} bytes{of} arrived in {self.timeout_s:g} s, this server's limit for a body"
        # Closed after the answer: the rest of the body may still come, and would be read as a request.
        await error_response(408, "body", detail, {"Connection": "close"})(scope, receive, send)
