"""Reproduce the paper's tables: every row of a table for every seed, as the trials of one Tune experiment.

A table is data: row label -> the config overrides (dotted keys) that make its method. The trials are
the (row, seed) grid, run by the sweep machinery (``sweep.fit``): each one a whole federation in its own
placement group, checkpointed every round, so rows spread over a cluster like any sweep's trials and
``--resume`` finishes a killed reproduction. No scheduler: every trial runs to the end, so a trial is
evaluated as its config says (``eval.eval_every``, and always at the last round), not every round as a
sweep's trials are for ASHA.

    <out>/reproduce.yaml    the reproduction as run: table, base, --set, seeds, each row's overrides
    <out>/trials/           Ray Tune's experiment
    <out>/results.csv       one line per (row, seed): its final metrics
    <out>/table.md          one line per row: mean ± std over the seeds, in %
    <out>/curves.png        per row, G-FL and P-FL (PM) against rounds, mean over the seeds
    <out>/rounds.csv        one line per (row, seed, round): every number the trial reported that round
"""

from __future__ import annotations

import copy
import csv
import io
import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedrod_ray.config import (
    ConfigError,
    ExperimentConfig,
    apply_override,
    check_keys_and_types,
    config_from_record,
    load_config,
)
from fedrod_ray.metric_schema import ACCURACIES, BY_KEY, title, values_line
from fedrod_ray.personalization import METHODS
from fedrod_ray.plotting import figure, png, round_axis
from fedrod_ray.specs.methods import HEADS

from .space import SweepSpec, check_models
from .sweep import TRIALS, TrialLines, fit, start_dir

SPEC_FILE = "reproduce.yaml"
FINETUNE_EPOCHS = 5  # FT: "a few epochs" of ERM on the client's own data, from the global model (--finetune-epochs)
IMBALANCE_RATIOS = (10, 100)
# What every trial sets for itself (SweepSpec.trial_config): a --set of these would change nothing.
TRIAL_OWNED = ("seed", "runtime.mode", "runtime.address", "runtime.clients_per_actor", "runtime.client_resources")


def _method(head: str, loss: str, rule: str = "fedavg", **head_params) -> dict[str, Any]:
    # Every row names all three axes and sets the rule's and the method's parameters (the defaults, unless
    # given), so a row is the same method whatever the base config says.
    return {"train.head": head, "train.balanced_loss": loss, "train.generic_rule": rule, "train.rule_params": {},
            "train.head_params": head_params}


# pFedMe's and Per-FedAvg's updates are their own formulas of plain gradient steps.
PLAIN_STEPS = {"train.momentum": 0, "train.weight_decay": 0}
# The personalized-FL baselines (FEDROD.md's second block of Table 1, the paper's order), with the values of
# the parameters the paper selected from a list, selected the same way (tune/pfl_*.yaml sweeps, docs/results).
PFL = {
    "MTL": _method("mtl", "ce", lam=0.1),
    "LG-FedAvg": _method("lg_fedavg", "ce"),
    "FedPer": _method("fedper", "ce"),
    "Per-FedAvg": {**_method("perfedavg", "ce"), **PLAIN_STEPS},
    "pFedMe": {**_method("pfedme", "ce"), **PLAIN_STEPS},
    "Ditto": _method("ditto", "ce", lam=1.0),
    "FedFOMO": _method("fedfomo", "ce"),
    "FedRep": _method("fedrep", "ce"),
}


FEDAVG = _method("none", "ce")
FEDAVG_BRM = _method("none", "bsm")
LINEAR = _method("linear", "bsm")
HYPER = _method("hyper", "bsm")
FINETUNE = {"eval.finetune_epochs": FINETUNE_EPOCHS}

