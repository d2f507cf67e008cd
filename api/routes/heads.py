"""The zero-shot personalized heads of new clients (POST /v1/heads) and the heads made earlier, by id
(GET /v1/heads/{head_id}): a client described only by its class distribution gets its own head."""

from __future__ import annotations

from typing import Annotated

import torch
from fastapi import APIRouter, Path, Request

from ..errors import responses
from ..json_body import HEADROOM, SLACK, json_body, request_body
from ..schemas import EXAMPLE_HEAD_ID, HEAD_ID_PATTERN, HeadRequest, HeadResponse
from ..service import Loaded, cached_head, request_dist, zero_shot

router = APIRouter(tags=["heads"])


def _head_response(loaded: Loaded, key: str, a: torch.Tensor, head: torch.Tensor) -> HeadResponse:
    return HeadResponse(head_id=key, model_version=loaded.served.version_id, class_distribution=a.tolist(),
                        shape=list(head.shape), weights=head.tolist())


def _head_values(loaded: Loaded) -> tuple[int, str]:
    n = loaded.served.meta.num_classes
    return HEADROOM * (n + 2) + SLACK, f"{n} classes"


# Module level: FastAPI resolves the (string) annotations of the routes in this module's globals.
HEADS_BODY = json_body(HeadRequest, lambda app: _head_values(app.state.service.current))


@router.post("/v1/heads", response_model=HeadResponse, responses=responses(408, 409, 413, 415, 422, 503),
             openapi_extra=request_body(HeadRequest),
             summary="The zero-shot personalized head H(a; nu) of a new client's class distribution")
# On the event loop: microseconds of torch, cheaper than a hop to a thread.
async def make_head(request: Request, req: Annotated[HeadRequest, HEADS_BODY]):
    loaded = request.app.state.service.current
    _, a = request_dist(loaded, req)  # the schema makes sure one distribution field is given
    key, head = zero_shot(loaded, a)
    return _head_response(loaded, key, a, head)


@router.get("/v1/heads/{head_id}", response_model=HeadResponse, responses=responses(404, 409, 422),
            summary="A head made earlier by POST /v1/heads")
async def get_head(request: Request,
                   head_id: Annotated[str, Path(pattern=HEAD_ID_PATTERN, examples=[EXAMPLE_HEAD_ID])]):
    loaded = request.app.state.service.current
    a, head = cached_head(loaded, head_id)
    return _head_response(loaded, head_id, a, head)
