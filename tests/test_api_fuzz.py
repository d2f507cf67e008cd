"""Schemathesis drives every operation of the OpenAPI schema, in-process over ASGI, with valid and invalid
requests: no response may be a 5xx, every response must match its documented status, content type and
schema, and every request the schema allows must be accepted (2xx, or 404/409 for an unknown head or a
head the model lacks: the positive-data check)."""

from __future__ import annotations

import base64
import gc
import io

import pytest
import schemathesis

# What schemathesis imports on its first schema, imported here at collection instead: CPython 3.11's ast.parse
# (hypothesis reads lambdas' source) can fail with "AST constructor recursion depth mismatch" when another
# thread changes the recursion limit meanwhile, and in the fixture other tests' threads may still run.
import schemathesis.specs.openapi.schemas
from fedrod_ray_api.app import create_app
from fedrod_ray_api.settings import Settings
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from PIL import Image
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)
from served import SHAPE, make_final

# Slow (hundreds of generated requests, about two minutes on 2 cores): not in the fast lane.
pytestmark = pytest.mark.slow

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          positive_data_acceptance]
TOKEN = "fuzz-token"


def _png(pixels: bytes) -> str:
    buf = io.BytesIO()
    Image.frombytes("L", (SHAPE[2], SHAPE[1]), pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


# images_png's items are base64 PNGs of the model's size ("format": "byte", image/png): generated as such,
# as no schema can say what a PNG holds.
@schemathesis.hook
def map_body(context, body):
    """Whole floats as integer literals: JSON Schema's "integer" takes 5.0, this API's strict numbers do not
    (a float is not a count), which no schema keyword can say."""
    if isinstance(body, float) and body.is_integer() and abs(body) <= 2**53:
        return int(body)
    if isinstance(body, list):
        return [map_body(context, x) for x in body]
    if isinstance(body, dict):
        return {k: map_body(context, v) for k, v in body.items()}
    return body


schemathesis.openapi.format("byte", st.binary(min_size=SHAPE[1] * SHAPE[2], max_size=SHAPE[1] * SHAPE[2]).map(_png))


@pytest.fixture(scope="module", autouse=True)
def no_collection_inside_ast_parse():
    """Hypothesis calls ast.parse while it generates; a garbage collection inside it can run a finalizer that
    moves the recursion limit (hypothesis's own stack guard), and CPython 3.11 then fails the parse with "AST
    constructor recursion depth mismatch" (2 of 3 whole-suite runs). Collected before, not during, this module."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


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