MAIN = {
    "FedAvg": FEDAVG,
    "FedProx": _method("none", "ce", "fedprox"),
    "SCAFFOLD": _method("none", "ce", "scaffold"),
    "FedDyn": _method("none", "ce", "feddyn"),
    "local-only": _method("none", "ce", "local"),
    "Fed-RoD (linear)": LINEAR,
    "Fed-RoD (hyper)": HYPER,
    "Fed-RoD (hyper) + FedDyn": _method("hyper", "bsm", "feddyn"),
    "Fed-RoD (Meta-BSM)": _method("linear", "meta_bsm"),
    **PFL,
}
# Client-level DP's privacy-utility table (docs/privacy.md; base configs/fmnist_dp.yaml): each method without DP
# (epsilon = inf) and at target epsilons at delta = 1e-5, sigma derived from each over the run's rounds, Poisson
# sampling at rate train.client_fraction and a fixed clip norm.
DP_EPSILONS = (8, 4, 1)
# The noise on the mean is sigma S / E per coordinate and round; at epsilon 1 (sigma 4.28) S = 2, about the first
# rounds' median update norm, makes it 0.086, as large as the weights, and Fed-RoD (hyper) stays near 25% G-FL over
# its first 6 rounds; S = 0.5 (0.021) reaches 52% (docs/privacy.md).
DP_CLIP_NORM = 0.5


def _private(epsilon: float) -> dict[str, Any]:
    return {"privacy.enabled": True, "privacy.target_epsilon": epsilon, "privacy.delta": 1e-5,
            "privacy.clip_norm": DP_CLIP_NORM, "privacy.sampling": "poisson"}


TABLES: dict[str, dict[str, dict[str, Any]]] = {
    "main": MAIN,
    "ablation": {
        "FedAvg": FEDAVG,
        "FedAvg (BRM)": FEDAVG_BRM,
        "FedAvg (BRM, FT)": {**FEDAVG_BRM, **FINETUNE, "eval.finetune_train": True},
        "Fed-RoD (linear)": LINEAR,
        "Fed-RoD (hyper)": HYPER,
    },
    # The generic head's loss inside Fed-RoD (linear).
    "losses": {name: {**LINEAR, "train.balanced_loss": loss}
               for name, loss in (("CE", "ce"), ("IR", "reweight"), ("LDAM", "ldam"), ("CDT", "cdt"), ("BSM", "bsm"))},
    # Held-out clients (data.new_clients, from the base or --set) before and after fine-tuning.
    "new-clients": {
        "FedAvg": {**FEDAVG, **FINETUNE},
        "FedDyn": {**_method("none", "ce", "feddyn"), **FINETUNE},
        "Fed-RoD (linear)": {**LINEAR, **FINETUNE},
        "Fed-RoD (hyper)": {**HYPER, **FINETUNE},
    },
    "privacy": {f"{label}, ε = {eps}": overrides if eps == "∞" else {**overrides, **_private(eps)}
                for label, overrides in (("FedAvg", FEDAVG), ("Fed-RoD (hyper)", HYPER)) for eps in ("∞", *DP_EPSILONS)},
    # The main rows with long-tailed global training data.
    "imbalanced": {f"{label}, IM {ratio}": {**overrides, "data.imbalance_ratio": ratio}
                   for ratio in IMBALANCE_RATIOS for label, overrides in MAIN.items() if label not in PFL},
}

# The table's columns (fractions in the records, % in the table).
COLUMNS = ("gfl_gm", "pfl_gm", "pfl_pm", "pfl_pm_global")
NEW_COLUMNS = ("gfl_gm", "pfl_new_before", "pfl_new_after")
# A trial's console line: every accuracy but the new clients' GM (results.csv has it).
LINE_METRICS = tuple(k for k in ACCURACIES if k != "pfl_gm_new")
CURVES = ("gfl_gm", "pfl_pm")
# eval_round: the round the metrics were measured at (the last evaluated one; rounds for a finished trial).
# updates / failed_updates: sampled clients' local updates over the reported rounds, and those that failed
# (left out of their round's average), the first of them in first_failed_round (0: none).
CSV_COLUMNS = ("row", "seed", "rounds", "eval_round", "status", *ACCURACIES, "wall_s", "updates", "failed_updates",
               "first_failed_round")


