"""Real servers on loopback for the tests: an S3-compatible object store (moto's standalone server) and an
MLflow tracking server, each a child process started by a fixture and stopped when it ends."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(cmd: list[str], url: str, log: Path, timeout: float = 120) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` and wait until ``url`` answers; on exit, stop it and its children."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                urllib.request.urlopen(url, timeout=5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{cmd[:3]} did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.25)
        yield proc
    finally:
        # Its own session: the group holds the server and whatever workers it started, nothing else.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


# Credentials of the loopback S3 server: only ever in the environment, never in a file a run saves.
S3_KEY_ID, S3_SECRET = "fedrodtestkey", "fedrod-test-secret-9f3c1e"


@contextlib.contextmanager
def s3_server(tmp: Path) -> Iterator[dict[str, str]]:
    """moto's S3 server on a free loopback port; yields the environment that points the AWS SDKs (boto3,
    pyarrow's S3FileSystem) at it, exactly the variables a user sets for a real endpoint."""
    port = free_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": S3_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": S3_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    cmd = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with server_process(cmd, f"http://127.0.0.1:{port}/moto-api/", tmp / "moto.log"):
        yield env
