"""A sweep's definition: a YAML file naming a base experiment config and what to search, checked in full
before any trial starts.

    base: ../configs/synthetic_tiny.yaml      # relative to this file
    set: {train.rounds: 3}                     # fixed overrides of the base (optional)
    search:                                    # dotted config keys
      train.gamma: {grid: [0.0, 1.0]}
      train.lr: {loguniform: [0.005, 0.05]}
      train.rule_params.mu: {choice: [0.001, 0.01]}
    num_samples: 2          # draws of the random dimensions (x the grid)
    metric: hmean           # gfl | pfl_pm | hmean (harmonic mean of the two; the default) | pfl_new_before | pfl_new_after
    scheduler: asha         # asha | none
    asha: {grace_period: 1, reduction_factor: 2}
    resources: {client_slots: 1, client: {num_cpus: 1}}   # per trial
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fedrod_ray.client_update.local import derived_seed
from fedrod_ray.config import ConfigError, ExperimentConfig, apply_override, config_from_dict, load_config

# The held-out new clients' P-FL (data.new_clients) before and after their fine-tuning, measured at an exact
# evaluation only: a sweep for the new-clients table ranks on new clients of its own split (its seed), not
# the table's reported ones.
NEW_CLIENT_METRICS = ("pfl_new_before", "pfl_new_after")
METRICS = ("gfl", "pfl_pm", "hmean", *NEW_CLIENT_METRICS)
SCHEDULERS = ("asha", "none")
SAMPLERS = ("grid", "choice", "uniform", "loguniform")
SPEC_KEYS = {"base", "set", "search", "num_samples", "metric", "scheduler", "asha", "resources", "name",
             "privacy_budget"}
COORDINATOR_MEMORY = 512 * 2**20  # the coordinator's bundle: it needs memory, not a core
# What every trial sets itself, whatever its base config says, and why: setting it in a sweep has no effect.
_ON_ITS_ACTORS = "it runs on its placement group's actors, sized by resources (reproduce: --resources)"
TRIAL_RUNTIME = {
    "runtime.mode": _ON_ITS_ACTORS,
    "runtime.address": _ON_ITS_ACTORS,
    "runtime.clients_per_actor": _ON_ITS_ACTORS,
    "runtime.client_resources": _ON_ITS_ACTORS,
    "runtime.checkpoint_every": "it checkpoints every round before reporting it, so that a resumed trial goes "
                                "on from its last report",
}


@dataclass
class SweepSpec:
    base: str  # path of the base experiment config
    search: dict[str, dict[str, list]]
    fixed: dict[str, Any] = field(default_factory=dict)
    num_samples: int = 1
    metric: str = "hmean"
    scheduler: str = "asha"
    asha: dict[str, int] = field(default_factory=lambda: {"grace_period": 1, "reduction_factor": 2})
    client_slots: int = 1
    client_resources: dict[str, float] = field(default_factory=lambda: {"num_cpus": 1.0})
    name: str = "sweep"
    # A private sweep's total epsilon (every trial's rounds composed), which it refuses to start past.
    privacy_budget: float | None = None

    def to_dict(self) -> dict:
        """The sweep file of this sweep (what ``--resume`` reads back)."""
        doc = {"name": self.name, "base": self.base, "set": dict(self.fixed), "search": self.search,
               "num_samples": self.num_samples, "metric": self.metric, "scheduler": self.scheduler,
               "resources": {"client_slots": self.client_slots, "client": dict(self.client_resources)}}
        if self.scheduler == "asha":
            doc["asha"] = dict(self.asha)
        if self.privacy_budget is not None:
            doc["privacy_budget"] = self.privacy_budget
        return doc

    def base_data(self) -> dict:
        """The base experiment config, as a dict to apply overrides to."""
        return load_config(self.base).to_dict()

    def _data(self, params: dict[str, Any], trial: bool) -> dict:
        data = self.base_data()
        for key, value in [*self.fixed.items(), *params.items()]:
            apply_override(data, f"{key}={json.dumps(value)}")  # JSON is YAML
        own_noise(data, params)
        if trial:
            # A trial reports each round's metrics, on which ASHA decides: the estimate's
            # (eval.estimate_size) where the config has one, else an exact evaluation every round.
            if not data["eval"].get("estimate_size"):
                data["eval"]["eval_every"] = 1
            self.place_trial(data)
        return data

    def place_trial(self, data: dict) -> None:
        """A trial's client actors fill its placement group, and it checkpoints every round (what Tune's
        checkpoint of each report names: ``trial.py``), whatever the base's runtime says (``TRIAL_RUNTIME``)."""
        data["runtime"].update(mode="ray", address=None, clients_per_actor=0,
                               client_resources=dict(self.client_resources), checkpoint_every=1)

    def experiment_config(self, params: dict[str, Any]) -> ExperimentConfig:
        """The base config with the fixed overrides and ``params`` (dotted key -> value): what
        ``fedrod-ray train`` would run."""
        return config_from_dict(self._data(params, trial=False))

    def trial_config(self, params: dict[str, Any]) -> ExperimentConfig:
        """The config a trial runs: ``experiment_config`` evaluated (or, with ``eval.estimate_size``,
        estimated) every round, on the trial's actors."""
        return config_from_dict(self._data(params, trial=True))

    def bundles(self) -> list[dict[str, float]]:
        """The trial's placement group: the coordinator's bundle, then one per client slot."""
        client = {{"num_cpus": "CPU", "num_gpus": "GPU"}.get(k, k): v for k, v in self.client_resources.items() if v}
        return [{"memory": COORDINATOR_MEMORY}] + [dict(client) for _ in range(self.client_slots)]