@dataclass
class Collected:
    """What a reproduction's files are written from: one record per (row, seed) (results.csv, table.md),
    each trial's CURVES at its evaluated rounds (curves.png) and its reports round by round (rounds.csv)."""
    records: list[dict]
    curves: dict[tuple[str, int], dict[str, list[float]]]
    rounds: list[dict]


@dataclass
class ReproSpec(SweepSpec):
    """A reproduction as a sweep whose trials are the (row, seed) grid: ``row`` selects the row's
    overrides, ``seed`` is the config's seed. ``fixed`` holds --set (and --rounds), applied to every row.
    The base config travels as its content (``base_config``), so a trial on any node, and a resumed
    reproduction, run what was read when it started."""

    base_config: dict[str, Any] = field(default_factory=dict)
    table: str = ""
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)
    seeds: list[int] = field(default_factory=list)
    scheduler: str = "none"
    # Read back from reproduce.yaml (load_spec): what the trials were started with, as any version wrote it.
    recorded: bool = False

    def base_data(self) -> dict:
        return copy.deepcopy(self.base_config)

    def trial_config(self, params: dict[str, Any]) -> ExperimentConfig:
        if self.recorded:
            return config_from_record(self._data(params, trial=True))
        return super().trial_config(params)

    def _data(self, params: dict[str, Any], trial: bool) -> dict:
        # Without a row (the sweep machinery's base config: where to connect), the first row's first seed.
        row = params.get("row", next(iter(self.rows)))
        data = super()._data({**self.rows[row], "seed": params.get("seed", self.seeds[0])}, False)
        if trial:
            self.place_trial(data)
        return data

    def row_config(self, row: str, seed: int) -> ExperimentConfig:
        return self.trial_config({"row": row, "seed": seed})

    @property
    def rounds(self) -> int:
        return self.trial_config({}).train.rounds

    def to_dict(self) -> dict:
        return {"name": self.name, "table": self.table, "base": self.base, "set": dict(self.fixed),
                "seeds": list(self.seeds), "rows": {k: dict(v) for k, v in self.rows.items()},
                "resources": {"client_slots": self.client_slots, "client": dict(self.client_resources)},
                "base_config": self.base_data()}


def parse_seeds(text: str) -> list[int]:
    """``3`` -> seeds 0, 1, 2; ``0,5,7`` (a comma: a list) -> those seeds; ``7,`` -> seed 7 alone."""
    try:
        if "," in text:
            seeds = [int(s) for s in text.split(",") if s.strip()]
        else:
            seeds = list(range(int(text)))
    except ValueError:
        raise ConfigError(f"--seeds: expected a count (3: seeds 0, 1, 2) or a list (0,5,7), got {text!r}") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds: need at least one seed, all >= 0 and distinct, got {text!r}")
    return seeds


def parse_sets(assignments: list[str]) -> dict[str, Any]:
    """``key=value`` (value as YAML) -> {dotted key: value}."""
    out = {}
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set expects key=value, got {assignment!r}")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {key}: cannot parse value {raw!r}: {e}") from None
    return out


