"""The parse workers (api/parse_workers.py): a large body is parsed in a worker process, with the same answer
as in the serving process, under a queue limit (503) and a CPU limit (413), with real worker processes.
tests/test_api_limits.py checks from outside, on both servers, that the serving process does not parse it."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import pickle
import re
import signal

import numpy as np
import pytest
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from fedrod_ray_api.app import create_app
from fedrod_ray_api.errors import ApiError, TooLarge, Unauthorized, Unavailable
from fedrod_ray_api.parse_workers import ParseWorkers
from fedrod_ray_api.schemas import EXAMPLE_PNG
from fedrod_ray_api.settings import Settings
from PIL import Image
from served import make_final

JSON = {"content-type": "application/json"}
IN_PROCESS = 2**40  # a parse_process_bytes no body reaches


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    make_final(run, "hyper")
    return run


@pytest.fixture(scope="module")
def clients(run_dir):
    """(in the worker processes, in the serving process): the same app, one parsing every body over 8 KiB in
    a worker, the other none."""
    workers = create_app(Settings(model_dir=str(run_dir), parse_process_bytes=8 * 1024))
    local = create_app(Settings(model_dir=str(run_dir), parse_process_bytes=IN_PROCESS))
    with TestClient(workers) as a, TestClient(local) as b:
        # Each head cache keys its ids with a secret of its own (api/heads.py): one secret for both, so that the
        # same request gets the same head id from either app.
        local.state.service.current.heads.secret = workers.state.service.current.heads.secret
        yield a, b
    assert not workers.state.parse_workers.pids(), "the app's shutdown stops its workers"


def _images(n: int, normalized: bool = False) -> list:
    rng = np.random.default_rng(n)
    x = rng.uniform(0, 255, size=(n, 1, 28, 28))
    if normalized:
        x = (x / 255 - 0.1307) / 0.3081
    return x.tolist()  # full-precision floats: rounding them to float32 is part of what must match


def _png(w: int, h: int) -> str:
    out = io.BytesIO()
    Image.new("L", (w, h)).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


BODIES = {
    "raw": {"images": _images(64)},
    "normalized": {"images": _images(64, normalized=True), "pixels": "normalized", "top_k": 5},
    "png": {"images_png": [EXAMPLE_PNG] * 200, "class_counts": [3, 0, 1, 0, 0, 0, 0, 9, 0, 1]},
    "personal": {"images": _images(32), "class_distribution": [0.1] * 10},
    # Refused: the answers must be the same too, whichever check refuses them first.
    "too many": {"images": _images(257)},
    "ragged": {"images": _images(40) + [[[[1.0] * 27] * 28]]},
    "out of range": {"images": _images(39) + [[[[256.0] * 28] * 28]]},
    "top_k": {"images": _images(40), "top_k": 11},
    "invalid item": {"images": _images(30) + [[[["a"] * 28] * 28]]},
    "client head, no token": {"images": _images(257), "client_id": 0},
    "png not base64": {"images_png": [EXAMPLE_PNG] * 100 + ["not base64!"]},
    "png too many": {"images_png": [EXAMPLE_PNG] * 257},
    "png of another size": {"images_png": [EXAMPLE_PNG] * 100 + [_png(27, 28)]},
    "duplicate key": None,  # below: json.dumps cannot write one
}


def _body(name: str) -> bytes:
    if name == "duplicate key":
        return json.dumps({"images": _images(40)}).encode()[:-1] + b', "top_k": 1, "top_k": 2}'
    return json.dumps(BODIES[name]).encode()


@pytest.mark.parametrize("name", list(BODIES))
def test_a_worker_answers_as_the_serving_process_does(clients, name):
    """Predictions and refusals alike: bitwise the same JSON, whichever process parsed the body."""
    body = _body(name)
    assert len(body) > 8 * 1024
    workers, local = clients
    a = workers.post("/v1/predict", content=body, headers=JSON)
    b = local.post("/v1/predict", content=body, headers=JSON)
    assert (a.status_code, a.content) == (b.status_code, b.content), (a.text[:300], b.text[:300])
    assert workers.app.state.parse_workers.pids(), "the body went to a worker"
    assert not local.app.state.parse_workers.pids()


def test_a_large_head_request_is_parsed_by_a_worker_too(clients):
    workers, local = clients
    body = b'{"class_counts": [' + b",".join([b"1"] * 9) + b", 1" + b" " * 9000 + b"]}"
    a = workers.post("/v1/heads", content=body, headers=JSON)
    b = local.post("/v1/heads", content=body, headers=JSON)
    assert a.status_code == 200 and a.content == b.content, a.text[:300]


@pytest.mark.parametrize("error", [ApiError("top_k", "is 99"), TooLarge("body", "too many"),
                                   Unauthorized("Authorization", "no token"),
                                   Unavailable("body", "busy", 3),
                                   RequestValidationError([{"type": "x", "loc": ("body", "images"),
                                                            "msg": "m", "ctx": {"field": "images", "message": "m"}}])],
                         ids=lambda e: type(e).__name__)
def test_errors_come_back_from_a_worker_whole(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    if isinstance(error, ApiError):
        assert (back.status, back.field, back.detail, back.headers) == (error.status, error.field, error.detail,
                                                                      error.headers)
    else:
        assert back.errors() == error.errors()


@contextlib.contextmanager
def _pool(workers: int, queue_size: int, cpu_s: int):
    pool = ParseWorkers(workers, queue_size, cpu_s)
    pool.start()
    try:
        yield pool
    finally:
        pool.close()


def _stopped(pids: list[int]):
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)

    def resume():
        for pid in pids:
            os.kill(pid, signal.SIGCONT)

    return resume


def test_a_full_queue_is_503_with_retry_after():
    """One worker, held stopped, parsing one body and one waiting: the next body is refused at once."""
    async def scenario(pool: ParseWorkers):
        resume = _stopped(pool.pids())
        try:
            held = [asyncio.ensure_future(pool.run(len, [b"x" * n])) for n in (1, 2)]
            await asyncio.sleep(0)  # both admitted: one in the worker, one waiting for it
            with pytest.raises(Unavailable) as refused:
                await pool.run(len, [b"xyz"])
            assert not any(t.done() for t in held)
        finally:
            resume()
        return refused.value, await asyncio.gather(*held)

    with _pool(1, 1, 5) as pool:
        refused, answered = asyncio.run(scenario(pool))
    assert refused.status == 503 and refused.headers == {"Retry-After": "1"} and refused.field == "body"
    assert "parse_workers, parse_queue" in refused.detail, refused.detail
    assert answered == [1, 2]


def test_a_body_over_the_cpu_limit_is_413_and_its_worker_replaced():
    """A job that would burn CPU for ever (a regular expression backtracking exponentially) is ended by the
    kernel at the CPU limit; the next job gets a new worker."""
    with _pool(1, 0, 1) as pool:
        first = pool.pids()
        with pytest.raises(TooLarge) as refused:
            asyncio.run(pool.run(re.fullmatch, [b"(a+)+b"], b"a" * 64))
        assert refused.value.status == 413 and "more than 1 s of CPU" in refused.value.detail
        assert "parse_cpu_s" in refused.value.detail
        assert asyncio.run(pool.run(len, [b"ab", b"cd"])) == 4
        assert pool.pids() and pool.pids() != first


def test_a_worker_killed_meanwhile_is_503_and_replaced():
    with _pool(1, 0, 5) as pool:
        (pid,) = pool.pids()
        resume = _stopped([pid])

        async def scenario():
            job = asyncio.ensure_future(pool.run(len, [b"abc"]))
            await asyncio.sleep(0)
            os.kill(pid, signal.SIGKILL)
            resume()
            return await job

        with pytest.raises(Unavailable) as refused:
            asyncio.run(scenario())
        assert refused.value.headers == {"Retry-After": "1"} and "-9" in refused.value.detail
        assert asyncio.run(pool.run(len, [b"ab"])) == 2


def test_the_workers_exit_when_the_server_goes():
    """A worker reads its jobs from the server: when that pipe closes (the server ended, however), it exits."""
    pool = ParseWorkers(1, 0, 5)
    pool.start()
    (worker,) = list(pool._all)
    worker.proc.stdin.close()
    assert worker.proc.wait(30) == 0
    worker.proc.stdout.close()


@pytest.mark.parametrize("field, value", [("parse_workers", 0), ("parse_queue", -1), ("parse_cpu_s", 0),
                                          ("parse_process_bytes", 1024)])
def test_parse_settings_are_checked(run_dir, field, value):
    with pytest.raises(ValueError, match=field):
        Settings(model_dir=str(run_dir), **{field: value})
