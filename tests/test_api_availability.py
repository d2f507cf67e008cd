"""Availability under hostile load (issue 49): small, in-limit requests crafted to be expensive must not
make the other clients wait, nor deny them. Each test is written from the attacker's side and checks an
outcome (what is refused, what is held, that a legitimate request is answered), never a latency: the
latencies are bench/availability.py's."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from fedrod_ray_api.app import create_app
from fedrod_ray_api.errors import MAX_LISTED
from fedrod_ray_api.json_body import parse
from fedrod_ray_api.schemas import HeadRequest, PredictRequest
from served import make_final

JSON = {"content-type": "application/json"}
# 800 KB bodies of 200,000 invalid items each (issue 49: 1.8 s to answer each, on the event loop in part).
INVALID = 200_000
MANY_INVALID = {
    "images": b'{"images": [[[[' + b",".join([b'"a"'] * INVALID) + b"]]]]}",
    "images_png": b'{"images_png": [' + b",".join([b"1"] * INVALID) + b"]}",
    "class_distribution": b'{"images_png": ["x"], "class_distribution": [' + b",".join([b'"a"'] * INVALID) + b"]}",
    "class_counts": b'{"class_counts": [' + b",".join([b"-1"] * INVALID) + b"]}",
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    make_final(run, "hyper")
    return run


@pytest.mark.parametrize("field", list(MANY_INVALID))
def test_validation_stops_at_the_first_few_errors(field):
    """The errors of a body are not collected item by item: a list stops at its first invalid item."""
    body = MANY_INVALID[field]
    model = HeadRequest if field == "class_counts" else PredictRequest
    with pytest.raises(RequestValidationError) as caught:
        parse(model, body, None, "")
    errors = caught.value.errors()
    assert 1 <= len(errors) <= MAX_LISTED, len(errors)
    assert errors[0]["loc"][:2] == ("body", field), errors[0]["loc"]


def test_many_invalid_items_answer_422_naming_the_first(run_dir):
    with TestClient(create_app(str(run_dir))) as client:
        r = client.post("/v1/predict", content=MANY_INVALID["images"], headers=JSON)
    assert r.status_code == 422 and r.json()["field"] == "images[0][0][0][0]", r.text
    assert "more errors" not in r.json()["detail"], r.json()["detail"][:300]
