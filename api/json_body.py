"""Request bodies: the content type and encoding, a bound on the JSON values, then parsing and validation
on a worker thread, or in a worker process for a large body.

The routes take their body through ``json_body`` instead of FastAPI's own body parameters, which parse and
validate on the event loop: a 16 MiB body of two million tiny images took 4-40 s there, during which
nothing else, not even /healthz, was answered. Here a body is first bounded by the number of JSON values it
can hold (counting commas and brackets is a C loop over the bytes), then parsed and validated by
pydantic-core off the event loop (all but the smallest bodies), and a body over ``parse_process_bytes`` in a
parse worker process (parse_workers.py), so that it holds no lock of the serving process either.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from email.message import Message
from typing import Any

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from .body_limit import body_chunks
from .errors import ApiError, TooLarge, UnsupportedMediaType

MEDIA_TYPE = "application/json"
# pydantic-core's parser stops at this depth; this API's bodies nest at most 5 levels (images).
MAX_DEPTH = 200
# jiter's messages for the failures that are not a syntax error, and what they mean to a client.
JSON_FAILURES = {
    "recursion limit exceeded": f"nested more than {MAX_DEPTH} arrays or objects deep",
    "number out of range": "a number is too large to read (more than 4,300 digits)",
    "invalid unicode code point": "not valid UTF-8 (JSON must be UTF-8)",
}
# A body up to this size is parsed on the event loop: a hop to a worker thread costs more than parsing a
# single image's request (~25 us), and the worst such body (thousands of tiny invalid items) holds the loop
# ~1.5 ms. Larger bodies are parsed off it.
INLINE_BYTES = 8 * 1024
# A route's bound on its body's values (json_body's ``bound``) is the most a valid request holds, times
# HEADROOM, plus SLACK: a request a few images or classes off still gets its 422 naming the field, not a 413.
HEADROOM, SLACK = 2, 1024
# A JSON string and, when it is an object's key, the colon after it. Matched one string after the other from
# the start of valid JSON, each match starts at a string's opening quote.
STRING_OR_KEY = re.compile(rb'("[^"\\]*(?:\\.[^"\\]*)*")\s*(:)?')


def value_count(body: bytes) -> int:
    """An upper bound on the JSON values in ``body``, containers included.

    Every value but the root is an item of a container, and every item but a container's first follows a
    comma: values <= 1 + commas + containers. Commas and brackets inside strings only raise the bound.
    """
    return 1 + body.count(b",") + body.count(b"[") + body.count(b"{")


def _check_headers(request: Request) -> None:
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise UnsupportedMediaType("Content-Encoding", f"{encoding} is not supported: send the body "
                                                       f"uncompressed")
    given = request.headers.get("content-type")
    if given is None:
        raise UnsupportedMediaType("Content-Type", f"missing: send the body as {MEDIA_TYPE}")
    message = Message()
    message["content-type"] = given
    charset = message.get_param("charset")
    # Only plain JSON: application/*+json types (JSON:API, ...) carry rules of their own that this API
    # does not follow.
    if message.get_content_type() != MEDIA_TYPE or (charset and str(charset).lower() not in ("utf-8", "utf8")):
        raise UnsupportedMediaType("Content-Type", f"is {given!r}; this API takes {MEDIA_TYPE} (UTF-8)")


def _json_error(error: dict) -> ApiError:
    message = error["ctx"]["error"]
    for cause, meaning in JSON_FAILURES.items():
        if message.startswith(cause):
            return ApiError("body", f"{meaning} ({message})")
    return ApiError("body", f"invalid JSON: {message}")


def parse(model: type[BaseModel], body: bytes, max_values: int | None, what: str) -> BaseModel:
    """The validated model of a JSON body; ``what`` says where ``max_values`` comes from."""
    if max_values is not None and value_count(body) > max_values:
        raise TooLarge("body", f"holds more than {max_values} JSON values, the most a request can need "
                               f"on this server ({what})")
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as e:
        # Without their inputs, which a parse worker would send back (the whole body, for a rule across fields).
        found = e.errors(include_url=False, include_input=False)
        if found and found[0]["type"] == "json_invalid":
            raise _json_error(found[0]) from None
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in found]) from None
    _refuse_duplicate_keys(body)
    return parsed


def _refuse_duplicate_keys(body: bytes) -> None:
    """A 422 naming a key the body gives twice: the parser keeps the last one, which would silently win.

    Called on a body that validated, so it is one JSON object whose values hold no objects (no field of a
    request takes one): every key in it is one of the root's. Escapes count (\\u0061 is a), as in parsing.
    """
    seen = set()
    for m in STRING_OR_KEY.finditer(body):
        if m.group(2):
            key = json.loads(m.group(1))
            if key in seen:
                raise ApiError(key, "is given more than once in the body; give each field once")
            seen.add(key)


def _parse_chunks(model: type[BaseModel], chunks: list[bytes], max_values: int | None, what: str) -> BaseModel:
    return parse(model, b"".join(chunks), max_values, what)  # joined here, off the event loop


def parse_converted(body: bytes, model: type[BaseModel], max_values: int | None, what: str,
                    convert: Callable[[BaseModel], BaseModel] | None) -> BaseModel:
    """``parse``, then ``convert``: what a parse worker runs."""
    parsed = parse(model, body, max_values, what)
    return convert(parsed) if convert else parsed


def json_body(model: type[BaseModel], bound: Callable[[Any], tuple[int, str]] | None = None,
              optional: bool = False, convert: Callable[[Any], Callable[[BaseModel], BaseModel]] | None = None):
    """A dependency giving the route its validated ``model``; ``bound(app)`` is (max JSON values, why),
    read per request (a reload can change the model's shape). An ``optional`` body may be empty (None).
    ``convert(app)``: a picklable function that a parse worker applies to the parsed request, so that what
    it sends back is quick to receive (the predict route's images as one array, not a float per pixel)."""

    async def dependency(request: Request):
        chunks = await body_chunks(request)
        size = sum(map(len, chunks))
        if not size:
            if optional:
                return None
            raise ApiError("body", f"is empty: send a JSON object ({MEDIA_TYPE})")
        _check_headers(request)
        max_values, what = bound(request.app) if bound else (None, "")
        if size <= INLINE_BYTES:
            return parse(model, b"".join(chunks), max_values, what)
        if size > request.app.state.settings.parse_process_bytes:
            return await request.app.state.parse_workers.run(parse_converted, chunks, model, max_values, what,
                                                             convert(request.app) if convert else None)
        return await run_in_threadpool(_parse_chunks, model, chunks, max_values, what)

    return Depends(dependency)


def request_body(model: type[BaseModel], required: bool = True) -> dict:
    """The OpenAPI ``requestBody`` of a route that takes ``model`` through ``json_body``."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": required, "content": {MEDIA_TYPE: {"schema": ref}}}}
