"""Every error the API returns is ``{"detail": "<field>: <what is wrong>", "field": "<field>"}``.

Pydantic's validation errors (422), the service's own checks and Starlette's 404/405 all come out in
this one shape, so a client needs one error parser and a person reading the message sees the field.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .schemas import FIELDS_ERROR, ErrorBody

# A batch of NaNs would otherwise give a message as long as the batch.
MAX_LISTED = 3

DESCRIPTIONS = {
    401: "missing or wrong admin token",
    403: "reload is disabled on this server",
    404: "unknown head_id or client_id",
    409: "the served model cannot do this (e.g. no hypernetwork), or a reload target is not servable",
    408: "the request body did not arrive in time",
    413: "request body over the size limit, or more JSON values than a request can need, or a body on a "
         "method that takes none, or one that took more than the server's CPU limit to parse",
    415: "not a JSON body (Content-Type), or a compressed one (Content-Encoding)",
    422: "invalid input; the message names the field",
    503: "the request bodies in flight are at this server's memory budget, or its parse workers' queue is "
         "full: retry after Retry-After seconds",
}


class ApiError(Exception):
    """A client error about one field of the request."""

    status = 422

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field
        self.message = message

    def __reduce__(self):  # pickled by a parse worker (parse_workers.py)
        return type(self), (self.field, self.message)

    @property
    def detail(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message

    @property
    def headers(self) -> dict | None:
        return None


class Unauthorized(ApiError):
    status = 401

    @property
    def headers(self) -> dict | None:
        return {"WWW-Authenticate": "Bearer"}


class Forbidden(ApiError):
    status = 403


class NotFound(ApiError):
    status = 404


class Conflict(ApiError):
    status = 409


class TooLarge(ApiError):
    status = 413


class UnsupportedMediaType(ApiError):
    status = 415


class Unavailable(ApiError):
    """The server cannot take the request now: retry after ``retry_after_s``."""

    status = 503

    def __init__(self, field: str | None, message: str, retry_after_s: int):
        super().__init__(field, message)
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict | None:
        return {"Retry-After": str(self.retry_after_s)}

    def __reduce__(self):
        return type(self), (self.field, self.message, self.retry_after_s)


def error_response(status: int, field: str | None, detail: str, headers: dict | None = None) -> JSONResponse:
    body = ErrorBody(detail=detail, field=field).model_dump()
    return JSONResponse(body, status_code=status, headers=headers)


def responses(*statuses: int) -> dict:
    """The OpenAPI ``responses`` entry documenting these error statuses."""
    return {s: {"model": ErrorBody, "description": DESCRIPTIONS[s]} for s in statuses}


def field_name(loc: tuple) -> str:
    """("body", "images", 0, 2) -> "images[0][2]"; the whole body -> "body"."""
    parts = list(loc[1:] if loc and loc[0] in ("body", "path", "query", "header") else loc)
    name = ""
    for p in parts:
        name += f"[{p}]" if isinstance(p, int) else (f".{p}" if name else str(p))
    return name or "body"


def _validation_message(err: dict) -> tuple[str, str]:
    if err["type"] == FIELDS_ERROR:
        field = err["ctx"]["field"]
    else:
        field = field_name(tuple(err["loc"]))
    return field, f"{field}: {err['msg']}"


def install(app: FastAPI) -> None:
    """Register the handlers that turn every client error into an ErrorBody."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.field, exc.detail, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        found = [_validation_message(e) for e in errors[:MAX_LISTED]]
        detail = "; ".join(m for _, m in found)
        if len(errors) > MAX_LISTED:
            detail += f" (and {len(errors) - MAX_LISTED} more errors)"
        return error_response(422, found[0][0] if found else None, detail)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, None, str(exc.detail), exc.headers)
