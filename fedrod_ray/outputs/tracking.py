"""Experiment trackers for ``fedrod-ray train`` (``tracking.loggers``): TensorBoard and MLflow, through the
libraries' own writers. Each gets every numeric field of a round's record (``metric_schema``, with its
description where the backend keeps one), the resolved config as hyperparameters, the final metrics under
``final/<key>``, and MLflow ``final/`` as an artifact. Sweeps and reproductions use Ray Tune's own logger
callbacks instead (``tune/sweep.py``).

Both libraries are an optional extra (``pip install -e ".[tracking]"``), imported only when asked for.
A resumed run logs on: TensorBoard drops the events after the checkpoint (``purge_step``), MLflow finds
the run it logged to before by the run directory's tag.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from ..config import ConfigError, ExperimentConfig
from .metric_schema import BY_KEY, EVALUATED, METRICS
from .storage import RunStorage

EXTRA = 'pip install -e ".[tracking]"'
RUN_DIR_TAG = "fedrod.run_dir"


def require_extra(module: str, logger: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"tracking.loggers: {logger} needs the optional extra 'tracking' ({EXTRA}); "
                          f"{e}") from None


def _local_dir(storage: RunStorage, field: str, what: str) -> Path:
    if storage.object_store:
        raise ConfigError(f"{field}: {what} writes files beside the run, which needs a local run directory, "
                          f"not {storage.uri}" + ("; set tracking.mlflow_uri" if "mlflow" in field else ""))
    return Path(storage.root)


def scalars(record: dict) -> dict[str, float]:
    """A record's numeric fields (the round is the step)."""
    return {k: float(v) for k, v in record.items()
            if k != "round" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def hyperparameters(cfg: ExperimentConfig) -> dict[str, Any]:
    """The config flattened to dotted keys; lists and mappings as JSON text."""
    flat: dict[str, Any] = {}
    for k, v in cfg.to_dict().items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                flat[f"{k}.{kk}"] = json.dumps(vv) if isinstance(vv, (list, dict)) else vv
        else:
            flat[k] = v
    return flat


class TensorBoardTracker:
    """Event files in ``<run_dir>/tensorboard`` (``torch.utils.tensorboard``): a scalar per metric, its
    description in the summary's metadata, the config as text and as hyperparameters with the final metrics."""

    def __init__(self, cfg: ExperimentConfig, storage: RunStorage, rounds_done: int):
        require_extra("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.dir = _local_dir(storage, "tracking.loggers", "tensorboard") / "tensorboard"
        self.cfg = cfg
        # A resumed run: the events of rounds after the checkpoint are dropped, as metrics.jsonl drops them.
        self.writer = SummaryWriter(str(self.dir), purge_step=rounds_done + 1 if rounds_done else None)
        self.described: set[str] = set()
        if not rounds_done:
            from ..config import dump_config

            self.writer.add_text("config", "```yaml\n" + dump_config(cfg) + "\n```", 0)

    def log_round(self, record: dict) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary, SummaryMetadata
        from torch.utils.tensorboard.summary import scalar

        for key, value in scalars(record).items():
            summary = scalar(key, value, new_style=True)
            if key not in self.described and key in BY_KEY:
                # The description travels with the tag's first value: TensorBoard shows it beside the chart.
                metadata = SummaryMetadata()
                metadata.CopyFrom(summary.value[0].metadata)
                metadata.summary_description = BY_KEY[key].description
                metadata.display_name = BY_KEY[key].title or key
                summary = Summary(value=[Summary.Value(tag=key, tensor=summary.value[0].tensor, metadata=metadata)])
                self.described.add(key)
            self.writer.file_writer.add_summary(summary, record["round"], time.time())
        self.writer.flush()

    def finish(self, final: dict, storage: RunStorage) -> None:
        from torch.utils.tensorboard.summary import hparams

        params = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                  for k, v in hyperparameters(self.cfg).items()}
        metrics = {f"final/{k}": v for k, v in scalars(final).items()}
        for summary in hparams(params, metrics):
            self.writer.file_writer.add_summary(summary)
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, final.get("round", 0))
        self.writer.close()


class MLflowTracker:
    """One MLflow run per run directory, in the experiment named like the config; found again on resume."""

    def __init__(self, cfg: ExperimentConfig, storage: RunStorage, rounds_done: int):
        mlflow = require_extra("mlflow", "mlflow")
        uri, artifacts = cfg.tracking.mlflow_uri, None
        if uri is None:
            # MLflow 3 refuses its plain-file store: the local store is SQLite, with the artifacts beside it.
            store = _local_dir(storage, "tracking.mlflow_uri", "the default local MLflow store") / "mlruns"
            store.mkdir(parents=True, exist_ok=True)
            uri, artifacts = local_store_uri(storage), (store / "artifacts").as_uri()
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(cfg.name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(cfg.name, artifact_location=artifacts))
        found = self.client.search_runs([experiment_id], f"tags.`{RUN_DIR_TAG}` = '{storage.uri}'",
                                        max_results=1) if rounds_done else []
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            return
        tags = {RUN_DIR_TAG: storage.uri, "mlflow.note.content": _schema_note()}
        tags.update({f"metric.{m.key}": m.description for m in METRICS})
        self.run_id = self.client.create_run(experiment_id, run_name=Path(storage.root).name, tags=tags).info.run_id
        from mlflow.entities import Param

        params = [Param(k, str(v)) for k, v in hyperparameters(cfg).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log_round(self, record: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, record["round"])
                                                    for k, v in scalars(record).items()])

    def finish(self, final: dict, storage: RunStorage) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(f"final/{k}", v, now, final.get("round", 0))
                                                    for k, v in scalars(final).items()])
        with tempfile.TemporaryDirectory() as tmp:
            for name in storage.list_files("final"):
                (Path(tmp) / name).write_bytes(storage.read_bytes(f"final/{name}"))
            self.client.log_artifacts(self.run_id, tmp, "final")
        self.client.set_terminated(self.run_id)


def local_store_uri(storage: RunStorage) -> str:
    """The tracking URI of a run's default MLflow store, ``<run_dir>/mlruns/mlflow.db``."""
    return f"sqlite:///{Path(storage.root) / 'mlruns' / 'mlflow.db'}"


def _schema_note() -> str:
    return "Metrics (fedrod_ray.outputs.metric_schema):\n\n" + "\n".join(f"- `{m.key}`: {m.description}" for m in METRICS)


TRACKERS = {"tensorboard": TensorBoardTracker, "mlflow": MLflowTracker}


def open_trackers(cfg: ExperimentConfig, storage: RunStorage, rounds_done: int) -> list:
    return [TRACKERS[name](cfg, storage, rounds_done) for name in cfg.tracking.loggers]


def final_metrics(last_evaluation: dict) -> dict:
    """What a tracker records as the run's final metrics: the last evaluation's accuracies, and its round."""
    return {k: v for k, v in last_evaluation.items() if k in EVALUATED or k == "round"}
