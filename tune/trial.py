"""One trial: a whole federation inside the trial's placement group, reporting after every round.

The trial function is the federation's coordinator (it runs in the placement group's first bundle);
the client actors it starts are captured into the group's other bundles, one pooled actor per client
slot. It trains a ``run.Run`` whose run directory is the trial's folder, so a trial writes what a run
writes (config.yaml, the metrics files, checkpoints/, and final/ at its last round). It checkpoints every
round, as any run does (only what changed since the save before), and reports each round's metrics to Tune
once that checkpoint is committed, with a Tune checkpoint naming it: a stopped sweep resumes a trial after
its last reported round, and a round's client states are written once, in the run's own files. A trial the
scheduler stops writes no final/.

The trial's folder is its own record, apart from Tune's: ``trial.json`` (its searched values) and the run's
files. Where Tune has no checkpoint for the trial (its experiment started again: ``sweep.fit``), the trial
goes on from the run's own last checkpoint in that folder.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
import yaml

from fedrod_ray.config import ConfigError, ExperimentConfig, dump_config
from fedrod_ray.executors.ray import RayExecutor, plan_layout
from fedrod_ray.executors.shared_setup import share
from fedrod_ray.federation_state.checkpoint import latest_checkpoint_name, load_checkpoint
from fedrod_ray.federation_state.setup import prepare
from fedrod_ray.federation_state.state import Snapshot
from fedrod_ray.lifecycle.run import Run
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.outputs.tracking import scalars
from fedrod_ray.round_loop.federation import Federation

from .space import NEW_CLIENT_METRICS, SweepSpec

# A trial's searched values, in its folder (Tune's params.json is a copy Tune may rewrite at any time).
PARAMS_FILE = "trial.json"
# What Tune's checkpoint of a report holds: the name of the run's checkpoint of that round, in the trial's folder.
RUN_CHECKPOINT_FILE = "run_checkpoint.json"


def objective(record: dict, metric: str, estimate: bool = False) -> float:
    """The value the sweep maximises: G-FL, P-FL (PM), or their harmonic mean; ``estimate``: of their
    estimates (gfl_gm_est, pfl_pm_est); or the held-out clients' P-FL (never estimated)."""
    if metric in NEW_CLIENT_METRICS:
        return record[metric]
    suffix = "_est" if estimate else ""
    gfl, pfl = record["gfl_gm" + suffix], record["pfl_pm" + suffix]
    if metric == "gfl":
        return gfl
    if metric == "pfl_pm":
        return pfl
    return 2 * gfl * pfl / (gfl + pfl) if gfl + pfl > 0 else 0.0


def round_objective(record: dict, metric: str, estimate: bool) -> float | None:
    """What a round reports as its objective: the estimate's where the trial estimates (every round), else
    the exact evaluation's; None for a round without one."""
    if metric in NEW_CLIENT_METRICS:
        return record.get(metric)
    if estimate or "gfl_gm" in record:
        return objective(record, metric, estimate)
    return None


def run_trial(params: dict, sweep: SweepSpec) -> None:
    """Tune's trainable: the trial of ``sweep`` with ``params`` (its searched values, dotted key -> value),
    a ``Run`` in the trial's folder that reports every round to Tune, resumed from Tune's checkpoint."""
    from ray import tune

    cfg = sweep.trial_config(params)
    storage = trial_run_dir()
    cfg.run_dir = storage.uri  # as a run's config.yaml records where it was
    storage.write_bytes(PARAMS_FILE, json.dumps(params).encode())
    torch.set_num_threads(1)
    # The trial maps the data from the object store, as its client actors do: one copy on the node.
    shared = share(prepare(cfg))
    setup = shared.setup()
    # The trial's own resources, not the cluster's: its client slots.
    slots = {{"num_cpus": "CPU", "num_gpus": "GPU"}.get(k, k): v * sweep.client_slots
             for k, v in sweep.client_resources.items()}
    executor = RayExecutor(setup, plan_layout(cfg.runtime, len(setup.all_client_ids), slots), shared=shared)
    try:
        run = Run(Federation(setup, executor, log=print), storage, resume_point(tune.get_checkpoint(), storage, cfg),
                  track=False)
        estimate = bool(cfg.eval.estimate_size)

        def report(record: dict) -> None:
            # Every numeric field of the record (what a tracking callback logs), the round included.
            metrics = {"round": record["round"], **scalars(record)}
            # What ASHA decides on, every round: the estimate where there is one (never mixed with exact
            # figures), else the exact evaluation (a sweep's trial without an estimate: every round).
            value = round_objective(record, sweep.metric, estimate)
            if value is not None:
                metrics["objective"] = value
            # The report waits for the round's checkpoint to commit: its Tune checkpoint names it, as the
            # point a resumed trial goes on from.
            with tempfile.TemporaryDirectory() as folder:
                Path(folder, RUN_CHECKPOINT_FILE).write_text(json.dumps({"checkpoint": run.committed()}))
                tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))

        run.train(report, last_after_final=True)
    finally:
        executor.close()


def resume_point(checkpoint, storage: RunStorage, cfg: ExperimentConfig) -> Snapshot | None:
    """What a trial goes on from: the run checkpoint that Tune's ``checkpoint`` of its last report names, in
    the trial's folder; where Tune has none (its experiment started again) or it names none (a sweep started
    by a fedrod-ray whose Tune checkpoints held the snapshot itself), the run's own last one there."""
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            pointer = Path(folder, RUN_CHECKPOINT_FILE)
            name = json.loads(pointer.read_text())["checkpoint"] if pointer.is_file() else None
        if name is not None:
            return load_checkpoint(storage, name)
    return own_checkpoint(storage, cfg)


def own_checkpoint(storage: RunStorage, cfg: ExperimentConfig) -> Snapshot | None:
    """The last checkpoint of the run in the trial's folder (None where it has none): what a trial goes on
    from when Tune has no checkpoint of it. Only the same trial's: a folder holding a run of another config
    is an error, never overwritten."""
    if latest_checkpoint_name(storage) is None:
        return None
    if _settings(storage.read_bytes("config.yaml").decode()) != _settings(dump_config(cfg)):
        raise ConfigError(f"{storage.uri} holds a run of another config than its trial's; move it away to start "
                          f"the trial again")
    return load_checkpoint(storage)


def _settings(config_yaml: str) -> dict:
    """A run's config but for where it was (``run_dir``: a folder may have moved since) and how often it
    saved (``runtime.checkpoint_every``: a trial of a sweep started by an earlier fedrod-ray saved less often)."""
    settings = {k: v for k, v in yaml.safe_load(config_yaml).items() if k != "run_dir"}
    settings["runtime"] = {k: v for k, v in settings.get("runtime", {}).items() if k != "checkpoint_every"}
    return settings


def trial_run_dir() -> RunStorage:
    """The trial's run directory: its folder in the sweep's storage (``<sweep_dir>/trials/<trial>``), beside
    Tune's reports and checkpoints. Not ``get_trial_dir()``, a staging folder under ``/tmp/ray/session_*``
    on the sweep driver's node, which a resumed sweep (another Ray session) does not find again."""
    from ray import tune

    return RunStorage(tune.get_context().get_storage().trial_fs_path)
