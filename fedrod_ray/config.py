"""Typed experiment configuration, loaded from YAML with ``--set key=value`` overrides.

Every section is a dataclass; unknown keys and values of the wrong type or range fail with a
``ConfigError`` that names the dotted field (``train.lr``), so a typo in a sweep never silently runs
the default.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
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
    # The paper's split gives each client what its Dirichlet draws give it; > 0 tops small clients up to
    # this many examples (earlier versions: 10), which changes Dir(0.1) splits and never Dir(0.3) FMNIST's.
    min_per_client: int = 0
    # Inputs as (x / 255 - mean) / std with the dataset's per-channel statistics (false: x / 255). The paper
    # says "inputs normalised" for CIFAR and nothing for (F)MNIST.
    normalize: bool = True
    imbalance_ratio: float = 1.0  # >1: exponentially long-tailed global data before partitioning
    synthetic_train_per_class: int = 600
    synthetic_test_per_class: int = 100


@dataclass
class ModelConfig:
    arch: str = "auto"  # auto (from the dataset) | mnist_cnn | cifar_cnn
    hyper_hidden: int | None = None  # train.head=hyper only; None: the paper's (32 for CIFAR-10, else 16)
    init: str = "normal"  # initial weights: normal (the paper's) | pytorch (PyTorch's default; see INITS)


@dataclass
class MetaBSMConfig:
    """Fed-RoD (Meta-BSM), ``train.balanced_loss: meta_bsm`` only (fedrod_ray.meta_bsm)."""

    meta_lr: float = 1.0  # SGD step size of gamma_m and the Meta-Weight-Net on the meta loss, once per mini-batch
    meta_per_class: int = 10  # the server's balanced meta set: examples per class taken out of the training set
    hidden: int = 100  # Meta-Weight-Net width: loss -> hidden -> weight (Shu et al., 2019)


@dataclass
class TrainConfig:
    head: str = "linear"  # personalized head: none (one-head model) | linear (phi_m) | hyper (H(a_m; nu))
    balanced_loss: str = "bsm"  # the generic head's loss: bsm | ce | reweight | ldam | cdt | meta_bsm
    gamma: float | None = None  # bsm, ldam, cdt, meta_bsm (gamma_m's initial value) only; None: 1.0
    meta_bsm: MetaBSMConfig = field(default_factory=MetaBSMConfig)
    generic_rule: str = "fedavg"  # a rule registered in fedrod_ray.algorithms
    rule_params: dict[str, Any] = field(default_factory=dict)  # the rule's hyperparameters, e.g. {mu: 0.01}
    rounds: int = 100
    client_fraction: float = 0.2
    local_epochs: int = 5
    batch_size: int = 40
    lr: float = 0.01
    lr_decay: float = 0.99  # multiplied into lr once per round
    momentum: float = 0.9
    weight_decay: float = 1e-5
    augment: bool | None = None  # None: the dataset's default (on for CIFAR)
    # How a mini-batch's losses run (fedrod_ray.step): eager | compiled (torch.compile; slower on CPU)
    step: str = "eager"

    @property
    def variant(self) -> str | None:
        """The model's personalized part (``FedModel.variant``): None for the one-head model."""
        return None if self.head == "none" else self.head

    @property
    def mwn_hidden(self) -> int | None:
        """The model's Meta-Weight-Net width (``FedModel.mwn``): None without Meta-BSM."""
        return self.meta_bsm.hidden if self.balanced_loss == "meta_bsm" else None

    @property
    def meta_per_class(self) -> int:
        """Examples per class of the server's meta set (0: no meta set, the training set is all the clients')."""
        return self.meta_bsm.meta_per_class if self.balanced_loss == "meta_bsm" else 0


@dataclass
class EvalConfig:
    eval_every: int = 1
    batch_size: int = 1000
    # At the last round's evaluation: k epochs of fine-tuning on each held-out new client's own data, starting
    # from the global model (hyper: with its zero-shot head), then its P-FL (pfl_new_after); 0: none.
    finetune_epochs: int = 0
    finetune_train: bool = False  # fine-tune every training client that way too (pfl_ft: the FT baseline)


@dataclass
class RuntimeConfig:
    # auto: ray where Ray is (inside a Ray job, with RAY_ADDRESS set, or with an address), else local
    mode: str = "auto"  # auto | local (in-process) | ray
    address: str | None = None  # ray only: None starts a private local Ray, "auto" joins a running cluster
    torch_threads: int = 0  # 0: all cores of this process (in-process) / the actor's CPUs (Ray)
    device: str = "cpu"  # in-process only; Ray actors use a GPU when their resources hold one
    # in-process only: 0 trains a round's clients one after another; k > 0 trains up to k of them at once in
    # one batched computation (fedrod_ray.batched; for a GPU: on CPU it is slower)
    batched_clients: int = 0
    clients_per_actor: int = 0  # 0: sized from the cluster's resources
    client_resources: dict[str, float] = field(default_factory=lambda: {"num_cpus": 1.0})
    max_restarts: int = 3
    min_clients_per_round: int = 1
    max_failed_fraction: float = 0.5
    checkpoint_every: int = 1
    progress_seconds: float = 30.0  # not on a terminal: a progress line inside a round at most this often


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

    @property
    def hyper_hidden(self) -> int:
        """The hypernetwork's hidden width: as set, else the paper's for the dataset."""
        if self.model.hyper_hidden is not None:
            return self.model.hyper_hidden
        return 32 if self.data.dataset == "cifar10" else 16


