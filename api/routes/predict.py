"""POST /v1/predict: the generic class probabilities of a batch of images, and the personalized ones when
a head is named. Its images are decoded, and its forward run, on the app's inference thread (or batched
with other requests' by Ray Serve's replica), so the event loop keeps answering."""

from __future__ import annotations

import asyncio
import functools
import math
from typing import Annotated

import torch
from fastapi import APIRouter, Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .. import arrays, images
from ..errors import ApiError, Forbidden, Unauthorized, responses
from ..json_body import HEADROOM, SLACK, json_body, request_body
from ..schemas import (
    ErrorBody,
    PersonalizedPredictions,
    Predictions,
    PredictRequest,
    PredictResponse,
    TopClass,
)
from ..service import Loaded, Personal, personal_head, probabilities, zero_head_note

router = APIRouter(tags=["predict"])

DEFAULT_TOP_K = 3
# Top-level values a predict request has besides its images and class list: the root object, the lists,
# top_k, pixels, head_id, client_id.
PREDICT_OTHER_VALUES = 8
# A batched request (Ray Serve's replica) of at most this many pixels is decoded on the event loop, in a
# fraction of a millisecond: a hop to the inference thread and back cost more CPU than the decoding, and the
# replica is bound by one core's worth of Python (bench/serve_latency.py).
INLINE_PIXELS = 4096

# What a predict request asks for once its images are decoded: (images, top_k, the personalized head or None).
Prepared = tuple[torch.Tensor, int, Personal | None]


def _authorize(state, loaded: Loaded, req: PredictRequest, token: str | None) -> None:
    """A training client's own head (client_id) goes only to that client, and only on a server given the
    clients' tokens; a zero-shot head from a class distribution, which is no client's, goes to anyone."""
    if req.client_id is None or loaded.served.meta.head != "linear":
        return  # no client's head to give (personal_head answers 409 for a model without them)
    if state.client_tokens is None:
        raise Forbidden("client_id", "this server serves no training client's own head: it was started "
                                     "without client tokens (--client-tokens)")
    if not state.client_tokens.allows(req.client_id, token):
        raise Unauthorized("Authorization", f"client_id {req.client_id}'s head is served only to that client: "
                                            f"send 'Bearer <token>' with its own token")


def _predictions(probs: torch.Tensor, k: int, names: list[str]) -> dict:
    values, indices = probs.topk(k, dim=1)
    top = [[TopClass(index=i, label=names[i], probability=p) for i, p in zip(row_i, row_p)]
           for row_i, row_p in zip(indices.tolist(), values.tolist())]
    return {"probabilities": probs.tolist(), "top_k": top}


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


def _predict_values(loaded: Loaded, max_batch: int) -> tuple[int, str]:
    meta = loaded.served.meta
    c, h, w = meta.image_shape
    per_image = c * h * w + c * h + c + 1  # the pixels, the rows, the channels, the image's own list
    bound = max_batch * per_image + meta.num_classes + PREDICT_OTHER_VALUES
    return HEADROOM * bound + SLACK, f"{max_batch} images of shape {list(meta.image_shape)} and {meta.num_classes} classes"


# Module level: FastAPI resolves the (string) annotations of the routes in this module's globals.
PREDICT_BODY = json_body(PredictRequest, lambda app: _predict_values(app.state.service.current,
                                                                     app.state.settings.max_batch),
                         convert=lambda app: functools.partial(
                             arrays.convert, shape=tuple(app.state.service.current.served.meta.image_shape),
                             max_batch=app.state.settings.max_batch))


# Only a training client's own head (client_id) needs its token; nothing else does (security [{}]).
CLIENT_BEARER = HTTPBearer(auto_error=False, scheme_name="ClientToken",
                           description="a training client's own token, for its own head (client_id) only")
CLIENT_ERRORS = {
    401: {"model": ErrorBody, "description": "client_id: missing token, or not that client's"},
    403: {"model": ErrorBody, "description": "client_id: this server serves no training client's own head"},
}


@router.post("/v1/predict", response_model=PredictResponse,
             responses={**responses(404, 408, 409, 413, 415, 422, 503), **CLIENT_ERRORS},
             openapi_extra={**request_body(PredictRequest), "security": [{}]},
             summary="Generic class probabilities, and personalized ones when a head is named")
async def predict(request: Request, req: Annotated[PredictRequest, PREDICT_BODY],
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(CLIENT_BEARER)]):
    state = request.app.state
    loop = asyncio.get_running_loop()
    loaded, max_batch = state.service.current, state.settings.max_batch
    _authorize(state, loaded, req, credentials.credentials if credentials else None)
    if state.forward is None:
        return await loop.run_in_executor(state.inference, _predict, loaded, req, max_batch)
    if _pixels(loaded, req) <= INLINE_PIXELS:
        x, k, personal = _prepare(loaded, req, max_batch)
    else:
        x, k, personal = await loop.run_in_executor(state.inference, _prepare, loaded, req, max_batch)
    probs = await state.forward((loaded, x, personal.head if personal else None))
    return _respond(loaded, k, personal, probs)
