"""``create_app``: the FastAPI app serving one run's ``final/`` model, and its routes."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import math
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated

import torch
from fastapi import Depends, FastAPI, Path
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi_offline import FastAPIOffline

from fedrod_ray import __version__

from . import errors, images
from .body_limit import BodyLimit
from .body_schema import body_schemas
from .errors import ApiError, Forbidden, Unauthorized, responses
from .json_body import json_body, request_body
from .schemas import (
    EXAMPLE_HEAD_ID,
    HEAD_ID_PATTERN,
    HeadRequest,
    HeadResponse,
    Health,
    InputSpec,
    Limits,
    ModelInfo,
    PersonalizedPredictions,
    Predictions,
    PredictRequest,
    PredictResponse,
    Ready,
    ReloadRequest,
    ReloadResponse,
    TopClass,
)
from .service import (
    Loaded,
    ModelService,
    Personal,
    cached_head,
    personal_head,
    probabilities,
    request_dist,
    zero_head_note,
    zero_shot,
)
from .settings import ADMIN_TOKEN_ENV, Settings

DEFAULT_TOP_K = 3
# Module level: FastAPI resolves the (string) annotations of dependencies in this module's globals.
BEARER = HTTPBearer(auto_error=False, description=f"the token in ${ADMIN_TOKEN_ENV} of the server")

DESCRIPTION = """\
Generic and personalized predictions of a Fed-RoD model trained by fedrod-ray, and zero-shot personalized
heads for brand-new clients described only by their class distribution (hyper head).