DEFAULT_GAMMA = 1.0
# The balanced losses that have an exponent or margin gamma (Meta-BSM: gamma_m's initial value).
GAMMA_LOSSES = {"bsm", "ldam", "cdt", "meta_bsm"}
HEADS = ("none", "linear", "hyper")
# model.init: "normal" is the paper's ("weights initialised from normal distributions"; it names no scale,
# so He's, N(0, 2 / fan_in), which keeps a ReLU network's activations at one scale); "pytorch" is PyTorch's
# default (Kaiming-uniform, a = sqrt(5)), what versions before 0.3 used.
INITS = ("normal", "pytorch")
STEPS = ("eager", "compiled")  # train.step (fedrod_ray.step)
# Keys of earlier versions, with what replaced them.
_RENAMED = {
    "train.algorithm": "train.head (fedrod -> linear or hyper; fedavg -> none, with train.balanced_loss=ce "
                       "for plain FedAvg)",
    "train.variant": "train.head (linear | hyper)",
    "train.prox_mu": "train.rule_params.mu (with train.generic_rule=fedprox)",
    "train.feddyn_alpha": "train.rule_params.alpha (with train.generic_rule=feddyn)",
}
# What --resume may change: how and how long to run, never what is learned.
RESUMABLE = ("name", "run_dir", "data.data_dir", "data.download", "train.rounds", "eval.", "runtime.")


