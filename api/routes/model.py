"""GET /v1/model: what is served (dataset, classes, input, head, metrics, limits), so a client can build
its requests from the server's answer alone."""

from __future__ import annotations

import dataclasses
import math

from fastapi import APIRouter, Request

from .. import images
from ..schemas import InputSpec, Limits, ModelInfo
from ..service import Loaded
from ..settings import Settings

router = APIRouter(tags=["model"])


def _model_info(loaded: Loaded, settings: Settings) -> ModelInfo:
    meta = loaded.served.meta
    return ModelInfo(
        version_id=loaded.served.version_id, dataset=meta.dataset, class_names=meta.class_names,
        num_classes=meta.num_classes,
        input=InputSpec(shape=meta.image_shape, mean=meta.mean, std=meta.std, png_mode=images.png_mode(meta)),
        head=meta.head, method=meta.method, generic_model=meta.generic_model, new_client=meta.new_client, arch=meta.arch, hyper_hidden=meta.hyper_hidden if meta.head == "hyper" else None,
        rule=meta.rule, balanced_loss=meta.balanced_loss, round=meta.round,
        # JSON has no NaN: a metric that could not be computed is null.
        metrics={k: v if math.isfinite(v) else None for k, v in meta.metrics.items()},
        client_ids=sorted(loaded.served.personal_heads), trained_client_ids=sorted(loaded.trained_clients),
        privacy=dataclasses.asdict(meta.privacy) if meta.privacy else None,
        limits=Limits(max_batch=settings.max_batch, max_body_bytes=settings.max_body_bytes,
                      body_timeout_s=settings.body_timeout_s, head_cache_size=settings.head_cache_size),
    )


@router.get("/v1/model", response_model=ModelInfo,
            summary="What is served: dataset, classes, input shape and normalisation, head, metrics")
async def model_info(request: Request):
    return _model_info(request.app.state.service.current, request.app.state.settings)
