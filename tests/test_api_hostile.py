"""Hostile clients against a real ``fedrod-ray serve`` (uvicorn in a subprocess): bodies made to be expensive
to parse are refused before parsing while /healthz keeps answering, and a body that never arrives does not
hold its connection."""

from __future__ import annotations

import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
from served import make_final, uvicorn_server

# Slow (a real uvicorn in a subprocess): not in the fast lane.
pytestmark = pytest.mark.slow

BODY_TIMEOUT = 5  # seconds: long enough for 16 MiB over loopback on a loaded machine
LIVENESS = 60  # seconds a /healthz may take before the server counts as stalled: generous, never a speed test
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    make_final(run, "hyper")
    # The default limits: 16 MiB bodies, 256 images per request.
    with uvicorn_server(run, "--body-timeout", str(BODY_TIMEOUT)) as (_, base, _lines):
        yield base


# Each under the 16 MiB body limit, each millions of JSON values (issue 20).
HOSTILE = {
    "/v1/predict": [b'{"images": [' + b",".join([b"[[[0]]]"] * 2_000_000) + b"]}",
                    b'{"images": [[[[0]]]], "class_distribution": [' + b"0," * 8_000_000 + b"0]}"],
    "/v1/heads": [b'{"class_distribution": [' + b"0," * 8_000_000 + b"0]}"],
}


def test_bodies_of_millions_of_values_are_refused_while_healthz_answers(server):
    answers: list[tuple[str, int, str]] = []

    def hostile(path: str, body: bytes) -> None:
        with httpx.Client(base_url=server, timeout=LIVENESS) as http:
            for _ in range(2):
                r = http.post(path, content=body, headers=JSON)
                answers.append((path, r.status_code, r.text))

    threads = [threading.Thread(target=hostile, args=(path, body)) for path, bodies in HOSTILE.items()
               for body in bodies]
    for t in threads:
        t.start()
    healthy_while_in_flight = 0
    with httpx.Client(base_url=server, timeout=LIVENESS) as http:
        while any(t.is_alive() for t in threads):
            assert http.get("/healthz").json() == {"status": "ok"}
            healthy_while_in_flight += 1
        for t in threads:
            t.join()
        assert len(answers) == 2 * len(threads)
        for path, status, text in answers:
            assert status == 413 and '"field":"body"' in text and "JSON values" in text, (path, text[:300])
        assert healthy_while_in_flight >= 1
        # The server is still whole: a real request works.
        ok = http.post("/v1/heads", json={"class_counts": [1] * 10})
        assert ok.status_code == 200


def _raw_request(base: str, declared: int, parts: list[bytes], pause: float) -> bytes:
    """POST /v1/heads declaring ``declared`` body bytes, sending ``parts`` ``pause`` s apart; everything the
    server sends back until it closes the connection."""
    url = urlsplit(base)
    with socket.create_connection((url.hostname, url.port), timeout=LIVENESS) as sock:
        sock.sendall(b"POST /v1/heads HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % declared)
        for part in parts:
            try:
                sock.sendall(part)
            except OSError:  # the server has already answered and closed
                break
            time.sleep(pause)
        received = b""
        while chunk := sock.recv(65536):  # b"" once the server closes the connection
            received += chunk
        return received


@pytest.mark.parametrize("parts,pause", [([b'{"class_co'], 0), ([b"{"] * 40, 0.5)],
                         ids=["stalled", "trickled"])
def test_a_body_that_does_not_arrive_in_time_is_408_and_closed(server, parts, pause):
    result: list[bytes] = []
    t = threading.Thread(target=lambda: result.append(_raw_request(server, 1000, parts, pause)))
    t.start()
    with httpx.Client(base_url=server, timeout=LIVENESS) as http:
        while t.is_alive():
            assert http.get("/healthz").status_code == 200
            time.sleep(0.2)
    t.join()
    head, _, body = result[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), result[0][:300]
    assert b"connection: close" in head.lower()
    assert b'"field":"body"' in body and b"declared" in body and f"in {BODY_TIMEOUT} s".encode() in body