def _overlap(a: str, b: str) -> bool:
    """The two dotted keys name the same setting or one holds the other (train.rule_params, .mu)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def build_spec(table: str, base: str | Path, seeds: list[int], rounds: int | None = None,
               overrides: dict[str, Any] | None = None, resources: dict | None = None,
               rows: list[str] | None = None, finetune_epochs: int | None = None) -> ReproSpec:
    """The reproduction of ``table`` (or of its ``rows`` alone) on the ``base`` config, checked in full:
    every row's config is built and validated before any trial starts. The rows that fine-tune do it for
    ``finetune_epochs`` (default FINETUNE_EPOCHS)."""
    if table not in TABLES:
        raise ConfigError(f"--table: {table!r} is not one of {list(TABLES)}")
    unknown = [r for r in rows or [] if r not in TABLES[table]]
    if unknown:
        raise ConfigError(f"--row: {unknown[0]!r} is not a row of table {table}: {list(TABLES[table])}")
    fixed = dict(overrides or {})
    if rounds is not None:
        if "train.rounds" in fixed:
            raise ConfigError("--set train.rounds: given twice, with --rounds; drop one")
        fixed["train.rounds"] = rounds
    base = Path(base)
    if not base.is_file():
        raise ConfigError(f"--config: {base} does not exist")
    spec = ReproSpec(base=str(base.resolve()), search={}, fixed=fixed, base_config=load_config(base).to_dict(),
                     table=table, rows=_finetuning(table, [r for r in TABLES[table] if not rows or r in rows],
                                                   finetune_epochs),
                     seeds=list(seeds), name=f"{table}_{base.stem}", **_resources(resources or {}))
    check(spec)
    return spec


def _finetuning(table: str, rows: list[str], epochs: int | None) -> dict[str, dict[str, Any]]:
    """The ``rows`` of ``table``, those that fine-tune doing it for ``epochs`` (None: as the table says)."""
    chosen = {r: dict(TABLES[table][r]) for r in rows}
    if epochs is None:
        return chosen
    if not (isinstance(epochs, int) and epochs >= 1):
        raise ConfigError(f"--finetune-epochs: must be an integer >= 1, got {epochs!r}")
    tuned = [row for row in chosen.values() if "eval.finetune_epochs" in row]
    if not tuned:
        raise ConfigError(f"--finetune-epochs: has no effect: no row of table {table} run here fine-tunes")
    for row in tuned:
        row["eval.finetune_epochs"] = epochs
    return chosen


def _resources(resources: dict) -> dict[str, Any]:
    """A sweep file's ``resources`` section (client_slots, client) as ReproSpec's fields."""
    unknown = sorted(set(resources) - {"client_slots", "client"})
    if unknown:
        raise ConfigError(f"--resources: {unknown[0]} is not one of client_slots, client")
    client = resources.get("client") or {"num_cpus": 1}
    if not isinstance(client, dict):
        raise ConfigError(f"--resources: client must be a mapping such as {{num_cpus: 1}}, got {client!r}")
    client = {k: float(v) for k, v in client.items()}
    if 0 < client.get("num_cpus", 1) < 1 and not client.get("num_gpus"):
        # plan_layout counts CPU trainings in whole cores: the trial would find no room for its client.
        raise ConfigError(f"--resources: client.num_cpus: a CPU training takes a whole core; got "
                          f"{client['num_cpus']} without num_gpus")
    return {"client_slots": resources.get("client_slots", 1), "client_resources": client}


def check(spec: ReproSpec) -> None:
    spec.search = {"row": {"grid": list(spec.rows)}, "seed": {"grid": list(spec.seeds)}}
    if not (isinstance(spec.client_slots, int) and spec.client_slots >= 1):
        raise ConfigError(f"--resources: client_slots must be an integer >= 1, got {spec.client_slots!r}")
    for key in spec.fixed:
        owned = next((k for k in TRIAL_OWNED if _overlap(key, k)), None)
        if owned == "seed":
            raise ConfigError("--set seed: the seeds come from --seeds")
        if owned:
            raise ConfigError(f"--set {key}: has no effect: every trial sets {owned} itself (it runs on its "
                              "placement group's actors; see --resources)")
        for label, row in spec.rows.items():
            clash = next((k for k in row if _overlap(key, k)), None)
            if clash:
                raise ConfigError(f"--set {key}: conflicts with row {label!r} of table {spec.table}, which sets "
                                  f"{clash}={row[clash]!r}; a --set may change only what no row sets")
    # Keys and types of the base with --set, before any row: an unknown key is the --set's, not a row's.
    data = spec.base_data()
    for key, value in spec.fixed.items():
        apply_override(data, f"{key}={json.dumps(value)}")  # JSON is YAML
    try:
        check_keys_and_types(data)
    except ConfigError as e:
        raise ConfigError(f"--set: {e}") from None
    if spec.table == "new-clients" and data["data"]["new_clients"] < 1:
        raise ConfigError("data.new_clients: the new-clients table needs held-out clients; the base config has "
                          "none (e.g. --set data.new_clients=10)")
    configs = []
    for label in spec.rows:
        try:
            configs.append(spec.trial_config({"row": label}))
        except ConfigError as e:
            raise ConfigError(f"row {label!r} of table {spec.table}: {e}") from None
    check_models(configs)


def load_spec(out_dir: Path) -> ReproSpec:
    """The reproduction saved in ``out_dir`` (its rows as they were run, whatever TABLES says now)."""
    path = out_dir / SPEC_FILE
    if not path.is_file() or not (out_dir / TRIALS).is_dir():
        raise ConfigError(f"--resume: {out_dir} holds no reproduction ({SPEC_FILE} and {TRIALS}/ are missing)")
    doc = yaml.safe_load(path.read_text())
    spec = ReproSpec(base=doc["base"], search={}, fixed=doc["set"], base_config=doc["base_config"],
                     table=doc["table"], rows=doc["rows"], seeds=doc["seeds"], name=doc["name"], recorded=True,
                     **_resources(doc["resources"]))
    check(spec)
    return spec


# --- running it ---------------------------------------------------------------------------------------


def reproduce(spec: ReproSpec, out_dir: Path, resume: bool = False) -> list[dict]:
    """Run (or resume) the reproduction and write its results; returns one record per (row, seed)."""
    out_dir = out_dir.resolve()
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
        done = int((result.metrics or {}).get("round", 0))
        status = "error" if result.error else "finished" if done == rounds else "incomplete"
        history = result.metrics_dataframe
        # A resumed trial reports some rounds again: the latest report of a round counts, for every file.
        by_round = {int(r["round"]): r for r in (history.to_dict("records") if history is not None else [])
                    if _present(r.get("round"))}
        reported = [{**{k: r[k] for k in BY_KEY if k in r and _present(r[k])}, "round": n}
                    for n, r in sorted(by_round.items())]
        evaluated = [r for r in reported if "gfl_gm" in r]
        last = evaluated[-1] if evaluated else {}
        failed = [r for r in reported if r.get("clients_failed")]
        records.append({"row": row, "seed": seed, "rounds": done, "eval_round": int(last.get("round", 0)),
                        "status": status, **{k: _value(last.get(k)) for k in ACCURACIES},
                        # Tune's time_total_s: the trial's wall time over all its runs (resumes included)
                        "wall_s": _value((result.metrics or {}).get("time_total_s")),
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


def _present(v) -> bool:
    """A value a trial reported (a round without a metric leaves NaN in the dataframe)."""
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _value(v) -> float:
    """A reported metric as a float; absent (None, or NaN in a dataframe of rounds without it): NaN."""
    return math.nan if v is None else float(v)


class TrialOnDisk:
    """A trial as Ray Tune leaves it in the experiment folder (``params.json``, ``result.json`` and, after a
    failure, ``error.txt``), read without Ray: ``collect`` takes it where it takes Tune's Result, so the
    table of a reproduction still running (or stopped) can be written from its files."""

    def __init__(self, folder: Path):
        import pandas as pd

        self.config = json.loads((folder / "params.json").read_text())
        lines = (folder / "result.json").read_text().splitlines() if (folder / "result.json").is_file() else []
        # A trial resumed from an earlier checkpoint reports some rounds again: the latest report counts.
        by_round = {r["round"]: r for r in map(json.loads, filter(str.strip, lines)) if "round" in r}
        reports = [by_round[k] for k in sorted(by_round)]
        self.metrics = reports[-1] if reports else {}
        self.metrics_dataframe = pd.DataFrame(reports) if reports else None
        self.error = (folder / "error.txt").read_text() if (folder / "error.txt").is_file() else None


def trials_on_disk(out_dir: Path) -> list[TrialOnDisk]:
    # Tune creates a trial's params.json empty and fills it as the trial starts: not begun yet, for us.
    return [TrialOnDisk(p.parent) for p in sorted((out_dir / TRIALS).glob("*/params.json")) if p.stat().st_size]


def status(out_dir: Path) -> list[dict]:
    """Write the results of the reproduction in ``out_dir`` as far as it got (it may be running) from its
    files, without Ray, and return its records."""
    out_dir = out_dir.resolve()
    spec = load_spec(out_dir)
    collected = collect(spec, trials_on_disk(out_dir))
    write_results(spec, collected, out_dir)
    return collected.records


def mean_std(values: list[float]) -> str:
    """Fractions as ``mean ± std`` in % with 2 decimals, the sample std (n - 1) over the seeds; one value:
    the value alone; none: ``-``."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    mean = 100 * statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.2f}"
    return f"{mean:.2f} ± {100 * statistics.stdev(values):.2f}"


