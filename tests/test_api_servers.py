"""The API over real HTTP: ``fedrod-ray serve`` (uvicorn in a subprocess) and Ray Serve (the deployment of
deploy/serve_config.yaml); and the CLI's errors for a run it cannot serve."""

from __future__ import annotations

import importlib
import json
import signal
import socket
from pathlib import Path

import httpx
import pytest
import yaml
from fedrod_ray_api.schemas import EXAMPLE_PNG
from served import make_final, uvicorn_server

from fedrod_ray.cli import main

REPO = Path(__file__).resolve().parents[1]
TOKEN = "servers-token"
COUNTS = [120, 0, 3, 0, 0, 45, 0, 310, 0, 2]
LIMIT = 2**16  # the body limit the servers are started with


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    make_final(run, "hyper")
    return run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _talk(base: str) -> dict:
    """The same few calls against either server; returns what an in-process app must also return."""
    with httpx.Client(base_url=base, timeout=30) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        version = http.get("/readyz").json()["model_version"]
        assert http.get("/v1/model").json()["version_id"] == version
        head = http.post("/v1/heads", json={"class_counts": COUNTS})
        assert head.status_code == 200
        assert http.get(f"/v1/heads/{head.json()['head_id']}").json() == head.json()
        predict = http.post("/v1/predict", json={"images_png": [EXAMPLE_PNG], "class_counts": COUNTS})
        assert predict.status_code == 200
        assert predict.json()["personalized"]["head_id"] == head.json()["head_id"]
        bad = http.post("/v1/predict", json={"images_png": [EXAMPLE_PNG], "class_counts": [1] * 9})
        assert bad.status_code == 422 and bad.json()["field"] == "class_counts"
        # Just over the limit: small enough to sit in the socket buffers, so the early 413 is read back.
        big = http.post("/v1/predict", content=b"x" * (LIMIT + 1),
                        headers={"content-type": "application/json"})
        assert big.status_code == 413
        return {"version": version, "head": head.json(), "predict": predict.json()}


def _in_process(run_dir: Path) -> dict:
    from fastapi.testclient import TestClient
    from fedrod_ray_api.app import create_app

    with TestClient(create_app(str(run_dir))) as client:
        head = client.post("/v1/heads", json={"class_counts": COUNTS}).json()
        predict = client.post("/v1/predict", json={"images_png": [EXAMPLE_PNG], "class_counts": COUNTS})
        return {"version": head["model_version"], "head": head, "predict": predict.json()}


def _assert_close(got, want, where="") -> None:
    """Equal, floats up to rounding: a replica's torch runs one thread, this process several, and their
    sums round differently."""
    if isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), where
    elif isinstance(want, (list, dict)):
        assert type(got) is type(want) and len(got) == len(want), where
        for k in (want if isinstance(want, dict) else range(len(want))):
            _assert_close(got[k], want[k], f"{where}/{k}")
    else:
        assert got == want, where


def test_fedrod_ray_serve_on_uvicorn(run_dir):
    with uvicorn_server(run_dir, "--max-body-bytes", str(LIMIT), env={"FEDROD_ADMIN_TOKEN": TOKEN}) as (
            proc, base, _):
        assert base.startswith("http://127.0.0.1:")
        _assert_close(_talk(base), _in_process(run_dir))
        reload = httpx.post(f"{base}/v1/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"})
        assert reload.status_code == 200 and reload.json()["changed"] is False
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0  # Ctrl-C is the normal way to stop it


def test_ray_serve_deployment(ray_session, run_dir):
    from fedrod_ray_api.serve import FedRodAPI
    from fedrod_ray_api.settings import Settings
    from ray import serve
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((REPO / "deploy" / "serve_config.yaml").read_text())
    ServeDeploySchema.model_validate(config)  # what `serve run` / `serve deploy` check
    (app_config,) = config["applications"]
    module, builder = app_config["import_path"].split(":")
    args = {**app_config["args"], "model_dir": str(run_dir), "max_body_bytes": LIMIT}
    assert isinstance(getattr(importlib.import_module(module), builder)(args), Application)

    # The config's deployment options, but a tenth of a CPU: the session's Ray has 2, shared with other tests.
    (deployment,) = app_config["deployments"]
    options = {k: v for k, v in deployment.items() if k != "ray_actor_options"}
    app = FedRodAPI.options(**options, ray_actor_options={"num_cpus": 0.1}).bind(
        Settings(**args).model_dump())
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(app, name="fedrod-test", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        _assert_close(_talk(base), _in_process(run_dir))
        r = httpx.post(f"{base}/v1/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert r.status_code == 403 and "redeploy" in r.json()["detail"]
    finally:
        serve.shutdown()


def _error_of(capsys, *argv) -> str:
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedrod-ray: error: "), err
    return err


def test_serve_refuses_what_it_cannot_serve(capsys, tmp_path, run_dir):
    assert "final/meta.json does not exist" in _error_of(capsys, str(tmp_path / "nothing"))
    broken = tmp_path / "broken"
    make_final(broken, "hyper")
    (broken / "final" / "model.safetensors").write_bytes(b"half")
    assert "model.safetensors" in _error_of(capsys, str(broken))
    assert "model.safetensors" in _error_of(capsys, str(broken), "--ray")  # before any Ray starts
    meta = json.loads((run_dir / "final" / "meta.json").read_text())
    assert meta["head"] == "hyper"
    assert "--max-batch" in _error_of(capsys, str(run_dir), "--max-batch", "0")
    assert "--body-timeout" in _error_of(capsys, str(run_dir), "--body-timeout", "0")
    assert "--port 0" in _error_of(capsys, str(run_dir), "--ray", "--port", "0")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert f"cannot listen on 127.0.0.1:{port}" in _error_of(capsys, str(run_dir), "--port", str(port))