_CHOICES = {
    "data.dataset": {"mnist", "fmnist", "emnist", "cifar10", "cifar100", "synthetic"},
    "data.partition": {"dirichlet", "iid"},
    "model.arch": {"auto", "mnist_cnn", "cifar_cnn"},
    "model.init": set(INITS),
    "train.head": set(HEADS),
    "train.balanced_loss": {"bsm", "ce", "reweight", "ldam", "cdt", "meta_bsm"},
    "train.step": set(STEPS),
    "runtime.mode": {"auto", "local", "ray"},
}
_POSITIVE = {
    "data.num_clients", "data.alpha", "data.imbalance_ratio", "data.synthetic_train_per_class",
    "data.synthetic_test_per_class", "model.hyper_hidden", "train.rounds", "train.client_fraction",
    "train.local_epochs", "train.batch_size", "train.lr", "train.lr_decay", "eval.eval_every",
    "eval.batch_size", "runtime.checkpoint_every", "runtime.min_clients_per_round",
    "train.meta_bsm.meta_lr", "train.meta_bsm.meta_per_class", "train.meta_bsm.hidden",
}
_NON_NEGATIVE = {
    "data.new_clients", "data.min_per_client", "train.gamma",
    "train.momentum", "train.weight_decay", "eval.finetune_epochs", "runtime.progress_seconds",
    "runtime.torch_threads", "runtime.clients_per_actor", "runtime.batched_clients",
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
    if tp is Any:
        return value
    raise ConfigError(f"{path}: unsupported type {tp}")


def build_dataclass(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """``cls(**data)`` with every value type-checked; errors name the dotted field (``prefix`` + name)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{prefix}{unknown[0]!s}"
        if key in _RENAMED:
            raise ConfigError(f"{key} was replaced by {_RENAMED[key]}")
        valid = ", ".join(sorted(fields)) or "none"
        raise ConfigError(f"unknown config key {key}{_did_you_mean(unknown[0], fields, prefix)}; "
                          f"valid keys here: {valid}")
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        path = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build_dataclass(tp, value or {}, path + ".")
        else:
            kwargs[name] = _check_type(path, value, tp)
    return cls(**kwargs)


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
    flat = _flatten(cfg.to_dict())
    for path, allowed in _CHOICES.items():
        if flat[path] not in allowed:
            hint = _did_you_mean(str(flat[path]), allowed)
            raise ConfigError(f"{path}: {flat[path]!r} is not one of {sorted(allowed)}{hint}")
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
    if cfg.runtime.mode == "auto":
        # A Ray job's driver always has RAY_ADDRESS (the job supervisor sets it): there the federation
        # belongs on the cluster, not in the driver process. Resolved here, so config.yaml records it.
        # An http(s) RAY_ADDRESS is a dashboard, set for the `ray job` CLI: no cluster to train on from here.
        env = os.environ.get("RAY_ADDRESS", "")
        on_ray = cfg.runtime.address is not None or bool(env and not env.startswith(("http://", "https://")))
        cfg.runtime.mode = "ray" if on_ray else "local"
    _check_effective(cfg)
    from .algorithms import build_rule

    # Stored as the rule resolved them: typed, with its defaults, so config.yaml records what ran.
    cfg.train.rule_params = dataclasses.asdict(build_rule(cfg.train.generic_rule, cfg.train.rule_params).params)
    return cfg


def _did_you_mean(given: str, options, prefix: str = "") -> str:
    close = difflib.get_close_matches(given, sorted(options), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _check_effective(cfg: ExperimentConfig) -> None:
    """A setting that would change nothing is an error: the user meant something else."""
    t = cfg.train
    if t.gamma is not None and t.balanced_loss not in GAMMA_LOSSES:
        raise ConfigError(f"train.gamma: has no effect with train.balanced_loss={t.balanced_loss} "
                          f"(gamma is used by {', '.join(sorted(GAMMA_LOSSES))}); remove it")
    if t.balanced_loss != "meta_bsm":
        for f in dataclasses.fields(MetaBSMConfig):
            if getattr(t.meta_bsm, f.name) != f.default:
                raise ConfigError(f"train.meta_bsm.{f.name}: has no effect with train.balanced_loss="
                                  f"{t.balanced_loss} (only meta_bsm uses it); remove it")
    if cfg.model.hyper_hidden is not None and t.head != "hyper":
        raise ConfigError(f"model.hyper_hidden: has no effect with train.head={t.head} "
                          "(only the hyper head has a hypernetwork); remove it")
    if cfg.data.min_per_client and cfg.data.partition != "dirichlet":
        raise ConfigError(f"data.min_per_client: has no effect with data.partition={cfg.data.partition} "
                          "(only the Dirichlet split is topped up); remove it")
    ev = cfg.eval
    if ev.finetune_train and ev.finetune_epochs == 0:
        raise ConfigError("eval.finetune_train: has no effect with eval.finetune_epochs=0; set the number of "
                          "fine-tuning epochs")
    if ev.finetune_epochs > 0 and not ev.finetune_train and cfg.data.new_clients == 0:
        raise ConfigError("eval.finetune_epochs: has no effect without held-out clients (data.new_clients) or "
                          "eval.finetune_train=true")
    if t.generic_rule == "local" and t.head == "hyper":
        raise ConfigError("train.generic_rule: local (local-only training) cannot use train.head=hyper, whose "
                          "hypernetwork the server averages; use train.head=none or linear")
    rt = cfg.runtime
    if rt.mode == "local" and rt.address is not None:
        raise ConfigError("runtime.address: has no effect with runtime.mode=local; set runtime.mode=ray")
    if rt.mode == "ray" and rt.device != "cpu":
        raise ConfigError("runtime.device: has no effect with runtime.mode=ray (actors use a GPU when "
                          "runtime.client_resources asks for num_gpus); remove it")
    if rt.batched_clients and rt.mode == "ray":
        raise ConfigError("runtime.batched_clients: has no effect with runtime.mode=ray (each actor trains its "
                          "clients one at a time); set runtime.mode=local or remove it")
    if rt.batched_clients and t.balanced_loss == "meta_bsm":
        raise ConfigError("runtime.batched_clients: the batched local update does not support "
                          "train.balanced_loss=meta_bsm; set runtime.batched_clients=0")
    if t.step == "compiled" and t.balanced_loss == "meta_bsm":
        raise ConfigError("train.step: compiled has no effect with train.balanced_loss=meta_bsm (its meta step "
                          "runs eagerly); remove it")
    if t.step == "compiled" and rt.batched_clients:
        raise ConfigError("train.step: compiled has no effect with runtime.batched_clients (the batched update "
                          "has a step of its own); remove one of them")


def check_resume(saved: ExperimentConfig, new: ExperimentConfig, rounds_done: int) -> None:
    """Refuse a resumed config that changes what the checkpoint was trained with, naming the field."""
    before, after = _flatten(saved.to_dict()), _flatten(new.to_dict())
    for key in sorted(before.keys() | after.keys()):
        if key.startswith(RESUMABLE) or before.get(key) == after.get(key):
            continue
        raise ConfigError(f"{key}: the checkpoint was trained with {before.get(key)!r}, not {after.get(key)!r}; "
                          "a resumed run may change only " + ", ".join(RESUMABLE))
    if new.train.rounds < rounds_done:
        raise ConfigError(f"train.rounds: the checkpoint has already completed {rounds_done} rounds, "
                          f"more than {new.train.rounds}")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("client_resources", "rule_params"):
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
    return validate(build_dataclass(ExperimentConfig, data))


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