def pm_metric(overrides: dict[str, Any]) -> str:
    """The row's P-FL (PM): for FT, the fine-tuned global model's (pfl_ft)."""
    return "pfl_ft" if overrides.get("eval.finetune_train") else "pfl_pm"


def format_table(spec: ReproSpec, records: list[dict]) -> str:
    columns = NEW_COLUMNS if spec.table == "new-clients" else COLUMNS
    seeds = ", ".join(map(str, spec.seeds))
    heading = (f"Table {spec.table}: base {Path(spec.base).name}, {spec.rounds} rounds, seeds {seeds}; "
               "mean ± std over the seeds (sample std), accuracies in %; wall (h): a trial's wall time as it ran "
               "(Tune's time_total_s), its seeds' mean, beside the trials that shared the machine.")
    lines = [heading, "",
             "| method | " + " | ".join(map(title, columns)) + " | wall (h) |",
             "|---|" + "|".join("---:" for _ in columns) + "|---:|"]
    footnotes = []
    for label, overrides in spec.rows.items():
        method = METHODS[spec.row_config(label, spec.seeds[0]).train.head]
        mine = [r for r in records if r["row"] == label and r["status"] == "finished"]
        name = label if len(mine) == len(spec.seeds) else f"{label} ({len(mine)} of {len(spec.seeds)} seeds)"
        if not mine:  # how far it got: the metrics of its last evaluation, at the round they were measured
            mine = [r for r in records if r["row"] == label and r["status"] != "error" and r["eval_round"]]
            reached = max((r["rounds"] for r in records if r["row"] == label), default=0)
            at = sorted({r["eval_round"] for r in mine})
            name = (f"{label} (not started)" if not reached else f"{label} (not finished: round {reached} of "
                    f"{spec.rounds}; " + (f"values at round {', '.join(map(str, at))})" if at else "not yet evaluated)"))
        cells = []
        for key in columns:
            mark = ""
            if key == "pfl_pm" and pm_metric(overrides) == "pfl_ft":
                key, mark = "pfl_ft", " †"
                footnote = (f"† {label}: {title('pfl_pm')} is `pfl_ft`, the global model fine-tuned for "
                            f"{_epochs(overrides['eval.finetune_epochs'])} (ERM) on each client's own data "
                            "at the last round.")
                footnotes += [footnote] if footnote not in footnotes else []
            if key in ("gfl_gm", "pfl_gm") and not HEADS[method.name].global_model:
                mark = " ⋆"
                footnote = ("⋆ no global model: the GM is the mean of the clients' final personalized models, as "
                            "the paper reads these methods.")
                footnotes += [footnote] if footnote not in footnotes else []
            if key == "pfl_gm" and method.pm_from_global:
                # Its GM is made to be adapted: the paper has no P-FL (GM) for it (results.csv has the value).
                cells.append("-")
                continue
            cells.append(mean_std([r[key] for r in mine]) + mark)
        walls = [r["wall_s"] for r in mine if not math.isnan(r["wall_s"])]
        cells.append(f"{statistics.fmean(walls) / 3600:.2f}" if walls else "-")
        # A row whose clients' updates failed (a diverged model's non-finite loss, a crashed client) is not a
        # plain result: say so next to its numbers.
        failing = [r for r in records if r["row"] == label and r.get("failed_updates")]
        if failing:
            name += " ‡"
            seeds_failed = "; ".join(f"seed {r['seed']}: {r['failed_updates']} of {r['updates']}, the first in round "
                                     f"{r['first_failed_round']}" for r in failing)
            footnotes.append(f"‡ {label}: sampled clients' local updates failed and were left out of their "
                             f"rounds' averages ({seeds_failed}); the run's log names each error (e.g. a "
                             "non-finite local loss).")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if spec.table == "new-clients":
        epochs = sorted({row["eval.finetune_epochs"] for row in spec.rows.values()})
        footnotes.append("New clients never train: P-FL of the held-out clients with the global model (hyper: "
                         "+ its zero-shot head) before, and after fine-tuning it on their own data for "
                         f"{' or '.join(map(_epochs, epochs))} at the last round.")
    if spec.table == "privacy":
        footnotes.append("ε: client-level DP at δ = 1e-5 (RDP accountant), the noise multiplier derived from the target "
                         f"over the run's rounds, Poisson sampling, updates clipped to {DP_CLIP_NORM:g}; ε = ∞: the "
                         "method without DP. The personalized head never leaves its client and takes no noise.")
    if footnotes:
        lines += ["", *footnotes]
    return "\n".join(lines) + "\n"