Every error is `{"detail": "<field>: <what is wrong>", "field": "<field>"}` with a 4xx status, or 503 (with
Retry-After) while the request bodies in flight are at the server's memory budget.
"""


def _predictions(probs: torch.Tensor, k: int, names: list[str]) -> dict:
    values, indices = probs.topk(k, dim=1)
    top = [[TopClass(index=i, label=names[i], probability=p) for i, p in zip(row_i, row_p)]
           for row_i, row_p in zip(indices.tolist(), values.tolist())]
    return {"probabilities": probs.tolist(), "top_k": top}


def _head_response(loaded: Loaded, key: str, a: torch.Tensor, head: torch.Tensor) -> HeadResponse:
    return HeadResponse(head_id=key, model_version=loaded.served.version_id, class_distribution=a.tolist(),
                        shape=list(head.shape), weights=head.tolist())


def _model_info(loaded: Loaded, settings: Settings) -> ModelInfo:
    meta = loaded.served.meta
    return ModelInfo(
        version_id=loaded.served.version_id, dataset=meta.dataset, class_names=meta.class_names,
        num_classes=meta.num_classes,
        input=InputSpec(shape=meta.image_shape, mean=meta.mean, std=meta.std, png_mode=images.png_mode(meta)),
        head=meta.head, method=meta.method, generic_model=meta.generic_model, arch=meta.arch, hyper_hidden=meta.hyper_hidden if meta.head == "hyper" else None,
        rule=meta.rule, balanced_loss=meta.balanced_loss, round=meta.round,
        # JSON has no NaN: a metric that could not be computed is null.
        metrics={k: v if math.isfinite(v) else None for k, v in meta.metrics.items()},
        client_ids=sorted(loaded.served.personal_heads), trained_client_ids=sorted(loaded.trained_clients),
        privacy=dataclasses.asdict(meta.privacy) if meta.privacy else None,
        limits=Limits(max_batch=settings.max_batch, max_body_bytes=settings.max_body_bytes,
                      body_timeout_s=settings.body_timeout_s, head_cache_size=settings.head_cache_size),
    )


# What a predict request asks for once its images are decoded: (images, top_k, the personalized head or None).
Prepared = tuple[torch.Tensor, int, Personal | None]


def _prepare(loaded: Loaded, req: PredictRequest, max_batch: int) -> Prepared:
    meta = loaded.served.meta
    # The images and top_k are checked before a head is made, so a bad request caches nothing.
    x = images.decode(req.images, req.pixels, req.images_png, meta, max_batch)
    k = req.top_k or min(DEFAULT_TOP_K, meta.num_classes)
    if k > meta.num_classes:
        raise ApiError("top_k", f"is {k}; this model has only {meta.num_classes} classes")
    return x, k, personal_head(loaded, req)


def _respond(loaded: Loaded, k: int, personal: Personal | None, probs: tuple[torch.Tensor, ...]) -> PredictResponse:
    names = loaded.served.meta.class_names
    personalized = None
    if personal:
        note = zero_head_note(personal)
        personalized = PersonalizedPredictions(**_predictions(probs[1], k, names), by=personal.by,
                                               head_id=personal.head_id, client_id=personal.client_id,
                                               personalized=note is None, note=note)
    return PredictResponse(model_version=loaded.served.version_id,
                           generic=Predictions(**_predictions(probs[0], k, names)),
                           personalized=personalized)


def _pixels(loaded: Loaded, req: PredictRequest) -> int:
    return len(req.images if req.images is not None else req.images_png) * math.prod(loaded.served.meta.image_shape)


def _predict(loaded: Loaded, req: PredictRequest, max_batch: int) -> PredictResponse:
    x, k, personal = _prepare(loaded, req, max_batch)
    (probs,) = probabilities(loaded, [(x, personal.head if personal else None)])
    return _respond(loaded, k, personal, probs)


# Top-level values a predict request has besides its images and class list: the root object, the lists,
# top_k, pixels, head_id, client_id.
PREDICT_OTHER_VALUES = 8
# The values bound is the most a valid request holds, times this, plus SLACK: a request a few images or
# classes off still gets its 422 naming the field, not a 413.
HEADROOM, SLACK = 2, 1024


def _predict_values(loaded: Loaded, max_batch: int) -> tuple[int, str]:
    meta = loaded.served.meta
    c, h, w = meta.image_shape
    per_image = c * h * w + c * h + c + 1  # the pixels, the rows, the channels, the image's own list
    bound = max_batch * per_image + meta.num_classes + PREDICT_OTHER_VALUES
    return HEADROOM * bound + SLACK, f"{max_batch} images of shape {list(meta.image_shape)} and {meta.num_classes} classes"


def _head_values(loaded: Loaded) -> tuple[int, str]:
    n = loaded.served.meta.num_classes
    return HEADROOM * (n + 2) + SLACK, f"{n} classes"


# A batched request (Ray Serve's replica) of at most this many pixels is decoded on the event loop, in a
# fraction of a millisecond: a hop to the inference thread and back cost more CPU than the decoding, and the
# replica is bound by one core's worth of Python (bench/serve_latency.py).
INLINE_PIXELS = 4096

# Module level: FastAPI resolves the (string) annotations of the routes in this module's globals.
HEADS_BODY = json_body(HeadRequest, lambda app: _head_values(app.state.service.current))
PREDICT_BODY = json_body(PredictRequest, lambda app: _predict_values(app.state.service.current,
                                                                     app.state.settings.max_batch))
# Only the admin sends it, after the token check: no bound on its values (a path may hold commas).
RELOAD_BODY = json_body(ReloadRequest, optional=True)


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

    Raises ExportError when final/ cannot be served, so a bad model never gets as far as a listening
    server. ``admin_token`` (normally ``$FEDROD_ADMIN_TOKEN``) enables POST /v1/admin/reload; None or
    empty leaves it disabled. ``forward``, when given, computes the predictions' probabilities (a batching
    one runs them on ``app.state.inference``); by default each request runs its own forward there.
    ``proxied``: behind a proxy that holds the clients' connections (Ray Serve's replica; BodyLimit).
    """
    if isinstance(settings, str):
        settings = Settings(model_dir=settings)
    service = ModelService(settings.model_dir, settings.head_cache_size, settings.allow_factories)
    # /docs and /redoc with Swagger UI's and ReDoc's scripts served from the fastapi-offline package rather
    # than a CDN: a federation's server often runs without internet. Swagger UI's validator is off: served
    # under any name but localhost, it would have the browser fetch a badge from validator.swagger.io.
    app = FastAPIOffline(title="fedrod-ray", version=__version__, description=DESCRIPTION,
                         swagger_ui_parameters={"validatorUrl": None})
    app.state.service = service
    app.state.settings = settings
    # Predictions run one at a time on their own thread, in arrival order, while the event loop parses and
    # answers the other requests. With torch on one core, more threads only contend for the GIL and the
    # cores: on 2 cores this gave ~45% more requests/s at concurrency 8 than the default thread pool, and
    # less than half its p99 (bench/serve_latency.py). More traffic takes more processes (Ray Serve).
    inference = app.state.inference = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedrod-inference")
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                       budget_bytes=settings.max_bodies_bytes, proxied=proxied)
    errors.install(app)
    _document_bodies(app)

    @app.get("/healthz", response_model=Health, tags=["health"], summary="Liveness: the process answers")
    async def healthz():
        return Health(status="ok")

    @app.get("/readyz", response_model=Ready, tags=["health"],
             summary="Readiness: a model is loaded (it is from start-up on, and stays so across reloads)")
    async def readyz():
        return Ready(status="ready", model_version=service.current.served.version_id)

    @app.get("/v1/model", response_model=ModelInfo, tags=["model"],
             summary="What is served: dataset, classes, input shape and normalisation, head, metrics")
    async def model_info():
        return _model_info(service.current, settings)

    @app.post("/v1/heads", response_model=HeadResponse, tags=["heads"],
              responses=responses(408, 409, 413, 415, 422, 503), openapi_extra=request_body(HeadRequest),
              summary="The zero-shot personalized head H(a; nu) of a new client's class distribution")
    async def make_head(req: Annotated[HeadRequest, HEADS_BODY]):  # microseconds of torch: cheaper than a hop to a thread
        loaded = service.current
        _, a = request_dist(loaded, req)  # the schema makes sure one distribution field is given
        key, head = zero_shot(loaded, a)
        return _head_response(loaded, key, a, head)

    @app.get("/v1/heads/{head_id}", response_model=HeadResponse, tags=["heads"],
             responses=responses(404, 409, 422), summary="A head made earlier by POST /v1/heads")
    async def get_head(head_id: Annotated[str, Path(pattern=HEAD_ID_PATTERN, examples=[EXAMPLE_HEAD_ID])]):
        loaded = service.current
        a, head = cached_head(loaded, head_id)
        return _head_response(loaded, head_id, a, head)

    @app.post("/v1/predict", response_model=PredictResponse, tags=["predict"],
              responses=responses(404, 408, 409, 413, 415, 422, 503), openapi_extra=request_body(PredictRequest),
              summary="Generic class probabilities, and personalized ones when a head is named")
    async def predict(req: Annotated[PredictRequest, PREDICT_BODY]):
        loop = asyncio.get_running_loop()
        loaded = service.current
        if forward is None:
            return await loop.run_in_executor(inference, _predict, loaded, req, settings.max_batch)
        if _pixels(loaded, req) <= INLINE_PIXELS:
            x, k, personal = _prepare(loaded, req, settings.max_batch)
        else:
            x, k, personal = await loop.run_in_executor(inference, _prepare, loaded, req, settings.max_batch)
        probs = await forward((loaded, x, personal.head if personal else None))
        return _respond(loaded, k, personal, probs)

    def admin(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> None:
        if not admin_token:
            raise Forbidden(None, f"reload is disabled: this server was started without ${ADMIN_TOKEN_ENV} "
                                  f"(on Ray Serve, redeploy with the new model_dir instead)")
        given = credentials.credentials.encode() if credentials else b""
        if not hmac.compare_digest(given, admin_token.encode()):
            raise Unauthorized("Authorization", f"needs 'Bearer <token>', the token in ${ADMIN_TOKEN_ENV}")

    @app.post("/v1/admin/reload", response_model=ReloadResponse, tags=["admin"],
              dependencies=[Depends(admin)], responses=responses(401, 403, 408, 409, 413, 415, 422, 503),
              openapi_extra=request_body(ReloadRequest, required=False),
              summary="Serve the final/ of model_dir (default: the served run's, e.g. after new training)")
    def reload(req: Annotated[ReloadRequest | None, RELOAD_BODY]):
        previous, now = service.reload(req.model_dir if req else None)
        if now is not previous:
            app.openapi_schema = None  # the next /openapi.json describes the new model
        return ReloadResponse(version_id=now.served.version_id,
                              previous_version_id=previous.served.version_id, changed=now is not previous)

    return app
