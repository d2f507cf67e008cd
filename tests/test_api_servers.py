"""The API over real HTTP: ``fedrod-ray serve`` (uvicorn in a subprocess) and Ray Serve (the deployment of
deploy/serve_config.yaml); and the CLI's errors for a run it cannot serve."""

from __future__ import annotations

import base64
import importlib
import io
import json
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from fedrod_ray_api.schemas import EXAMPLE_PNG
from PIL import Image
from served import CLI_WITH_SIGINT, make_final, uvicorn_server

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


def _keyless(answer):
    """An answer (or a list of them) without its head ids, which each server keys with a secret of its own."""
    if isinstance(answer, list):
        return [_keyless(a) for a in answer]
    if isinstance(answer, dict):
        return {k: _keyless(v) for k, v in answer.items() if k != "head_id"}
    return answer


def _concurrent_predictions(where: str | Path) -> list[dict]:
    """Predict requests of 1-3 images with different heads, sent at once to a server at ``where`` (URL: a
    Ray Serve replica batches them into one forward) or, for a run dir, one by one to an in-process app."""
    rng = np.random.default_rng(0)
    pngs = []
    for _ in range(6):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8), mode="L").save(buf, format="PNG")
        pngs.append(base64.b64encode(buf.getvalue()).decode())
    bodies = [{"images_png": pngs[i % 6:i % 6 + 1 + i % 3], "top_k": 2,
               **({"class_counts": [i + 1] + COUNTS[1:]} if i % 2 else {})} for i in range(12)]
    if isinstance(where, Path):
        from fastapi.testclient import TestClient
        from fedrod_ray_api.app import create_app

        with TestClient(create_app(str(where))) as client:
            return [client.post("/v1/predict", json=body).json() for body in bodies]
    with httpx.Client(base_url=where, timeout=60) as http, ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: http.post("/v1/predict", json=body), bodies))
    assert [r.status_code for r in answers] == [200] * len(bodies)
    return [r.json() for r in answers]


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


@pytest.mark.slow
def test_fedrod_ray_serve_on_uvicorn(run_dir):
    with uvicorn_server(run_dir, "--max-body-bytes", str(LIMIT), env={"FEDROD_ADMIN_TOKEN": TOKEN}) as (
            proc, base, _):
        assert base.startswith("http://127.0.0.1:")
        _assert_close(_keyless(_talk(base)), _keyless(_in_process(run_dir)))
        reload = httpx.post(f"{base}/v1/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"})
        assert reload.status_code == 200 and reload.json()["changed"] is False
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0  # Ctrl-C is the normal way to stop it


def test_ray_serve_deployment(ray_session, run_dir):
    from fedrod_ray_api.serve import REPLICA_ENV, FedRodAPI
    from fedrod_ray_api.settings import Settings
    from ray import serve
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((REPO / "deploy" / "serve_config.yaml").read_text())
    ServeDeploySchema.model_validate(config)  # what `serve run` / `serve deploy` check
    (app_config,) = config["applications"]
    # The file's replicas get the variables the deployment's own options give them.
    assert REPLICA_ENV.items() <= app_config["runtime_env"]["env_vars"].items()
    assert FedRodAPI.ray_actor_options["runtime_env"]["env_vars"] == REPLICA_ENV
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
        _assert_close(_keyless(_talk(base)), _keyless(_in_process(run_dir)))
        _assert_close(_keyless(_concurrent_predictions(base)), _keyless(_concurrent_predictions(run_dir)))
        r = httpx.post(f"{base}/v1/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        assert r.status_code == 403 and "redeploy" in r.json()["detail"]
    finally:
        serve.shutdown()


def test_fedrod_ray_serve_on_a_ray_of_its_own(private_ray_env, run_dir):
    """``fedrod-ray serve RUN --ray`` with no Ray running: it starts one in the high-throughput mode (HAProxy,
    set by the CLI itself), answers like the in-process app, and Ctrl-C deletes the app and stops that Ray."""
    from fedrod_ray_api.serve import LOCAL_RAY_ENV

    env = {k: v for k, v in private_ray_env.items() if k not in LOCAL_RAY_ENV}
    port = _free_port()
    cmd = [*CLI_WITH_SIGINT, "serve", str(run_dir), "--ray", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("fedrod-ray: serving") for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.5)
        assert any("haproxy" in cmdline for _, cmdline in private_ray_env.processes())
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            head = http.post("/v1/heads", json={"class_counts": COUNTS})
            predict = http.post("/v1/predict", json={"images_png": [EXAMPLE_PNG], "class_counts": COUNTS})
        want = _keyless(_in_process(run_dir))
        _assert_close(_keyless({"version": head.json()["model_version"], "head": head.json(),
                                "predict": predict.json()}), want)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 0, "".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ray_serve_adds_a_replica_under_load(ray_session, run_dir):
    """The autoscaling config at work: predict traffic at concurrency 8 against a target of 1 request in flight
    per replica brings up a second replica."""
    from fedrod_ray_api.serve import FedRodAPI
    from fedrod_ray_api.settings import Settings
    from ray import serve

    autoscaling = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1, "upscale_delay_s": 0.5,
                   "downscale_delay_s": 600, "look_back_period_s": 1, "metrics_interval_s": 0.5}
    app = FedRodAPI.options(autoscaling_config=autoscaling, max_ongoing_requests=64,
                            ray_actor_options={"num_cpus": 0.1}).bind(Settings(model_dir=str(run_dir)).model_dump())
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            while not stop.is_set():
                assert http.post("/v1/predict", json={"images_png": [EXAMPLE_PNG]}).status_code == 200

    try:
        serve.run(app, name="fedrod-autoscale", route_prefix="/")
        with ThreadPoolExecutor(8) as pool:
            senders = [pool.submit(load) for _ in range(8)]
            deadline, running = time.monotonic() + 120, 1
            while running < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
                (status,) = serve.status().applications["fedrod-autoscale"].deployments.values()
                running = status.replica_states.get("RUNNING", 0)
            stop.set()
            for sender in senders:
                sender.result()  # every request was answered
        assert running == 2
    finally:
        stop.set()
        serve.shutdown()


def test_serve_batch_config_names_a_bad_field():
    from fedrod_ray_api.serve import BatchConfig
    from pydantic import ValidationError

    assert BatchConfig.model_validate({}).batch_wait_s == 0.002
    for bad, field in (({"batch_wait": 0.01}, "batch_wait"), ({"batch_wait_s": -1}, "batch_wait_s"),
                       ({"batch_wait_s": "soon"}, "batch_wait_s")):
        with pytest.raises(ValidationError, match=field):
            BatchConfig.model_validate(bad)


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
    assert "--max-bodies-bytes" in _error_of(capsys, str(run_dir), "--max-body-bytes", "4096",
                                             "--max-bodies-bytes", "2048")
    assert "--header-timeout" in _error_of(capsys, str(run_dir), "--header-timeout", "0")
    assert "--max-connections" in _error_of(capsys, str(run_dir), "--max-connections", "0")
    for flag, bad in (("--parse-process-bytes", "100"), ("--parse-workers", "0"), ("--parse-queue", "-1"),
                      ("--parse-cpu", "0")):
        assert flag in _error_of(capsys, str(run_dir), flag, bad)
    assert "--allow-factory: Value error, 'builtins' is not a package.module:factory" in _error_of(
        capsys, str(run_dir), "--allow-factory", "builtins")
    assert "--port 0" in _error_of(capsys, str(run_dir), "--ray", "--port", "0")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert f"cannot listen on 127.0.0.1:{port}" in _error_of(capsys, str(run_dir), "--port", str(port))
