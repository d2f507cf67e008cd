"""Run a sweep with Ray Tune and write its results into the sweep directory.

    <sweep_dir>/sweep.yaml      the sweep as run (what --resume reads)
    <sweep_dir>/trials/         Ray Tune's experiment: each trial's reports and checkpoints, and each trial's
                                run directory (config.yaml, metrics, checkpoints/, final/: docs/tune.md)
    <sweep_dir>/results.csv     one row per trial: searched values, rounds, status, final and best metrics
    <sweep_dir>/results.md      the same, as a Markdown table, best first
    <sweep_dir>/pareto.png      G-FL against P-FL (PM), one point per trial, the Pareto front marked
    <sweep_dir>/best.yaml       the best trial's experiment config, for ``fedrod-ray train --config``
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import pickletools
import re
from collections.abc import Callable
from pathlib import Path

import yaml
from ray.tune import Callback

from fedrod_ray.config import ConfigError, ExperimentConfig, dump_config
from fedrod_ray.outputs.lock import exclusive
from fedrod_ray.outputs.metric_schema import ACCURACIES, METRICS, percent, title, values_line
from fedrod_ray.outputs.plotting import figure, png
from fedrod_ray.outputs.results import read_records
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.outputs.tracking import require_extra

from .space import SweepSpec, load_sweep, param_space
from .spend import check_budget, spent
from .trial import objective, round_objective, run_trial

TRIALS = "trials"
SPEC_FILE = "sweep.yaml"
# A trial's final accuracies in the results (the objective is made of gfl_gm and pfl_pm).
FINAL = ("gfl_gm", "pfl_gm", "pfl_pm")
COLUMNS = ("rounds", "status", "objective", *FINAL, "best_objective", "best_round")


def run_sweep(spec: SweepSpec, sweep_dir: Path, resume: bool = False) -> list[dict]:
    """Run (or resume) the sweep; returns its rows, best first."""
    sweep_dir = sweep_dir.resolve()
    check_budget(spec)
    with exclusive(sweep_dir):
        if not resume:
            start_dir(sweep_dir, SPEC_FILE, spec.to_dict(), "a sweep", "--sweep-dir")
        grid = fit(spec, sweep_dir, TrialLines(spec, trial_line), resume)
        rows = result_rows(spec, grid)
        write_results(spec, rows, sweep_dir)
    return rows


def start_dir(out_dir: Path, spec_file: str, doc: dict, what: str, flag: str) -> None:
    """Create ``out_dir`` for a new experiment, with its definition in ``spec_file``; refuse one that
    already holds an experiment (that one is continued with --resume)."""
    if (out_dir / TRIALS).exists():
        raise ConfigError(f"{out_dir} already holds {what}; continue it with --resume {out_dir} "
                          f"or choose another {flag}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / spec_file).write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))


def fit(spec: SweepSpec, out_dir: Path, callback: Callback, resume: bool):
    """Run every trial of ``spec`` with Ray Tune, into ``out_dir/trials``; with ``resume``, restore that
    experiment and finish it (finished trials stay as they are, the others go on from their last
    reported round). Returns Tune's ResultGrid. Sweeps and reproductions both run through here.

    Tune's record of the experiment can be unreadable: Tune copies it (the experiment's state and its
    search's) into place without a rename, so a process killed mid-copy leaves a file empty (and Tune, told
    to restore it, would start an experiment of its own making, or fail). Then the experiment starts
    again: each trial lands in the folder it had (named by ``trial_folder``) and goes on from its run's own
    last checkpoint there (``trial.own_checkpoint``).
    """
    import ray
    from ray import tune

    from fedrod_ray.drivers.ray_runtime import connect

    # Tune saves the experiment's state (which checkpoint each trial is at) after every step, not every
    # few seconds: a sweep killed between two saves would otherwise redo the rounds in between.
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "0")
    # ... which is by design here, so Tune's warning about frequent snapshots would only be noise.
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    started = connect(_base(spec))
    try:
        trainable = tune.with_resources(tune.with_parameters(run_trial, sweep=spec),
                                        tune.PlacementGroupFactory(spec.bundles()))
        if resume and not tune_state_readable(out_dir / TRIALS):
            print(f"Ray Tune's record of the experiment in {out_dir / TRIALS} cannot be read (a process killed "
                  f"while writing it): its trials start again, each from its own last checkpoint", flush=True)
            resume = False
        if resume:
            tuner = tune.Tuner.restore(str(out_dir / TRIALS), trainable=trainable, resume_unfinished=True,
                                       resume_errored=True)
        else:
            scheduler, metric = None, {}
            if spec.scheduler == "asha":
                # Its rungs in rounds, not Tune's count of reports, which starts again for a trial that goes
                # on from its own checkpoint in an experiment started again.
                scheduler = tune.schedulers.ASHAScheduler(time_attr="round", max_t=_base(spec).train.rounds,
                                                          **spec.asha)
                # Only a scheduler reads it; Tune would then demand it in every report, and a trial that is
                # not evaluated every round (a reproduction's) has none in between.
                metric = {"metric": "objective", "mode": "max"}
            tuner = tune.Tuner(
                trainable, param_space=param_space(spec),
                tune_config=tune.TuneConfig(**metric, scheduler=scheduler, num_samples=spec.num_samples,
                                            reuse_actors=False, trial_dirname_creator=trial_folder),
                run_config=tune.RunConfig(name=TRIALS, storage_path=str(out_dir), verbose=0,
                                          callbacks=[callback, *tracking_callbacks(_base(spec), out_dir)],
                                          checkpoint_config=tune.CheckpointConfig(num_to_keep=1)),
            )
        return tuner.fit()
    finally:
        if started:
            ray.shutdown()


def tune_state_readable(trials: Path) -> bool:
    """Whether Tune's newest records of the experiment in ``trials`` (what ``Tuner.restore`` reads, the newest
    by name) are whole: its state (JSON) parses, and its search's state, a pickle copied into place the same
    way, runs to its end (walked by ``pickletools``, never loaded)."""
    states = sorted(trials.glob("experiment_state-*.json"))
    searches = sorted(trials.glob("basic-variant-state-*.json"))
    try:
        json.loads(states[-1].read_text())
        if searches:
            with open(searches[-1], "rb") as f:
                for _ in pickletools.genops(f):
                    pass
    except (IndexError, ValueError):
        return False
    return True


def trial_folder(trial) -> str:
    """A trial's folder name, made of what an experiment started again gives the same trial: its place in
    the experiment (the number after Tune's experiment id) and its searched values."""
    number = trial.trial_id.rsplit("_", 1)[-1]
    values = ",".join(f"{k}={re.sub(r'[^A-Za-z0-9.+-]+', '_', _fmt(v))}" for k, v in trial.config.items())
    return f"trial_{number}_{values}"[:120]


def tracking_callbacks(cfg: ExperimentConfig, out_dir: Path) -> list[Callback]:
    """Ray Tune's own logger callbacks for ``tracking.loggers``: each trial's reports (every numeric field
    of its rounds' records) and its parameters, TensorBoard's in the trial's folder, MLflow's as one run
    per trial in the experiment named like the sweep, the metrics' descriptions as its tags."""
    callbacks: list[Callback] = []
    if "tensorboard" in cfg.tracking.loggers:
        require_extra("tensorboardX", "tensorboard")
        from ray.tune.logger import TBXLoggerCallback

        callbacks.append(TBXLoggerCallback())
    if "mlflow" in cfg.tracking.loggers:
        mlflow = require_extra("mlflow", "mlflow")
        from ray.air.integrations.mlflow import MLflowLoggerCallback

        uri = cfg.tracking.mlflow_uri
        if uri is None:  # a local store in the sweep's folder, its artifacts beside it (not in the cwd)
            store = out_dir.resolve() / "mlruns"
            store.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{store / 'mlflow.db'}"
            client = mlflow.MlflowClient(uri)
            if client.get_experiment_by_name(cfg.name) is None:
                client.create_experiment(cfg.name, artifact_location=(store / "artifacts").as_uri())
        callbacks.append(MLflowLoggerCallback(tracking_uri=uri, experiment_name=cfg.name, save_artifact=True,
                                              tags={f"metric.{m.key}": m.description for m in METRICS}))
    return callbacks


def _base(spec: SweepSpec) -> ExperimentConfig:
    return spec.trial_config({})


def resume_spec(sweep_dir: Path) -> SweepSpec:
    if not (sweep_dir / SPEC_FILE).is_file() or not (sweep_dir / TRIALS).is_dir():
        raise ConfigError(f"--resume: {sweep_dir} holds no sweep ({SPEC_FILE} and {TRIALS}/ are missing)")
    return load_sweep(sweep_dir / SPEC_FILE)


class TrialLines(Callback):
    """A line on the console per finished trial, ``line(spec, params, last result, status)``; ``counted``
    puts ``[finished/all]`` before it. Tune saves its callbacks with the experiment's state, so this holds
    only the spec, a module-level function (pickled by name) and the flag."""

    def __init__(self, spec: SweepSpec, line: Callable[[SweepSpec, dict, dict, str], str], counted: bool = False):
        self.spec, self.line, self.counted = spec, line, counted

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._print(trials, trial, "finished")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._print(trials, trial, "error")

    def _print(self, trials, trial, status: str) -> None:
        text = self.line(self.spec, trial.config, trial.last_result, status)
        if self.counted:
            text = f"[{1 + sum(t.is_finished() for t in trials if t is not trial)}/{len(trials)}] {text}"
        print(text, flush=True)


def trial_line(spec: SweepSpec, params: dict, last: dict, status: str) -> str:
    rounds = _base(spec).train.rounds
    done = last.get("round", 0)
    if status == "finished" and done < rounds:
        status = f"stopped after round {done} of {rounds}"
    values = ", ".join(f"{k}={_fmt(v)}" for k, v in params.items())
    if "objective" not in last:
        return f"trial {values}: {status}"
    # With eval.estimate_size the objective is the estimate's, named so.
    est = " est" if "pfl_pm_est" in last else ""
    return (f"trial {values}: {status}; round {done}: "
            f"{values_line(last, ('gfl_gm', 'pfl_pm', 'gfl_gm_est', 'pfl_pm_est'))}  "
            f"{spec.metric}{est} {percent(last['objective'])}")


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def result_rows(spec: SweepSpec, grid) -> list[dict]:
    """One row per trial: its searched values, then COLUMNS; sorted best (final objective) first."""
    base = _base(spec)
    rows = []
    for result in grid:
        # The trial's rounds as its run recorded them in its folder (not Tune's copies of its reports: a
        # trial started again by an experiment that was (``fit``) reports only its rounds since).
        records = read_records(RunStorage(result.path))
        last = records[-1] if records else {}
        row = {k: result.config[k] for k in spec.search}
        done = int(last.get("round", 0))
        row.update(rounds=done, status="error" if result.error else
                   "finished" if done == base.train.rounds else "stopped")
        for key in FINAL:
            row[key] = last.get(key, math.nan)
        # The exact figures: with eval.estimate_size the reported objective is the estimate's, and a trial
        # stopped between exact evaluations has none (its estimates are in the history).
        row["objective"] = objective(last, spec.metric) if "gfl_gm" in last else math.nan
        estimate = bool(spec.trial_config(result.config).eval.estimate_size)
        reported = [(value, r["round"]) for r in records
                    if (value := round_objective(r, spec.metric, estimate)) is not None]
        best_objective, best_round = max(reported, key=lambda x: x[0]) if reported else (math.nan, 0)
        row.update(best_objective=best_objective, best_round=best_round)
        rows.append(row)
    return sorted(rows, key=lambda r: -r["objective"] if not math.isnan(r["objective"]) else math.inf)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (ties do not dominate)."""
    return [i for i, (x, y) in enumerate(points)
            if not any(a >= x and b >= y and (a, b) != (x, y) for a, b in points)]


def write_results(spec: SweepSpec, rows: list[dict], sweep_dir: Path) -> None:
    keys = [*spec.search, *COLUMNS]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=keys, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    (sweep_dir / "results.csv").write_text(out.getvalue())
    lines = [f"Sweep {spec.name}: {len(rows)} trials, maximising {spec.metric}; accuracies in %.", "",
             "| " + " | ".join(keys) + " |", "|" + "|".join("---:" for _ in keys) + "|"]
    total = spent(spec, [({k: row[k] for k in spec.search}, row["rounds"]) for row in rows])
    spending = "" if total is None else spending_line(spec, total)
    if spending:
        lines[2:2] = [spending, ""]
    for row in rows:
        lines.append("| " + " | ".join(_cell(k, row[k]) for k in keys) + " |")
    (sweep_dir / "results.md").write_text("\n".join(lines) + "\n")
    _plot_pareto(spec, rows, sweep_dir / "pareto.png")
    scored = [r for r in rows if not math.isnan(r["objective"])]
    if scored:
        best = spec.experiment_config({k: scored[0][k] for k in spec.search})
        best.name = f"{spec.name}_best"
        (sweep_dir / "best.yaml").write_text(
            f"# The best trial of sweep {spec.name} ({spec.metric} {100 * scored[0]['objective']:.2f}):\n"
            + (f"# {spending}\n" if spending else "") + dump_config(best))


def spending_line(spec: SweepSpec, total: float) -> str:
    """What a private sweep spent, said in its results, best.yaml and (with results.md) on the console."""
    delta = spec.experiment_config({}).privacy.delta
    budget = f", of a budget of {spec.privacy_budget:g}" if spec.privacy_budget is not None else ""
    return (f"Privacy: the trials spent epsilon {total:.4g} in all at delta {delta:g}{budget} (every trial's rounds "
            "composed on one accountant: they trained on the same clients). Each trial's own epsilon covers its "
            "model only; the selection metric, whose P-FL comes from un-noised local models, is not covered.")


def _cell(key: str, value) -> str:
    if key in ("objective", "best_objective") or key in ACCURACIES:
        return "-" if math.isnan(value) else percent(value)
    return _fmt(value)


def _plot_pareto(spec: SweepSpec, rows: list[dict], path: Path) -> None:
    scored = [r for r in rows if not math.isnan(r["objective"])]
    points = [(100 * r["pfl_pm"], 100 * r["gfl_gm"]) for r in scored]
    front = set(pareto_front(points))
    with figure(figsize=(6.4, 4.8)) as (fig, ax):
        ax.scatter([p[0] for i, p in enumerate(points) if i not in front],
                   [p[1] for i, p in enumerate(points) if i not in front], color="0.6", label="trial")
        order = sorted(front, key=lambda i: points[i][0])
        ax.plot([points[i][0] for i in order], [points[i][1] for i in order], "o-", color="C3",
                label="Pareto front")
        for i in order:
            label = ", ".join(f"{k.rsplit('.', 1)[-1]}={_fmt(scored[i][k])}" for k in spec.search)
            ax.annotate(label, points[i], textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel(f"{title('pfl_pm')}, %")
        ax.set_ylabel(f"{title('gfl_gm')}, %")
        ax.set_title(f"{spec.name}: final round of each trial")
        ax.legend(loc="best")
        path.write_bytes(png(fig, dpi=120))