def own_noise(data: dict, params: dict[str, Any]) -> None:
    """Every trial draws its own noise: models that differ only in sigma but share their noise give the
    noise-free mean by a linear combination. Secure noise (``privacy.noise_seed`` null) is fresh in every
    run; a seeded sweep's ``noise_seed`` becomes each trial's own, mixed from it and the trial's ``params``
    (the same trial, resumed or rerun from best.yaml, gets the same one). It applies to the private trials
    only: a trial without privacy.enabled (a reproduction's epsilon = inf rows) drops it."""
    privacy = data.get("privacy") or {}
    if privacy.get("noise_seed") is None:
        return
    if not privacy.get("enabled"):
        privacy["noise_seed"] = None
        return
    digest = hashlib.sha256(json.dumps(params, sort_keys=True, default=str).encode()).digest()
    privacy["noise_seed"] = derived_seed(privacy["noise_seed"], int.from_bytes(digest[:8], "big"))


def load_sweep(path: str | Path, overrides: list[str] | None = None) -> SweepSpec:
    """Read and check a sweep file; ``overrides`` (``key=value``) change the sweep file itself, e.g.
    ``num_samples=4`` or ``set.train.rounds=5``."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"--config: {path} does not exist") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a sweep file is a mapping with base, search, ...")
    for assignment in overrides or []:
        key, sep, value = assignment.partition("=")
        if not sep:
            raise ConfigError(f"--set expects key=value, got {assignment!r}")
        head, _, rest = key.partition(".")
        if head in ("set", "search") and rest:
            raw.setdefault(head, {})[rest] = yaml.safe_load(value)
        else:
            apply_override(raw, assignment)
    unknown = sorted(set(raw) - SPEC_KEYS)
    if unknown:
        raise ConfigError(f"{unknown[0]}: not a sweep setting; expected one of {sorted(SPEC_KEYS)}")
    if "base" not in raw:
        raise ConfigError("base: the sweep file must name a base experiment config")
    if raw.get("scheduler") == "none" and raw.get("asha") is not None:
        raise ConfigError("asha: has no effect with scheduler: none; remove it, or --set asha=null")
    base = (path.parent / raw["base"]).resolve()
    if not base.is_file():
        raise ConfigError(f"base: {base} does not exist")
    resources = raw.get("resources") or {}
    spec = SweepSpec(
        base=str(base), search=raw.get("search") or {}, fixed=raw.get("set") or {},
        num_samples=raw.get("num_samples", 1), metric=raw.get("metric", "hmean"),
        scheduler=raw.get("scheduler", "asha"), asha={"grace_period": 1, "reduction_factor": 2, **(raw.get("asha") or {})},
        client_slots=resources.get("client_slots", 1),
        client_resources={k: float(v) for k, v in (resources.get("client") or {"num_cpus": 1}).items()},
        name=raw.get("name", path.stem), privacy_budget=raw.get("privacy_budget"),
    )
    _check(spec)
    return spec


def _check_new_client_metric(metric: str, scheduler: str, base) -> None:
    """A sweep ranked on held-out clients needs them (and, after, their fine-tuning), and no ASHA, which
    ranks every round: they are measured at the exact evaluations only."""
    if base.data.new_clients < 1:
        raise ConfigError(f"metric: {metric} is the held-out clients' P-FL; set data.new_clients to 1 or more")
    if metric == "pfl_new_after" and base.eval.finetune_epochs < 1:
        raise ConfigError("metric: pfl_new_after is measured after fine-tuning; set eval.finetune_epochs to 1 or more")
    if scheduler == "asha":
        raise ConfigError(f"scheduler: asha ranks trials every round, and {metric} is measured only at the exact "
                          "evaluations; use scheduler: none")


def _check(spec: SweepSpec) -> None:
    if spec.metric not in METRICS:
        raise ConfigError(f"metric: {spec.metric!r} is not one of {list(METRICS)}")
    if spec.scheduler not in SCHEDULERS:
        raise ConfigError(f"scheduler: {spec.scheduler!r} is not one of {list(SCHEDULERS)}")
    if not (isinstance(spec.num_samples, int) and spec.num_samples >= 1):
        raise ConfigError(f"num_samples: must be an integer >= 1, got {spec.num_samples!r}")
    if not (isinstance(spec.client_slots, int) and spec.client_slots >= 1):
        raise ConfigError(f"resources.client_slots: must be an integer >= 1, got {spec.client_slots!r}")
    for key in ("grace_period", "reduction_factor"):
        if not (isinstance(spec.asha.get(key), int) and spec.asha[key] >= 1):
            raise ConfigError(f"asha.{key}: must be an integer >= 1, got {spec.asha.get(key)!r}")
    if set(spec.asha) - {"grace_period", "reduction_factor"}:
        raise ConfigError(f"asha: takes grace_period and reduction_factor, not {sorted(set(spec.asha))}")
    if not spec.search:
        raise ConfigError("search: name at least one config key to search")
    for section, keys in (("set", spec.fixed), ("search", spec.search)):
        for key in keys:
            why = trial_owned(key)
            if why:
                raise ConfigError(f"{section}.{key}: {why}")
    try:
        base = spec.experiment_config({})
    except ConfigError as e:
        raise ConfigError(f"set: {e}") from None
    if spec.metric in NEW_CLIENT_METRICS:
        _check_new_client_metric(spec.metric, spec.scheduler, base)
    if spec.privacy_budget is not None:
        budget = spec.privacy_budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget < math.inf:
            raise ConfigError(f"privacy_budget: must be a positive number (a total epsilon), got {budget!r}")
        if not base.privacy.enabled:
            raise ConfigError("privacy_budget: has no effect: the base config is not private (privacy.enabled)")
    corners: list[dict[str, Any]] = [{}]
    for key, dist in spec.search.items():
        values = _check_dimension(key, dist)
        corners = [{**c, key: v} for c in corners for v in values]
    # Every extreme of the space must give a valid config: an unknown key or a value out of its range
    # fails here, naming the key, before any trial starts.
    configs = []
    for corner in corners[:256]:
        try:
            configs.append(spec.experiment_config(corner))
            spec.trial_config(corner)
        except ConfigError as e:
            raise ConfigError(f"search: {e}") from None
    check_models(configs)


def overlap(a: str, b: str) -> bool:
    """The two dotted keys name the same setting or one holds the other (train.rule_params, .mu)."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def trial_owned(key: str) -> str | None:
    """Why setting ``key`` has no effect, where it names or holds a setting of ``TRIAL_RUNTIME`` (None: the
    trial leaves it as it is)."""
    owned = next((k for k in TRIAL_RUNTIME if overlap(key, k)), None)
    return owned and f"has no effect: every trial sets {owned} itself ({TRIAL_RUNTIME[owned]})"


