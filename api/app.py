"""``create_app``: the FastAPI app serving one run's ``final/`` model, assembled from the routers in
``routes/`` with its body limit, error handlers and model-specific OpenAPI request bodies."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from fedrod_ray import __version__

from . import client_tokens, errors
from .body_limit import BodyLimit
from .body_schema import body_schemas
from .parse_workers import ParseWorkers
from .routes import admin, heads, health, model, predict
from .service import Loaded, ModelService
from .settings import Settings

DESCRIPTION = """\
Generic and personalized predictions of a Fed-RoD model trained by fedrod-ray, and zero-shot personalized
heads for brand-new clients described only by their class distribution (hyper head).

Every error is `{"detail": "<field>: <what is wrong>", "field": "<field>"}` with a 4xx status, or 503 (with
Retry-After) while the request bodies in flight are at the server's memory budget, or too many large bodies
wait for a parse worker.
"""


def _document_bodies(app: FastAPI) -> None:
    """Add the request bodies, as the served model takes them, to FastAPI's OpenAPI schema (json_body
    parses them, not FastAPI). A reload that changes the model clears app.openapi_schema."""
    generate = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            found = schema.setdefault("components", {}).setdefault("schemas", {})
            found.update(body_schemas(app.state.service.current.served.meta, app.state.settings.max_batch))
        return app.openapi_schema

    app.openapi = openapi


# Runs one predict request's forward, given (model version, images, P-head or None); may batch it with
# others (Ray Serve's replica: api/serve.py).
Forward = Callable[[tuple[Loaded, torch.Tensor, torch.Tensor | None]], Awaitable[tuple[torch.Tensor, ...]]]


def create_app(settings: Settings | str, admin_token: str | None = None, forward: Forward | None = None,
               proxied: bool = False) -> FastAPI:
    """The app serving ``settings.model_dir``'s final/ (a plain string is taken as the model dir).

    Raises ExportError when final/ cannot be served, and ClientTokensError when ``settings.client_tokens``
    cannot be used, so a bad model or token file never gets as far as a listening server. ``admin_token``
    (normally ``$FEDROD_ADMIN_TOKEN``) enables POST /v1/admin/reload and the participant lists of
    GET /v1/model; None or empty leaves them disabled. ``forward``, when given, computes the predictions'
    probabilities (a batching one runs them on ``app.state.inference``); by default each request runs its
    own forward there.
    ``proxied``: behind a proxy that holds the clients' connections (Ray Serve's replica; BodyLimit).
    """
    if isinstance(settings, str):
        settings = Settings(model_dir=settings)
    service = ModelService(settings.model_dir, settings.head_cache_size, settings.allow_factories,
                           settings.reload_timeout_s)
    tokens = client_tokens.load(settings.client_tokens, service.current.served.meta.head)
    parse_workers = ParseWorkers(settings.parse_workers, settings.parse_queue, settings.parse_cpu_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        parse_workers.close()

    # /docs and /redoc with Swagger UI's and ReDoc's scripts served from the fastapi-offline package rather
    # than a CDN: a federation's server often runs without internet. Swagger UI's validator is off: served
    # under any name but localhost, it would have the browser fetch a badge from validator.swagger.io.
    app = FastAPIOffline(title="fedrod-ray", version=__version__, description=DESCRIPTION,
                         swagger_ui_parameters={"validatorUrl": None}, lifespan=lifespan)
    # What the routes read (routes/__init__.py).
    app.state.service = service
    app.state.settings = settings
    app.state.admin_token = admin_token
    app.state.client_tokens = tokens
    app.state.forward = forward
    app.state.parse_workers = parse_workers
    # Predictions run one at a time on their own thread, in arrival order, while the event loop parses and
    # answers the other requests. With torch on one core, more threads only contend for the GIL and the
    # cores: on 2 cores this gave ~45% more requests/s at concurrency 8 than the default thread pool, and
    # less than half its p99 (bench/serve_latency.py). More traffic takes more processes (Ray Serve).
    app.state.inference = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedrod-inference")
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                       budget_bytes=settings.max_bodies_bytes, proxied=proxied)
    errors.install(app)
    _document_bodies(app)
    for routes in (health, model, heads, predict, admin):
        app.include_router(routes.router)
    return app
