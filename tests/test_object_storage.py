"""Run directories on an object store, through pyarrow's S3 filesystem exactly as a user's
``s3://bucket/runs/x`` goes, against a real S3-compatible server (moto's) on loopback: a run, a
checkpoint save killed between its steps or while the next round trains, ``--resume`` from the bucket
bitwise equal to an uninterrupted run (on Ray too), ``final/`` served by the HTTP service and reloaded to a
new version, and no credentials in any file."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from fastapi.testclient import TestClient
from fedrod_ray_api.app import create_app
from servers import S3_KEY_ID, S3_SECRET, s3_server
from test_cli import CONFIG, REPO, run_main

from fedrod_ray.federation_state.checkpoint import latest_checkpoint_name, load_checkpoint
from fedrod_ray.models.export import load_final
from fedrod_ray.outputs.storage import RunStorage

# Slow (a real S3 server (moto) in a subprocess, trainings killed and resumed): not in the fast lane.
pytestmark = pytest.mark.slow

BUCKET = "fedrod-runs"
FAST = ["--set", "runtime.torch_threads=1"]
TIMINGS = ("seconds", "train_seconds")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """The server, and this process's environment pointing at it (as a user's would at their endpoint)."""
    with s3_server(tmp_path_factory.mktemp("s3")) as env:
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            import boto3

            boto3.client("s3").create_bucket(Bucket=BUCKET)
            yield env
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def objects(prefix: str) -> dict[str, bytes]:
    import boto3

    s3 = boto3.client("s3")
    # pyarrow keeps an emptied "directory" as a marker object ending in "/": not a file.
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
            for o in page.get("Contents", []) if not o["Key"].endswith("/")]
    return {k[len(prefix):]: s3.get_object(Bucket=BUCKET, Key=k)["Body"].read() for k in keys}


def records(uri: str) -> list[dict]:
    lines = RunStorage(uri).read_bytes("metrics.jsonl").decode().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS} for line in lines]


def train(*args: str) -> str:
    rc, out, err = run_main(["train", *args, *FAST])
    assert rc == 0, err
    return out


@pytest.fixture(scope="module")
def uninterrupted(s3):
    """Three rounds straight through, in the bucket."""
    uri = f"s3://{BUCKET}/runs/straight"
    train("--config", CONFIG, "--run-dir", uri, "--set", "train.rounds=3")
    return uri


def assert_same_run(uri: str, reference: str) -> None:
    """Bitwise the same model, checkpoint and records as the reference run."""
    got, want = objects(uri[len(f"s3://{BUCKET}/"):] + "/"), objects(reference[len(f"s3://{BUCKET}/"):] + "/")
    for name in ("final/model.safetensors", "final/personal.safetensors", "final/meta.json",
                 "checkpoints/latest", "checkpoints/round_000003/global.safetensors"):
        assert got[name] == want[name], name
    assert records(uri) == records(reference)
    assert [r["round"] for r in records(uri)] == [1, 2, 3]


def test_a_run_in_the_bucket(s3, uninterrupted):
    files = objects("runs/straight/")
    assert {"config.yaml", "metrics.jsonl", "metrics.csv", "curves.png", "checkpoints/latest",
            "final/meta.json", "final/model.safetensors"} <= set(files)
    assert files["checkpoints/latest"] == b"round_000003"
    assert sorted({k.split("/")[1] for k in files if k.startswith("checkpoints/round_")}) == [
        "round_000002", "round_000003"]
    # Written in place: no temporary objects, not even of an atomic rename that S3 does not have.
    assert not [k for k in files if ".tmp-" in k]
    assert len(files["metrics.csv"].decode().splitlines()) == 4
    assert load_checkpoint(RunStorage(uninterrupted)).rounds_done == 3
    # The credentials came from the environment; no file of the run holds them.
    for name, data in objects("").items():
        assert S3_SECRET.encode() not in data and S3_KEY_ID.encode() not in data, name


# Killed in the last round's save, after its manifest, before ``latest`` names it (a kill before the
# manifest, the round's commit point, is the test after this one).
KILLER = """
import os, signal, sys
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.cli import main

