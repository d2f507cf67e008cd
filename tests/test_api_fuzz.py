"""Schemathesis drives every operation of the OpenAPI schema, in-process over ASGI, with valid and invalid
requests: no response may be a 5xx, and every response must match its documented status, content type
and schema."""

from __future__ import annotations

import pytest
import schemathesis
from fedrod_ray_api.app import create_app
from fedrod_ray_api.settings import Settings
from hypothesis import HealthCheck, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from served import make_final

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
TOKEN = "fuzz-token"


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory):
    run = tmp_path_factory.mktemp("fuzz")
    make_final(run, "hyper")
    # A small batch and body limit, so that generated requests also hit those limits; with a token, so that
    # the reload operation gets past the 403 (a generated model_dir never holds a final/).
    app = create_app(Settings(model_dir=str(run), max_batch=8, max_body_bytes=2**16), admin_token=TOKEN)
    return schemathesis.openapi.from_asgi("/openapi.json", app)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.data_too_large])
def test_no_5xx_and_every_response_matches_the_schema(case):
    case.call_and_validate(checks=CHECKS, headers={"Authorization": f"Bearer {TOKEN}"})