def check_models(configs: list[ExperimentConfig]) -> None:
    """Each distinct user model.arch of ``configs``, on its data, imports, builds and gives N x d features
    (``check_model_arch``: a ConfigError naming model.arch), before any trial starts."""
    from fedrod_ray.federation_state.setup import check_model_arch

    seen = set()
    for cfg in configs:
        key = (cfg.model.arch, json.dumps(dataclasses.asdict(cfg.data), sort_keys=True))
        if key not in seen:
            seen.add(key)
            check_model_arch(cfg)


def _check_dimension(key: str, dist: Any) -> list:
    """The values a dimension can take at its extremes (all of them for grid and choice)."""
    if not (isinstance(dist, dict) and len(dist) == 1 and next(iter(dist)) in SAMPLERS):
        raise ConfigError(f"search.{key}: must be one of {{grid: [...]}}, {{choice: [...]}}, "
                          f"{{uniform: [low, high]}}, {{loguniform: [low, high]}}; got {dist!r}")
    kind, values = next(iter(dist.items()))
    if not (isinstance(values, list) and values):
        raise ConfigError(f"search.{key}.{kind}: must be a non-empty list, got {values!r}")
    if kind in ("grid", "choice"):
        return values
    if len(values) != 2 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        raise ConfigError(f"search.{key}.{kind}: must be [low, high], two finite numbers, got {values!r}")
    low, high = values
    if not low < high:
        raise ConfigError(f"search.{key}.{kind}: low must be below high, got {values!r}")
    if kind == "loguniform" and low <= 0:
        raise ConfigError(f"search.{key}.loguniform: needs low > 0, got {low!r}")
    return [low, high]


def param_space(spec: SweepSpec) -> dict[str, Any]:
    """Ray Tune's search space, keyed by the dotted config keys."""
    from ray import tune

    make = {"grid": tune.grid_search, "choice": tune.choice,
            "uniform": lambda v: tune.uniform(*v), "loguniform": lambda v: tune.loguniform(*v)}
    return {key: make[kind](values) for key, dist in spec.search.items() for kind, values in dist.items()}