write = RunStorage.write_bytes
def write_then_die(self, rel, data):
    if rel == "checkpoints/latest" and data == b"round_000003":
        os.kill(os.getpid(), signal.SIGKILL)
    write(self, rel, data)
RunStorage.write_bytes = write_then_die
sys.exit(main(["train", "--resume", {uri!r}, "--set", "train.rounds=3", "--set", "runtime.torch_threads=1"]))
"""


def assert_only_kept_rounds_left(prefix: str) -> None:
    """The next save removed what a killed one left: only the kept rounds and the client files they name."""
    left = objects(prefix)
    manifests = [json.loads(left[f"{r}/manifest.json"]) for r in ("round_000002", "round_000003")]
    named = {c["file"] for m in manifests for c in m["clients"].values() if c["file"]}
    assert {k.split("/", 1)[1] for k in left if k.startswith("clients/")} == named
    assert sorted({k.split("/")[0] for k in left if k.startswith("round_")}) == ["round_000002", "round_000003"]


def test_a_save_killed_between_its_steps_and_resumed_from_the_bucket(s3, uninterrupted):
    uri = f"s3://{BUCKET}/runs/killed"
    train("--config", CONFIG, "--run-dir", uri, "--set", "train.rounds=2")
    proc = subprocess.run([sys.executable, "-c", KILLER.format(uri=uri)], cwd=REPO, check=False,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert "[round   3/3]" in proc.stdout  # killed in round 3's save, after the round itself
    left = objects("runs/killed/checkpoints/")
    assert "round_000003/global.safetensors" in left and "round_000003/manifest.json" in left
    # The previous checkpoint is what loads.
    storage = RunStorage(uri)
    assert latest_checkpoint_name(storage) == "round_000002"
    assert load_checkpoint(storage).rounds_done == 2

    out = train("--resume", uri, "--set", "train.rounds=3")
    assert [ln.split("]")[0] for ln in out.splitlines() if ln.startswith("[round")] == ["[round   3/3"]
    assert_same_run(uri, uninterrupted)
    assert_only_kept_rounds_left("runs/killed/checkpoints/")


# Round 2's save held until round 3 has trained and appended its metrics, then the process killed: the
# save was in flight while the next round ran, as a run's saves are (``checkpoint.BackgroundSaves``).
IN_FLIGHT_KILLER = """
import os, signal, sys, threading
from fedrod_ray.cli import main
from fedrod_ray.outputs.results import MetricsLog
from fedrod_ray.outputs.storage import RunStorage

third_round = threading.Event()
append = MetricsLog.append
def append_and_tell(self, record):
    append(self, record)
    if record["round"] == 3:
        third_round.set()
