"""Liveness and readiness probes (GET /healthz, /readyz): what a load balancer or Kubernetes polls."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..schemas import Health, Ready

router = APIRouter(tags=["health"])


# HEAD too: what many load balancers and uptime checks send.
@router.api_route("/healthz", methods=["GET", "HEAD"], response_model=Health,
                  summary="Liveness: the process answers")
async def healthz():
    return Health(status="ok")


@router.api_route("/readyz", methods=["GET", "HEAD"], response_model=Ready,
            summary="Readiness: a model is loaded (it is from start-up on, and stays so across reloads)")
async def readyz(request: Request):
    return Ready(status="ready", model_version=request.app.state.service.current.served.version_id)
