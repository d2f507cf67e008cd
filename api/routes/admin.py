"""POST /v1/admin/reload: serve a new final/ without a restart, behind the admin's bearer token (enabled
only when the server was started with one)."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from ..errors import Forbidden, Unauthorized, responses
from ..json_body import json_body, request_body
from ..schemas import ReloadRequest, ReloadResponse
from ..settings import ADMIN_TOKEN_ENV

router = APIRouter(tags=["admin"])

# Module level: FastAPI resolves the (string) annotations of dependencies in this module's globals.
BEARER = HTTPBearer(auto_error=False, description=f"the token in ${ADMIN_TOKEN_ENV} of the server")
# Only the admin sends it, after the token check: no bound on its values (a path may hold commas).
RELOAD_BODY = json_body(ReloadRequest, optional=True)


def is_admin(request: Request, credentials: HTTPAuthorizationCredentials | None) -> bool:
    """Whether the request carries the admin token, compared in constant time; never on a server started
    without one."""
    admin_token = request.app.state.admin_token
    given = credentials.credentials.encode() if credentials else b""
    return bool(admin_token) and hmac.compare_digest(given, admin_token.encode())


def admin(request: Request,
          credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> None:
    if not request.app.state.admin_token:
        raise Forbidden(None, f"reload is disabled: this server was started without ${ADMIN_TOKEN_ENV} "
                              f"(on Ray Serve, redeploy with the new model_dir instead)")
    if not is_admin(request, credentials):
        raise Unauthorized("Authorization", f"needs 'Bearer <token>', the token in ${ADMIN_TOKEN_ENV}")


@router.post("/v1/admin/reload", response_model=ReloadResponse, dependencies=[Depends(admin)],
             responses=responses(401, 403, 408, 409, 413, 415, 422, 503),
             openapi_extra=request_body(ReloadRequest, required=False),
             summary="Serve the final/ of model_dir (default: the served run's, e.g. after new training)")
async def reload(request: Request, req: Annotated[ReloadRequest | None, RELOAD_BODY]):
    previous, now = await request.app.state.service.reload(req.model_dir if req else None)
    if now is not previous:
        request.app.openapi_schema = None  # the next /openapi.json describes the new model
    return ReloadResponse(version_id=now.served.version_id,
                          previous_version_id=previous.served.version_id, changed=now is not previous)
