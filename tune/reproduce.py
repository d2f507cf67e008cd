"""Reproduce the paper's tables: every row of a table for every seed, as the trials of one Tune
experiment; and, from the trials' results or their files (``status``, without Ray), the records that
report.py writes the results from. The rows are in tables.py, the reproduction's spec in repro_spec.py.

The trials are the (row, seed) grid, run by the sweep machinery (``sweep.fit``): each one a whole
federation in its own placement group, checkpointed every round, so rows spread over a cluster like any
sweep's trials and ``--resume`` finishes a killed reproduction. No scheduler: every trial runs to the end,
so a trial is evaluated as its config says (``eval.eval_every``, and always at the last round), not every
round as a sweep's trials are for ASHA.

    <out>/reproduce.yaml    the reproduction as run: table, base, --set, seeds, each row's overrides
    <out>/trials/           Ray Tune's experiment
    <out>/results.csv       one line per (row, seed): its final metrics
    <out>/table.md          one line per row: mean ± std over the seeds, in %
    <out>/curves.png        per row, G-FL and P-FL (PM) against rounds, mean over the seeds
    <out>/rounds.csv        one line per (row, seed, round): every number the trial reported that round
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from fedrod_ray.outputs.lock import exclusive
from fedrod_ray.outputs.metric_schema import ACCURACIES, BY_KEY, values_line
from fedrod_ray.outputs.results import read_records
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.outputs.tracking import scalars

from .report import CURVES, Collected, write_results
from .repro_spec import SPEC_FILE, ReproSpec, check_splits, load_spec
from .sweep import TRIALS, TrialLines, fit, start_dir
from .trial import PARAMS_FILE

# A trial's console line: every accuracy but the new clients' GM (results.csv has it).
LINE_METRICS = tuple(k for k in ACCURACIES if k != "pfl_gm_new")


def reproduce(spec: ReproSpec, out_dir: Path, resume: bool = False) -> list[dict]:
    """Run (or resume) the reproduction and write its results; returns one record per (row, seed). A new one
    first makes every seed's split (``check_splits``), so that a bad seed fails before any trial starts; a
    resumed one runs the trials it started with."""
    out_dir = out_dir.resolve()
    if not resume and not check_splits(spec):
        print("the data is not on this machine: each trial checks its seed's split as it starts", flush=True)
    with exclusive(out_dir):
        if not resume:
            start_dir(out_dir, SPEC_FILE, spec.to_dict(), "a reproduction", "--out")
        grid = fit(spec, out_dir, TrialLines(spec, trial_line, counted=True), resume)
        collected = collect(spec, grid)
        write_results(spec, collected, out_dir)
    return collected.records


def trial_line(spec: ReproSpec, params: dict, last: dict, status: str) -> str:
    head = f"{params['row']}, seed {params['seed']}: {status}"
    if "gfl_gm" not in last:
        return head
    return f"{head}, round {last['round']}/{spec.rounds}: {values_line(last, LINE_METRICS)}"


def collect(spec: ReproSpec, grid) -> Collected:
    """One record per (row, seed), in table order, with the metrics of its last evaluated round (a finished
    trial's: the last round); each trial's CURVES at its evaluated rounds and its reports by round."""
    rounds = spec.rounds
    records, curves, reports = [], {}, []
    for result in grid:
        if result.config is None:  # a trial the run was stopped before it started: below, as "not started"
            continue
        row, seed = result.config["row"], result.config["seed"]
        # The trial's rounds as its run recorded them in its folder, not Tune's copies of its reports (a
        # trial started again by an experiment that was, ``sweep.fit``, reports only its rounds since).
        # Its numeric fields, as Tune's reports have them, with their values as recorded.
        reported = [{**{k: r[k] for k in scalars(r) if k in BY_KEY}, "round": r["round"]}
                    for r in read_records(RunStorage(result.path))]
        done = reported[-1]["round"] if reported else 0
        status = "error" if result.error else "finished" if done == rounds else "incomplete"
        evaluated = [r for r in reported if "gfl_gm" in r]
        last = evaluated[-1] if evaluated else {}
        failed = [r for r in reported if r.get("clients_failed")]
        records.append({"row": row, "seed": seed, "rounds": done, "eval_round": int(last.get("round", 0)),
                        "status": status, **{k: _value(last.get(k)) for k in ACCURACIES},
                        # the trial's wall time: its rounds', each counted once
                        "wall_s": sum(r.get("seconds", 0.0) for r in reported) if reported else math.nan,
                        "updates": int(sum(r.get("clients", 0) for r in reported)),
                        "failed_updates": int(sum(r["clients_failed"] for r in failed)),
                        "first_failed_round": failed[0]["round"] if failed else 0})
        if last:
            curves[row, seed] = {k: [float(r.get(k, math.nan)) for r in evaluated] for k in ("round", *CURVES)}
        reports += [{"row": row, "seed": seed, **r} for r in reported]
    seen = {(r["row"], r["seed"]) for r in records}
    records += [{"row": row, "seed": seed, "rounds": 0, "eval_round": 0, "status": "not started",
                 **dict.fromkeys((*ACCURACIES, "wall_s"), math.nan), "updates": 0, "failed_updates": 0,
                 "first_failed_round": 0}
                for row in spec.rows for seed in spec.seeds if (row, seed) not in seen]
    order = {label: i for i, label in enumerate(spec.rows)}
    records.sort(key=lambda r: (order[r["row"]], r["seed"]))
    reports.sort(key=lambda r: (order[r["row"]], r["seed"], r["round"]))
    return Collected(records, curves, reports)


def _value(v) -> float:
    """A recorded metric as a float; absent: NaN."""
    return math.nan if v is None else float(v)


class TrialOnDisk:
    """A trial as it is in the experiment's folder, read without Ray: its searched values (``trial.json``;
    ``params.json``, Tune's copy, in a folder of a version before it), and, after a failure, Tune's
    ``error.txt``. ``collect`` takes it where it takes Tune's Result (and reads the run's rounds from the
    folder, ``path``), so the table of a reproduction still running (or stopped) can be written."""

    def __init__(self, folder: Path, params: Path):
        self.path = str(folder)
        self.config = json.loads(params.read_text())
        self.error = (folder / "error.txt").read_text() if (folder / "error.txt").is_file() else None


def trials_on_disk(out_dir: Path) -> list[TrialOnDisk]:
    trials = []
    for folder in sorted(p for p in (out_dir / TRIALS).iterdir() if p.is_dir()):
        # A trial not begun yet, for us, has neither (or Tune's params.json, still empty).
        params = next((p for p in (folder / PARAMS_FILE, folder / "params.json") if p.is_file() and p.stat().st_size),
                      None)
        if params is not None:
            trials.append(TrialOnDisk(folder, params))
    return trials


def status(out_dir: Path) -> list[dict]:
    """Write the results of the reproduction in ``out_dir`` as far as it got (it may be running) from its
    files, without Ray, and return its records."""
    out_dir = out_dir.resolve()
    spec = load_spec(out_dir)
    collected = collect(spec, trials_on_disk(out_dir))
    write_results(spec, collected, out_dir)
    return collected.records