def _epochs(n: int) -> str:
    return f"{n} epoch" + ("s" if n != 1 else "")


def write_results(spec: ReproSpec, collected: Collected, out_dir: Path) -> None:
    (out_dir / "results.csv").write_text(csv_text(CSV_COLUMNS, collected.records))
    # The schema's keys that some trial reported, in the schema's order.
    reported = [k for k in BY_KEY if k not in ("round", "name") and any(k in r for r in collected.rounds)]
    (out_dir / "rounds.csv").write_text(csv_text(("row", "seed", "round", *reported), collected.rounds))
    (out_dir / "table.md").write_text(format_table(spec, collected.records))
    plot_curves(spec, collected.curves, out_dir / "curves.png")


def csv_text(columns: tuple[str, ...], rows: list[dict]) -> str:
    """``rows`` as CSV text with ``columns``; NaN and absent values as empty cells."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, restval="", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()})
    return out.getvalue()


def mean_curve(runs: list[dict[str, list[float]]], key: str) -> tuple[list[float], list[float], list[float]]:
    """Rounds, mean and std (sample std, as in the table; 0 for one run) over the runs of ``key``, at the
    rounds every run reached."""
    n = min(len(run["round"]) for run in runs)
    values = [[run[key][i] for run in runs] for i in range(n)]
    return (runs[0]["round"][:n], [statistics.fmean(v) for v in values],
            [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values])


def plot_curves(spec: ReproSpec, curves: dict, path: Path) -> None:
    import matplotlib

    colors = matplotlib.colormaps["tab20" if len(spec.rows) > 10 else "tab10"]
    with figure(ncols=len(CURVES), figsize=(12, 4.8), sharex=True) as (fig, axes):
        for i, label in enumerate(spec.rows):
            runs = [c for (row, _), c in sorted(curves.items()) if row == label]
            if not runs:
                continue
            for ax, key in zip(axes, CURVES):
                rounds, mean, std = mean_curve(runs, key)
                ax.plot(rounds, [100 * m for m in mean], color=colors(i), label=label,
                        marker="." if len(rounds) < 20 else None)
                ax.fill_between(rounds, [100 * (m - s) for m, s in zip(mean, std)],
                                [100 * (m + s) for m, s in zip(mean, std)], color=colors(i), alpha=0.15,
                                linewidth=0)
        for ax, key in zip(axes, CURVES):
            round_axis(ax)
            ax.set_ylabel(f"{title(key)}, %")
            ax.set_title(f"{title(key)}: mean ± std over {len(spec.seeds)} seed(s)")
            ax.grid(alpha=0.3)
        if curves:
            axes[1].legend(loc="best", fontsize=7)
        fig.suptitle(f"table {spec.table}")
        path.write_bytes(png(fig, dpi=120))
