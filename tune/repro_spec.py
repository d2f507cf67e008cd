"""A reproduction of a table as a sweep (``ReproSpec``): built from the command line (``build_spec``, with
``parse_seeds`` and ``parse_sets``) or read back from its ``reproduce.yaml`` (``load_spec``), and checked
in full before any trial starts, so a conflicting --set or a bad row fails in seconds, not mid-run; and
each seed's split made where the data is (``check_splits``), so a seed that leaves a client without
examples fails before the first trial, not when its own trials start hours later."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, replace
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
    without_record_keys,
)
from fedrod_ray.data import DatasetNotFoundError, load_dataset
from fedrod_ray.federation_state.setup import partition_dataset
from fedrod_ray.objectives import meta_per_class

from .space import SweepSpec, check_models, overlap, trial_owned
from .sweep import TRIALS
from .tables import TABLES

SPEC_FILE = "reproduce.yaml"


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


def build_spec(table: str, base: str | Path, seeds: list[int], rounds: int | None = None,
               overrides: dict[str, Any] | None = None, resources: dict | None = None,
               rows: list[str] | None = None, finetune_epochs: int | None = None) -> ReproSpec:
    """The reproduction of ``table`` (or of its ``rows`` alone) on the ``base`` config, checked in full:
    every row's config is built and validated before any trial starts. The rows that fine-tune do it for
    ``finetune_epochs`` (default tables.FINETUNE_EPOCHS)."""
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
    spec = ReproSpec(base=recorded_path(base), search={}, fixed=fixed, base_config=load_config(base).to_dict(),
                     table=table, rows=_finetuning(table, [r for r in TABLES[table] if not rows or r in rows],
                                                   finetune_epochs),
                     seeds=list(seeds), name=f"{table}_{base.stem}", **_resources(resources or {}))
    check(spec)
    return spec


def recorded_path(path: Path) -> str:
    """How a reproduction records its base config: relative to the git repository that holds it (the path
    and the commit, which the results record beside it, name it on any machine; no clone's own path), else,
    outside any repository, as an absolute path."""
    path = path.resolve()
    repository = next((d for d in path.parents if (d / ".git").exists()), None)
    return str(path.relative_to(repository)) if repository else str(path)


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
        if overlap(key, "seed"):
            raise ConfigError("--set seed: the seeds come from --seeds")
        why = trial_owned(key)
        if why:
            raise ConfigError(f"--set {key}: {why}")
        for label, row in spec.rows.items():
            clash = next((k for k in row if overlap(key, k)), None)
            if clash:
                raise ConfigError(f"--set {key}: conflicts with row {label!r} of table {spec.table}, which sets "
                                  f"{clash}={row[clash]!r}; a --set may change only what no row sets")
    # Keys and types of the base with --set, before any row: an unknown key is the --set's, not a row's.
    data = without_record_keys(spec.base_data()) if spec.recorded else spec.base_data()
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


def check_splits(spec: ReproSpec) -> bool:
    """Make the split of every (row, seed) of ``spec`` here, each distinct one once, and raise a ConfigError
    naming --seeds, the seed and the row where a split cannot be trained on (a Dirichlet draw that leaves a
    client without examples, at ``data.min_per_client: 0``).

    Returns False, having checked nothing, where the data is not on this machine (the driver of a cluster
    whose data lives on its workers): nothing is downloaded here, and each trial checks its own split as it
    starts, as it always does."""
    datasets: dict[tuple[str, int], Any] = {}
    made: set[tuple[str, int, int]] = set()
    for seed in spec.seeds:
        for label in spec.rows:
            cfg = spec.row_config(label, seed)
            data = json.dumps(cfg.to_dict()["data"], sort_keys=True)
            key = (data, seed, meta_per_class(cfg.train))
            if key in made:
                continue
            if (data, seed) not in datasets:
                try:
                    datasets[data, seed] = load_dataset(replace(cfg.data, download=False), seed)
                except DatasetNotFoundError:
                    return False
            try:
                partition_dataset(cfg, datasets[data, seed])
            except ConfigError as e:
                raise ConfigError(f"--seeds: seed {seed} cannot run row {label!r} of table {spec.table}: {e}") from None
            made.add(key)
    return True


def load_spec(out_dir: Path) -> ReproSpec:
    """The reproduction saved in ``out_dir`` (its rows as they were run, whatever TABLES says now)."""
    path = out_dir / SPEC_FILE
    if not path.is_file() or not (out_dir / TRIALS).is_dir():
        raise ConfigError(f"--resume: {out_dir} holds no reproduction ({SPEC_FILE} and {TRIALS}/ are missing)")
    return spec_from_doc(yaml.safe_load(path.read_text()))


def spec_from_doc(doc: dict) -> ReproSpec:
    """The reproduction a ``reproduce.yaml`` holds (its rows as they were run), checked."""
    spec = ReproSpec(base=doc["base"], search={}, fixed=doc["set"], base_config=doc["base_config"],
                     table=doc["table"], rows=doc["rows"], seeds=doc["seeds"], name=doc["name"], recorded=True,
                     **_resources(doc["resources"]))
    check(spec)
    return spec
