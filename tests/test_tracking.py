"""Experiment tracking of ``fedrod-ray train`` (``--logger``): TensorBoard event files read back with
TensorBoard's own reader, MLflow runs read back through MlflowClient from the default local store and from
a real ``mlflow server`` on loopback, all compared with metrics.jsonl."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient
from servers import free_port, server_process
from test_cli import CONFIG, run_main

from fedrod_ray.outputs.metric_schema import BY_KEY
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.outputs.tracking import RUN_DIR_TAG, local_store_uri, scalars

FAST = ["--set", "runtime.torch_threads=1"]


def train(*args: str) -> str:
    rc, out, err = run_main(["train", *args, *FAST])
    assert rc == 0, err
    return out


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_mlflow_run(client: MlflowClient, run_dir: Path, uri: str) -> None:
    [run] = client.search_runs([client.get_experiment_by_name("synthetic_tiny").experiment_id],
                               f"tags.`{RUN_DIR_TAG}` = '{uri}'")
    recs = records(run_dir)
    for key in ("gfl_gm", "pfl_pm", "train_loss", "lr", "pfl_new_before"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == [(r["round"], r[key]) for r in recs if key in r], key
        assert run.data.tags[f"metric.{key}"] == BY_KEY[key].description
    assert run.data.params["train.head"] == "linear" and run.data.params["seed"] == "0"
    assert run.data.metrics["final/gfl_gm"] == recs[-1]["gfl_gm"]
    assert run.info.status == "FINISHED"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "final")}
    assert {"final/meta.json", "final/model.safetensors", "final/personal.safetensors"} <= artifacts
    meta = json.loads(Path(client.download_artifacts(run.info.run_id, "final/meta.json")).read_text())
    assert meta == json.loads((run_dir / "final" / "meta.json").read_text())


@pytest.mark.slow
def test_tensorboard_and_mlflow_local_store(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util.tensor_util import make_ndarray

    run_dir = tmp_path / "T"
    train("--config", CONFIG, "--run-dir", str(run_dir), "--logger", "tensorboard", "--logger", "mlflow",
          "--set", "train.rounds=2")
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    acc.Reload()
    recs = records(run_dir)
    tags = set(acc.Tags()["tensors"]) | set(acc.Tags()["scalars"])
    assert set(scalars(recs[-1])) <= tags
    for key in scalars(recs[-1]):
        events = acc.Tensors(key)
        assert [e.step for e in events] == [r["round"] for r in recs if key in r], key
        # TensorBoard keeps scalars as float32.
        assert [float(make_ndarray(e.tensor_proto)) for e in events] == pytest.approx(
            [r[key] for r in recs if key in r], rel=1e-6), key
        assert acc.SummaryMetadata(key).summary_description == BY_KEY[key].description
    assert "final/gfl_gm" in tags
    assert_mlflow_run(MlflowClient(local_store_uri(RunStorage(str(run_dir)))), run_dir, str(run_dir))

    # Resumed, both go on where the checkpoint was: the same MLflow run, TensorBoard without duplicates.
    train("--resume", str(run_dir), "--set", "train.rounds=3")
    assert_mlflow_run(MlflowClient(local_store_uri(RunStorage(str(run_dir)))), run_dir, str(run_dir))


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--backend-store-uri", f"sqlite:///{tmp}/mlflow.db", "--artifacts-destination", str(tmp / "artifacts")]
    with server_process(cmd, f"http://127.0.0.1:{port}/health", tmp / "mlflow.log", timeout=180):
        yield f"http://127.0.0.1:{port}"


@pytest.mark.slow
def test_mlflow_tracking_server(tmp_path, mlflow_server):
    run_dir = tmp_path / "M"
    train("--config", CONFIG, "--run-dir", str(run_dir), "--logger", "mlflow",
          "--set", f"tracking.mlflow_uri={mlflow_server}", "--set", "train.rounds=2")
    assert not (run_dir / "mlruns").exists()
    assert_mlflow_run(MlflowClient(mlflow_server), run_dir, str(run_dir))


def test_tracking_errors_name_the_field(tmp_path, monkeypatch):
    rc, _, err = run_main(["train", "--config", CONFIG, "--run-dir", str(tmp_path / "a"),
                           "--set", "tracking.mlflow_uri=http://127.0.0.1:1"])
    assert rc == 2 and "tracking.mlflow_uri: has no effect without mlflow" in err
    rc, _, err = run_main(["train", "--config", CONFIG, "--run-dir", str(tmp_path / "b"),
                           "--set", "tracking.loggers=[wandb]"])
    assert rc == 2 and "tracking.loggers: 'wandb' is not one of" in err
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if the extra were not installed
    rc, _, err = run_main(["train", "--config", CONFIG, "--run-dir", str(tmp_path / "c"), "--logger", "mlflow"])
    assert rc == 2 and "tracking.loggers: mlflow needs the optional extra 'tracking'" in err
    assert 'pip install -e ".[tracking]"' in err
