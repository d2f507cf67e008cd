"""Typed experiment configuration, loaded from YAML with ``--set key=value`` overrides.

Every section is a dataclass; unknown keys and values of the wrong type or range fail with a
``ConfigError`` that names the dotted field (``train.lr``), so a typo in a sweep never silently runs
the default.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid; the message names the field."""


@dataclass
class DataConfig:
    dataset: str = "mnist"  # mnist | fmnist | emnist | cifar10 | cifar100 | synthetic
    data_dir: str | None = None  # else $FEDROD_DATA_DIR, else the user cache dir
    download: bool = True
    num_clients: int = 100  # training clients
    new_clients: int = 0  # extra held-out clients that never train (zero-shot evaluation)
    partition: str = "dirichlet"  # dirichlet | iid
    alpha: float = 0.1
    min_per_client: int = 10
    imbalance_ratio: float = 1.0  # >1: exponentially long-tailed global data before partitioning
    synthetic_train_per_class: int = 600
    synthetic_test_per_class: int = 100


@dataclass
class ModelConfig:
    arch: str = "auto"  # auto (from the dataset) | mnist_cnn | cifar_cnn
    hyper_hidden: int = 16  # the paper: 16, 32 for CIFAR-10


@dataclass
class TrainConfig:
    algorithm: str = "fedrod"  # fedrod | fedavg
    variant: str = "linear"  # fedrod only: linear | hyper
    balanced_loss: str = "bsm"  # bsm | ce | reweight | ldam | cdt
    gamma: float = 1.0
    generic_rule: str = "fedavg"  # fedavg | fedprox | feddyn
    prox_mu: float = 0.01  # FedProx lambda
    feddyn_alpha: float = 0.01  # FedDyn lambda
    rounds: int = 100
    client_fraction: float = 0.2
    local_epochs: int = 5
    batch_size: int = 40
    lr: float = 0.01
    lr_decay: float = 0.99  # multiplied into lr once per round
    momentum: float = 0.9
    weight_decay: float = 1e-5
    augment: bool | None = None  # None: the dataset's default (on for CIFAR)


@dataclass
class EvalConfig:
    eval_every: int = 1
    batch_size: int = 1000


@dataclass
class RuntimeConfig:
    mode: str = "local"  # local (in-process) | ray
    address: str | None = None  # ray only: None starts local Ray, "auto" joins a running cluster
    torch_threads: int = 0  # 0: all cores of this process (in-process) / the actor's CPUs (Ray)
    device: str = "cpu"  # in-process only; Ray actors use a GPU when their resources hold one
    clients_per_actor: int = 0  # 0: sized from the cluster's resources
    client_resources: dict[str, float] = field(default_factory=lambda: {"num_cpus": 1.0})
    max_restarts: int = 3
    min_clients_per_round: int = 1
    max_failed_fraction: float = 0.5
    checkpoint_every: int = 1


@dataclass
class ExperimentConfig:
    name: str = "fedrod"
    seed: int = 0
    run_dir: str | None = None  # default runs/<name>
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_CHOICES = {
    "data.dataset": {"mnist", "fmnist", "emnist", "cifar10", "cifar100", "synthetic"},
    "data.partition": {"dirichlet", "iid"},
    "model.arch": {"auto", "mnist_cnn", "cifar_cnn"},
    "train.algorithm": {"fedrod", "fedavg"},
    "train.variant": {"linear", "hyper"},
    "train.balanced_loss": {"bsm", "ce", "reweight", "ldam", "cdt"},
    "train.generic_rule": {"fedavg", "fedprox", "feddyn"},
    "runtime.mode": {"local", "ray"},
}
_POSITIVE = {
    "data.num_clients", "data.alpha", "data.imbalance_ratio", "data.synthetic_train_per_class",
    "data.synthetic_test_per_class", "model.hyper_hidden", "train.rounds", "train.client_fraction",
    "train.local_epochs", "train.batch_size", "train.lr", "train.lr_decay", "eval.eval_every",
    "eval.batch_size", "runtime.checkpoint_every", "runtime.min_clients_per_round",
}
_NON_NEGATIVE = {
    "data.new_clients", "data.min_per_client", "train.gamma", "train.prox_mu", "train.feddyn_alpha",
    "train.momentum", "train.weight_decay", "runtime.torch_threads", "runtime.clients_per_actor",
    "runtime.max_restarts", "runtime.max_failed_fraction",
}


def _check_type(path: str, value: Any, tp: Any) -> Any:
    """Return ``value`` converted to ``tp`` where that is lossless, else raise ConfigError."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(path, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{path}: invalid value {value!r}")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        _, vt = typing.get_args(tp)
        return {str(k): _check_type(f"{path}.{k}", v, vt) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads "1e-3" (no dot) as a string, and Python prints small floats that way.
        if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            return float(value)
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    raise ConfigError(f"{path}: unsupported type {tp}")


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"unknown config key {prefix}{unknown[0]!s}; valid keys here: {', '.join(sorted(fields))}"
        )
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        path = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value or {}, path + ".")
        else:
            kwargs[name] = _check_type(path, value, tp)
    return cls(**kwargs)


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
    flat = _flatten(cfg.to_dict())
    for path, allowed in _CHOICES.items():
        if flat[path] not in allowed:
            raise ConfigError(f"{path}: {flat[path]!r} is not one of {sorted(allowed)}")
    for path in _POSITIVE:
        if flat[path] is not None and not flat[path] > 0:
            raise ConfigError(f"{path}: must be > 0, got {flat[path]!r}")
    for path in _NON_NEGATIVE:
        if flat[path] is not None and flat[path] < 0:
            raise ConfigError(f"{path}: must be >= 0, got {flat[path]!r}")
    if cfg.train.client_fraction > 1:
        raise ConfigError(f"train.client_fraction: must be in (0, 1], got {cfg.train.client_fraction}")
    if cfg.runtime.max_failed_fraction > 1:
        raise ConfigError("runtime.max_failed_fraction: must be in [0, 1]")
    for key, amount in cfg.runtime.client_resources.items():
        if amount < 0:
            raise ConfigError(f"runtime.client_resources.{key}: must be >= 0, got {amount}")
    return cfg


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "client_resources":
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def apply_override(data: dict[str, Any], assignment: str) -> None:
    """Apply one ``a.b.c=value`` override (value parsed as YAML) to a nested dict in place."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    key, raw = assignment.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: cannot parse value {raw!r}: {e}") from None
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part} is not a section")
        node = child
    node[parts[-1]] = value


def config_from_dict(data: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    data = _deep_copy(data or {})
    for assignment in overrides:
        apply_override(data, assignment)
    return validate(_build(ExperimentConfig, data))


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
    return config_from_dict(data, overrides)


def dump_config(cfg: ExperimentConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d
