"""ASGI middleware that answers 413 to a request body over the limit, before any route parses it."""

from __future__ import annotations

from .errors import error_response


class BodyLimit:
    """Buffers the whole body (every endpoint needs all of its JSON anyway) and refuses it once it grows
    past ``max_bytes``.

    A declared Content-Length over the limit is refused without reading a byte; counting what arrives
    catches a chunked body, or one whose Content-Length lies.
    """

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(f"{int(declared)} bytes", scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
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
