"""Liveness and readiness probes (GET /healthz, /readyz): what a load balancer or Kubernetes polls."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ..schemas import Health, Ready

router = APIRouter(tags=["health"])


LIVENESS = "Liveness: the process answers"
READINESS = "Readiness: a model is loaded (it is from start-up on, and stays so across reloads)"


# HEAD too: what many load balancers and uptime checks send. A route of its own, so that each operation has
# an id of its own (one route for both methods gave both the same operationId).
@router.get("/healthz", response_model=Health, summary=LIVENESS)
@router.head("/healthz", response_model=Health, summary=LIVENESS)
async def healthz():
    return Health(status="ok")


@router.get("/readyz", response_model=Ready, summary=READINESS)
@router.head("/readyz", response_model=Ready, summary=READINESS)
async def readyz(request: Request):
    return Ready(status="ready", model_version=request.app.state.service.current.served.version_id)
