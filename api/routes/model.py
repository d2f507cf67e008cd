"""GET /v1/model: what is served (dataset, classes, input, head, metrics, limits), so a client can build
its requests from the server's answer alone; who took part in training only to the admin."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.security import HTTPAuthorizationCredentials

from fedrod_ray.models.export import Privacy

from .. import images
from ..schemas import GUARANTEES, NOT_COVERED, InputSpec, Limits, ModelInfo, PrivacyInfo
from ..service import Loaded
from ..settings import Settings
from .admin import BEARER, is_admin

router = APIRouter(tags=["model"])


def _privacy_info(privacy: Privacy) -> PrivacyInfo:
    guarantee = GUARANTEES["none" if privacy.epsilon is None else privacy.noise]
    return PrivacyInfo(**dataclasses.asdict(privacy), guarantee=guarantee, not_covered=NOT_COVERED)


def _model_info(loaded: Loaded, settings: Settings, admin: bool) -> ModelInfo:
    meta = loaded.served.meta
    return ModelInfo(
        version_id=loaded.served.version_id, dataset=meta.dataset, class_names=meta.class_names,
        num_classes=meta.num_classes,
        input=InputSpec(shape=meta.image_shape, mean=meta.mean, std=meta.std, png_mode=images.png_mode(meta)),
        head=meta.head, method=meta.method, generic_model=meta.generic_model, new_client=meta.new_client, arch=meta.arch, hyper_hidden=meta.hyper_hidden if meta.head == "hyper" else None,
        rule=meta.rule, balanced_loss=meta.balanced_loss, round=meta.round,
        # JSON has no NaN: a metric that could not be computed is null.
        metrics={k: v if math.isfinite(v) else None for k, v in meta.metrics.items()},
        client_ids=sorted(loaded.served.personal_heads) if admin else None,
        trained_client_ids=sorted(loaded.trained_clients) if admin else None,
        privacy=_privacy_info(meta.privacy) if meta.privacy else None,
        limits=Limits(max_batch=settings.max_batch, max_body_bytes=settings.max_body_bytes,
                      body_timeout_s=settings.body_timeout_s, head_cache_size=settings.head_cache_size),
    )


# The admin token is optional here (security [{}]: none needed); it adds the participant lists.
@router.get("/v1/model", response_model=ModelInfo, openapi_extra={"security": [{}]},
            summary="What is served: dataset, classes, input shape and normalisation, head, metrics")
async def model_info(request: Request,
                     credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]):
    return _model_info(request.app.state.service.current, request.app.state.settings,
                       is_admin(request, credentials))