MetricsLog.append = append_and_tell
write = RunStorage.write_bytes
def write_then_die(self, rel, data):
    if rel == "checkpoints/round_000002/manifest.json":
        if not third_round.wait(120):
            print("round 3 never ran while round 2's checkpoint was being saved", flush=True)
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    write(self, rel, data)
RunStorage.write_bytes = write_then_die
sys.exit(main(["train", "--config", {config!r}, "--run-dir", {uri!r}, "--set", "runtime.torch_threads=1"]))
"""


def test_a_run_killed_with_a_save_in_flight_resumes_from_the_save_before(s3, uninterrupted):
    """Killed while round 2's save is written (its files, not yet its manifest) and round 3 has already
    trained: round 1's checkpoint loads, the metrics of rounds 2 and 3 (written, but after the last
    committed checkpoint) are dropped on resume as a kill's always are, the resumed run ends bitwise equal
    to the uninterrupted one, and its saves removed what the killed one left."""
    uri = f"s3://{BUCKET}/runs/in-flight"
    proc = subprocess.run([sys.executable, "-c", IN_FLIGHT_KILLER.format(config=CONFIG, uri=uri)], cwd=REPO,
                          check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert [r["round"] for r in records(uri)] == [1, 2, 3]
    left = objects("runs/in-flight/checkpoints/")
    assert "round_000002/global.safetensors" in left and "round_000002/manifest.json" not in left
    storage = RunStorage(uri)
    assert latest_checkpoint_name(storage) == "round_000001"
    assert load_checkpoint(storage).rounds_done == 1
    with pytest.raises(FileNotFoundError, match="incomplete"):
        load_checkpoint(storage, "round_000002")

    out = train("--resume", uri)
    assert "resuming" in out and "after round 1" in out
    assert [ln.split("]")[0] for ln in out.splitlines() if ln.startswith("[round")] == ["[round   2/3", "[round   3/3"]
    assert_same_run(uri, uninterrupted)
    assert_only_kept_rounds_left("runs/in-flight/checkpoints/")


def test_a_ray_run_in_the_bucket_checkpoints_and_resumes(s3, uninterrupted, ray_session):
    """runtime.mode ray: the coordinator actor writes the run into the bucket (its checkpoints in the
    background, while the next round trains); resumed from the bucket, the run ends bitwise
    equal to the in-process one. The driver runs as a task of the tests' Ray, whose runtime_env gives it and
    the actors it starts the server's environment, as a Ray job's does on a cluster."""
    uri = f"s3://{BUCKET}/runs/ray"

    def train_and_resume(uri: str, config: str, fast: list[str]) -> list[tuple[int, str]]:
        """A run of 2 rounds and its resume to 3, as ``fedrod-ray train`` runs them in a Ray job (defined
        here, so that Ray ships it by value to a worker that cannot import the tests)."""
        import contextlib
        import io

        from fedrod_ray.cli import main

        outputs = []
        for argv in (["--config", config, "--run-dir", uri, "--mode", "ray", "--set", "train.rounds=2"],
                     ["--resume", uri, "--set", "train.rounds=3"]):
            out = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                rc = main(["train", *argv, *fast])
            outputs.append((rc, out.getvalue()))
        return outputs

    driver = ray_session.remote(train_and_resume).options(num_cpus=0, runtime_env={"env_vars": s3})
    (rc, first), (rc2, resumed) = ray_session.get(driver.remote(uri, CONFIG, FAST))
    assert rc == 0 and rc2 == 0, first + resumed
    for out in (first, resumed):
        assert re.search(r"^ray: \d+ client actor\(s\)", out, re.MULTILINE), out
    assert [ln.split("]")[0] for ln in first.splitlines() if ln.startswith("[round")] == ["[round   1/2", "[round   2/2"]
    assert "after round 2" in resumed
    assert [ln.split("]")[0] for ln in resumed.splitlines() if ln.startswith("[round")] == ["[round   3/3"]
    assert_same_run(uri, uninterrupted)


TOKEN = "s3-admin-token"


def test_the_service_serves_final_from_the_bucket_and_reloads_a_new_version(s3, uninterrupted):
    uri = f"s3://{BUCKET}/runs/served"
    train("--config", CONFIG, "--run-dir", uri, "--set", "train.rounds=2")
    first = load_final(uri).version_id
    admin = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(uri, admin_token=TOKEN)) as client:
        model = client.get("/v1/model").json()
        assert model["version_id"] == first and model["round"] == 2
        train("--resume", uri, "--set", "train.rounds=3")  # training writes a new final/ in the bucket
        r = client.post("/v1/admin/reload", headers=admin, json={})
        assert r.status_code == 200, r.text
        second = load_final(uri).version_id
        assert r.json() == {"version_id": second, "previous_version_id": first, "changed": True}
        assert client.get("/v1/model").json()["round"] == 3
        # Another run directory in the bucket.
        r = client.post("/v1/admin/reload", headers=admin, json={"model_dir": uninterrupted})
        assert r.status_code == 200 and r.json()["version_id"] == load_final(uninterrupted).version_id
        r = client.post("/v1/admin/reload", headers=admin, json={"model_dir": f"s3://{BUCKET}/runs/none"})
        assert r.status_code == 409 and r.json()["field"] == "model_dir"
