"""What a reproduction's published folder proves about its runs (``provenance.yaml`` and ``runs/``).

A table's ``reproduce.yaml`` says what each row should run; only the runs' own ``config.yaml`` says what did.
``record`` copies each trial's config.yaml, byte for byte, to ``runs/<row>_s<seed>.yaml`` and writes
``provenance.yaml``: the commit, the command, and per (row, seed) the round reached and that file; for a row
that took a sweep's choice, the sweep, its trial table and the values chosen. ``problems`` checks a folder:
every (row, seed) of results.csv has its run's config, agreeing with the round results.csv reports and with
the row ``reproduce.yaml`` rebuilds, on every key that decides what is learned."""

from __future__ import annotations

import csv
import re
import shutil
from pathlib import Path
from typing import Any

import yaml

from fedrod_ray.config import ConfigError, config_from_record
from fedrod_ray.outputs.results import read_records
from fedrod_ray.outputs.storage import RunStorage

from .repro_spec import SPEC_FILE, spec_from_doc

PROVENANCE_FILE = "provenance.yaml"
RUNS = "runs"
# Where and how a run ran, not what it learned (config.records.RESUMABLE but rounds and evaluation, which the
# table reports): these may differ between the row's spec and the run's own config.yaml.
WHERE = ("name", "run_dir", "data.data_dir", "data.path", "data.download", "runtime.", "tracking.")


def run_file(row: str, seed: int) -> str:
    """``runs/``'s file name of a (row, seed): ``Fed-RoD (hyper)``, 0 -> ``fed_rod_hyper_s0.yaml``."""
    return f"{re.sub(r'[^a-z0-9]+', '_', row.lower()).strip('_')}_s{seed}.yaml"


def record(folder: Path, trials: list[tuple[dict, Path]], commit: str, command: str,
           sweeps: dict[str, dict[str, Any]] | None = None) -> dict:
    """Copy each trial's own config.yaml into ``folder/runs/`` and write ``folder/provenance.yaml``.

    ``trials``: (the trial's {"row", "seed"}, its run directory); ``sweeps``: row -> {"sweep": name, "trials":
    its trial table's file in ``folder``, "chosen": {dotted key: value}} for the rows that took a sweep's
    choice. A trial without a config.yaml (never started) is left out: the table says it did not run."""
    runs_dir = folder / RUNS
    if runs_dir.exists():
        shutil.rmtree(runs_dir)
    runs_dir.mkdir(parents=True)
    runs = []
    for params, run_dir in sorted(trials, key=lambda t: (t[0]["row"], t[0]["seed"])):
        if not (run_dir / "config.yaml").is_file():
            continue
        name = run_file(params["row"], params["seed"])
        shutil.copyfile(run_dir / "config.yaml", runs_dir / name)
        rounds = [r["round"] for r in read_records(RunStorage(str(run_dir)))]
        runs.append({"row": params["row"], "seed": params["seed"], "round": max(rounds, default=0),
                     "config": f"{RUNS}/{name}"})
    doc = {"commit": commit, "command": command, "runs": runs, "sweeps": dict(sweeps or {})}
    (folder / PROVENANCE_FILE).write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    return doc


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def differences(expected: dict, ran: dict) -> list[str]:
    """The keys that decide what is learned (not ``WHERE``) on which two configs (as mappings) differ."""
    a, b = _flatten(expected), _flatten(ran)
    return [f"{k}: reproduce.yaml {a.get(k)!r}, the run {b.get(k)!r}" for k in sorted(a.keys() | b.keys())
            if not k.startswith(WHERE) and a.get(k) != b.get(k)]


def problems(folder: Path) -> list[str]:
    """Why ``folder`` (a published reproduction with results.csv) does not prove its rows' configs; [] if it
    does."""
    if not (folder / PROVENANCE_FILE).is_file():
        return [f"no {PROVENANCE_FILE}: its rows' configs were never recorded"]
    doc = yaml.safe_load((folder / PROVENANCE_FILE).read_text())
    spec = spec_from_doc(yaml.safe_load((folder / SPEC_FILE).read_text()))
    runs = {(r["row"], int(r["seed"])): r for r in doc["runs"]}
    found = []
    with open(folder / "results.csv", newline="") as f:
        for line in csv.DictReader(f):
            key = (line["row"], int(line["seed"]))
            if line["status"] == "not started":
                continue
            if key not in runs:
                found.append(f"{key[0]}, seed {key[1]}: has metrics but no run config in {PROVENANCE_FILE}")
                continue
            found += [f"{key[0]}, seed {key[1]}: {p}" for p in _run_problems(folder, spec, runs[key], line, doc)]
    return found


def _run_problems(folder: Path, spec, run: dict, line: dict, doc: dict) -> list[str]:
    path = folder / run["config"]
    if not path.is_file():
        return [f"{run['config']} is missing"]
    ran = yaml.safe_load(path.read_text())
    try:
        config_from_record(ran)
    except ConfigError as e:
        return [f"{run['config']} is not a config: {e}"]
    found = []
    if int(run["round"]) != int(line["rounds"]):
        found.append(f"results.csv says round {line['rounds']}, {PROVENANCE_FILE} round {run['round']}")
    found += differences(spec.row_config(run["row"], int(run["seed"])).to_dict(), ran)
    chosen = doc["sweeps"].get(run["row"], {}).get("chosen", {})
    flat = _flatten(ran)
    found += [f"{k}: the sweep chose {v!r}, the run has {flat.get(k)!r}" for k, v in chosen.items() if flat.get(k) != v]
    return found
