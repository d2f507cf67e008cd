"""Typed experiment configuration, loaded from YAML with ``--set key=value`` overrides.

Every section is a pydantic dataclass with strict types and its ranges as field constraints; unknown
keys, values of the wrong type or range, and settings that would change nothing fail with a
``ConfigError`` that names the dotted field (``train.lr``), so a typo in a sweep never silently runs
the default. ``config_schema()`` is the same description as a JSON Schema, for editors.

This is the bottom layer and imports no torch: the registries (datasets, feature extractors, balanced
losses, generic rules) are built from, or checked against, the names listed here, so that loading a
config needs none of them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import typing
from collections.abc import Iterable
from dataclasses import field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BeforeValidator, ConfigDict, Field, StrictBool, StrictStr, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid; the message names the field."""


# --- value types: strict (no "3" for 3, no true for 1), converting only where nothing is lost --------------


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _number(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    # YAML 1.1 reads "1e-3" (no dot) as a string, and Python prints small floats that way.
    if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        return float(value)
    return value


# The bounds come before the conversion so that they check the converted value and reach the JSON Schema.
Int = Annotated[int, Field(strict=True), BeforeValidator(_integral)]
PositiveInt = Annotated[int, Field(strict=True, gt=0), BeforeValidator(_integral)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0), BeforeValidator(_integral)]
PositiveFloat = Annotated[float, Field(strict=True, gt=0), BeforeValidator(_number)]
NonNegativeFloat = Annotated[float, Field(strict=True, ge=0), BeforeValidator(_number)]
Fraction = Annotated[float, Field(strict=True, gt=0, le=1), BeforeValidator(_number)]


@dataclasses.dataclass(frozen=True)
class OneOf:
    """A string field's choices: checked when a config is loaded (constructing a section directly does not),
    and listed in the JSON Schema. With ``plugins`` (an entry-point group) the names installed packages
    register there are valid too, and the schema lists the built-in names as examples only."""

    names: tuple[str, ...]
    plugins: str | None = None

    def choices(self) -> tuple[str, ...]:
        return self.names + (plugin_names(self.plugins) if self.plugins else ())

    def __get_pydantic_json_schema__(self, core_schema, handler):
        key = "examples" if self.plugins else "enum"
        return {**handler(core_schema), key: list(self.names)}


def plugin_names(group: str) -> tuple[str, ...]:
    """The names installed packages register under entry-point ``group``, sorted."""
    return tuple(sorted({ep.name for ep in entry_points(group=group)}))


def is_import_path(value: str) -> bool:
    """``package.module:factory``: a model factory named by where it lives."""
    return _IMPORT_PATH.fullmatch(value) is not None


_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _section(value: Any) -> Any:
    return {} if value is None else value  # an empty YAML section ("eval:") is all defaults


_CLOSED = ConfigDict(extra="forbid")  # an unknown key is an error


# --- names: what the registries hold, so that checking a config needs none of them -------------------------

DATASETS = ("mnist", "fmnist", "emnist", "cifar10", "cifar100", "synthetic")  # fedrod_ray.data
# The user's own images, under data.path (fedrod_ray.data.folder, fedrod_ray.data.arrays).
USER_DATASETS = ("folder", "arrays")
ARCHS = ("mnist_cnn", "cifar_cnn", "resnet20")  # fedrod_ray.models.BUILDERS
# Entry-point groups through which installed packages add datasets and feature extractors (fedrod_ray.plugins).
DATASET_PLUGINS = "fedrod_ray.datasets"
MODEL_PLUGINS = "fedrod_ray.models"
LOSS_NAMES = ("ce", "bsm", "reweight", "ldam", "cdt")  # fedrod_ray.losses.BALANCED_LOSSES; meta_bsm is apart
# model.init: "normal" is the paper's ("weights initialised from normal distributions"; it names no scale,
# so He's, N(0, 2 / fan_in), which keeps a ReLU network's activations at one scale); "pytorch" is PyTorch's
# default (Kaiming-uniform, a = sqrt(5)), what versions before 0.3 used.
INITS = ("normal", "pytorch")
STEPS = ("eager", "compiled")  # train.step (fedrod_ray.step)
# train.momentum_buffers: what a client's SGD momentum buffers do between the rounds it trains in, which the
# paper does not say. "reset": a new optimiser per local update, buffers from zero (the usual FedAvg reading,
# and every version before this switch); "keep": the client keeps the buffers of the parameters it trains, and
# its next local update continues them (only the weights come from the server).
MOMENTUM_BUFFERS = ("reset", "keep")
PARTITIONS = ("dirichlet", "iid", "natural")  # natural: the clients the data itself names
MODES = ("auto", "local", "ray")
# privacy.sampling: how a private run picks a round's clients, as its accountant assumes (docs/privacy.md).
# poisson: each client joins with probability train.client_fraction, independently; fixed: exactly
# round(client_fraction * clients) of them, drawn without replacement.
SAMPLINGS = ("poisson", "fixed")
ACCOUNTANTS = ("rdp", "pld")  # privacy.accountant: Renyi DP, or privacy loss distributions (Poisson only)


def check_registry(registry: Iterable[str], names: tuple[str, ...], key: str) -> None:
    """A registry must hold exactly the names the config accepts for ``key``: neither may list one the other
    lacks."""
    if set(registry) != set(names):
        raise ImportError(f"{key}: the registry holds {sorted(registry)} but the config accepts {sorted(names)}")


# --- generic rules: each one's name and hyperparameters (train.rule_params) --------------------------------


@dataclass(config=_CLOSED)
class NoParams:
    """A rule without hyperparameters."""


@dataclass(config=_CLOSED)
class FedProxParams:
    mu: NonNegativeFloat = 0.01  # the proximal term's weight


@dataclass(config=_CLOSED)
class FedDynParams:
    alpha: PositiveFloat = 0.01  # the server step divides by alpha


# fedrod_ray.algorithms registers one rule under each name, with this Params.
RULE_PARAMS: dict[str, type] = {"fedavg": NoParams, "fedprox": FedProxParams, "feddyn": FedDynParams,
                                "scaffold": NoParams, "local": NoParams}


# --- personalization methods: each one's name, hyperparameters (train.head_params) and constraints ---------


@dataclass(config=_CLOSED)
class DittoParams:
    lam: NonNegativeFloat = 0.1  # lambda: the personal model's pull towards the global one


@dataclass(config=_CLOSED)
class PFedMeParams:
    lam: PositiveFloat = 15.0  # lambda: the Moreau envelope's pull of theta~ towards w_m
    personal_lr: PositiveFloat = 0.01  # eta_p: the step of the inner problem's SGD
    inner_steps: PositiveInt = 5  # K: SGD steps on the inner problem per mini-batch


@dataclass(config=_CLOSED)
class PerFedAvgParams:
    beta: PositiveFloat = 0.001  # beta^: the meta step (alpha, the inner step, is the round's lr)


@dataclass(config=_CLOSED)
class FedFomoParams:
    models: PositiveInt = 4  # n: other clients' models a client receives per round
    epsilon: Annotated[float, Field(strict=True, ge=0, le=1), BeforeValidator(_number)] = 0.3
    epsilon_decay: NonNegativeFloat = 0.05  # subtracted from epsilon every round (floor 0)
    val_fraction: Annotated[float, Field(strict=True, gt=0, lt=1), BeforeValidator(_number)] = 0.2


@dataclass(config=_CLOSED)
class MTLParams:
    lam: NonNegativeFloat = 0.1  # lambda: the pull towards the mean of all clients' models


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """What the config must know of a personalization method (``train.head``) without importing it (torch).

    ``erm``: a personalized-FL baseline, trained with cross-entropy on one head (no balanced loss, no generic
    rule); ``plain_steps``: its updates are its own formulas of plain gradient steps (no momentum, no weight
    decay); ``global_model``: it has a global model (else its GM is the mean of the personalized models)."""

    params: type = NoParams
    erm: bool = True
    plain_steps: bool = False
    global_model: bool = True


# fedrod_ray.personalization registers one method under each name, with this spec. The first three are Fed-RoD's
# own: one head (FedAvg and the generic baselines), a linear personalized head, a hypernetwork.
HEADS: dict[str, HeadSpec] = {
    "none": HeadSpec(erm=False), "linear": HeadSpec(erm=False), "hyper": HeadSpec(erm=False),
    "fedper": HeadSpec(global_model=False), "fedrep": HeadSpec(global_model=False),
    "lg_fedavg": HeadSpec(global_model=False), "ditto": HeadSpec(DittoParams),
    "pfedme": HeadSpec(PFedMeParams, plain_steps=True), "perfedavg": HeadSpec(PerFedAvgParams, plain_steps=True),
    "fedfomo": HeadSpec(FedFomoParams, global_model=False), "mtl": HeadSpec(MTLParams, global_model=False),
}


# --- the experiment ---------------------------------------------------------------------------------------


@dataclass(config=_CLOSED)
class DataConfig:
    # A built-in set, the user's own (folder, arrays: under data.path) or one a package registers.
    dataset: Annotated[StrictStr, OneOf(DATASETS + USER_DATASETS, DATASET_PLUGINS)] = "mnist"
    data_dir: StrictStr | None = None  # else $FEDROD_DATA_DIR, else the user cache dir
    # folder: a directory of train/<class>/*.png|jpg, test/<class>/... (natural: clients/<id>/<class>/..., and
    # optionally clients/<id>/test/<class>/... instead of test/); arrays: an .npz of x_train, y_train, x_test,
    # y_test (optional class_names, client_train, client_test)
    path: StrictStr | None = None
    download: StrictBool = True
    num_clients: PositiveInt = 100  # training clients
    new_clients: NonNegativeInt = 0  # extra held-out clients that never train (zero-shot evaluation)
    partition: Annotated[StrictStr, OneOf(PARTITIONS)] = "dirichlet"
    alpha: PositiveFloat = 0.1
    # The paper's split gives each client what its Dirichlet draws give it; > 0 tops small clients up to
    # this many examples (earlier versions: 10), which changes Dir(0.1) splits and never Dir(0.3) FMNIST's.
    min_per_client: NonNegativeInt = 0
    # Inputs as (x / 255 - mean) / std with the dataset's per-channel statistics (false: x / 255). The paper
    # says "inputs normalised" for CIFAR and nothing for (F)MNIST.
    normalize: StrictBool = True
    imbalance_ratio: PositiveFloat = 1.0  # >1: exponentially long-tailed global data before partitioning
    synthetic_train_per_class: PositiveInt = 600
    synthetic_test_per_class: PositiveInt = 100


@dataclass(config=_CLOSED)
class ModelConfig:
    # auto: from the dataset; a built-in, a registered plug-in's name, or package.module:factory, a callable
    # that takes the input shape (C, H, W) and returns an nn.Module mapping N x C x H x W to N x d features
    arch: Annotated[StrictStr, OneOf(("auto",) + ARCHS, MODEL_PLUGINS)] = "auto"
    hyper_hidden: PositiveInt | None = None  # train.head=hyper only; None: the paper's (32 for CIFAR-10, else 16)
    init: Annotated[StrictStr, OneOf(INITS)] = "normal"  # initial weights (see INITS)


@dataclass(config=_CLOSED)
class MetaBSMConfig:
    """Fed-RoD (Meta-BSM), ``train.balanced_loss: meta_bsm`` only (fedrod_ray.objectives.meta_bsm)."""

    meta_lr: PositiveFloat = 0.001  # SGD step size of the Meta-Weight-Net on the meta loss, per batch
    gamma_lr: PositiveFloat = 0.1  # SGD step size of gamma_m on the meta loss, per batch
    meta_per_class: PositiveInt = 10  # the server's balanced meta set: examples per class taken out of training
    hidden: PositiveInt = 100  # Meta-Weight-Net width: loss -> hidden -> weight (Shu et al., 2019)


@dataclass(config=_CLOSED)
class TrainConfig:
    # The personalization method: Fed-RoD's none (one-head model) | linear (phi_m) | hyper (H(a_m; nu)), or a
    # personalized-FL baseline (fedper, fedrep, lg_fedavg, ditto, pfedme, perfedavg, fedfomo, mtl)
    head: Annotated[StrictStr, OneOf(tuple(HEADS))] = "linear"
    head_params: dict[StrictStr, Any] = field(default_factory=dict)  # the method's hyperparameters, e.g. {lam: 0.1}
    balanced_loss: Annotated[StrictStr, OneOf(LOSS_NAMES + ("meta_bsm",))] = "bsm"  # the generic head's loss
    gamma: NonNegativeFloat | None = None  # bsm, ldam, cdt, meta_bsm (gamma_m's initial value) only; None: 1.0
    meta_bsm: Annotated[MetaBSMConfig, BeforeValidator(_section)] = field(default_factory=MetaBSMConfig)
    generic_rule: Annotated[StrictStr, OneOf(tuple(RULE_PARAMS))] = "fedavg"
    rule_params: dict[StrictStr, Any] = field(default_factory=dict)  # the rule's hyperparameters, e.g. {mu: 0.01}
    rounds: PositiveInt = 100
    client_fraction: Fraction = 0.2
    local_epochs: PositiveInt = 5
    batch_size: PositiveInt = 40
    lr: PositiveFloat = 0.01
    lr_decay: PositiveFloat = 0.99  # multiplied into lr once per round
    momentum: NonNegativeFloat = 0.9
    momentum_buffers: Annotated[StrictStr, OneOf(MOMENTUM_BUFFERS)] = "reset"  # see MOMENTUM_BUFFERS
    weight_decay: NonNegativeFloat = 1e-5
    augment: StrictBool | None = None  # None: the dataset's default (on for CIFAR)
    # How a mini-batch's losses run (fedrod_ray.step): compiled is torch.compile, slower on CPU
    step: Annotated[StrictStr, OneOf(STEPS)] = "eager"


@dataclass(config=_CLOSED)
class EvalConfig:
    eval_every: PositiveInt = 1
    batch_size: PositiveInt = 1000
    # Between exact evaluations: every round, the P-FL estimate (the *_est metrics) of the GM and of each
    # client's PM on a fixed, seeded, class-stratified sample of this many test images; 0: none.
    estimate_size: NonNegativeInt = 0
    # At the last round's evaluation: k epochs of fine-tuning on each held-out new client's own data, starting
    # from the global model (hyper: with its zero-shot head), then its P-FL (pfl_new_after); 0: none.
    finetune_epochs: NonNegativeInt = 0
    finetune_train: StrictBool = False  # fine-tune every training client that way too (pfl_ft: the FT baseline)
    # P-FL over a sample of this many training clients, fixed by the seed, with 95% intervals (pfl_*_ci), for
    # federations too large to evaluate every client's PM; 0: every client (exact)
    clients: NonNegativeInt = 0
    # false: no evaluation after the last round unless eval_every falls on it (a sweep trial, a benchmark)
    at_end: StrictBool = True


@dataclass(config=_CLOSED)
class RuntimeConfig:
    # auto: ray where Ray is (inside a Ray job, with RAY_ADDRESS set, or with an address), else local
    mode: Annotated[StrictStr, OneOf(MODES)] = "auto"  # local: in-process
    address: StrictStr | None = None  # ray only: None starts a private local Ray, "auto" joins a running cluster
    torch_threads: NonNegativeInt = 0  # 0: all cores of this process (in-process) / the actor's CPUs (Ray)
    device: StrictStr = "cpu"  # in-process only; Ray actors use a GPU when their resources hold one
    # in-process only: 0 trains a round's clients one after another; k > 0 trains up to k of them at once in
    # one batched computation (fedrod_ray.batched; for a GPU: on CPU it is slower)
    batched_clients: NonNegativeInt = 0
    clients_per_actor: NonNegativeInt = 0  # 0: sized from the cluster's resources
    client_resources: dict[StrictStr, NonNegativeFloat] = field(default_factory=lambda: {"num_cpus": 1.0})
    max_restarts: NonNegativeInt = 3
    min_clients_per_round: PositiveInt = 1
    max_failed_fraction: Annotated[float, Field(strict=True, ge=0, le=1), BeforeValidator(_number)] = 0.5
    checkpoint_every: PositiveInt = 1
    progress_seconds: NonNegativeFloat = 30.0  # not on a terminal: a progress line inside a round at most this often


@dataclass(config=_CLOSED)
class AdaptiveClipConfig:
    """Adaptive clipping (Andrew et al., 2021), ``privacy.adaptive_clip``: after every round the clip norm C
    moves geometrically towards the ``target_quantile`` of the clients' update norms, read from a noised count
    of the updates it did not clip: C <- C exp(-learning_rate (b~ - target_quantile))."""

    target_quantile: Annotated[float, Field(strict=True, gt=0, lt=1), BeforeValidator(_number)] = 0.5
    learning_rate: PositiveFloat = 0.2  # eta_C, the paper's geometric step
    # sigma_b, the standard deviation of the count's noise; None: the paper's, expected clients per round / 20
    count_noise: PositiveFloat | None = None


@dataclass(config=_CLOSED)
class PrivacyConfig:
    """Client-level differential privacy, central model (DP-FedAvg, McMahan et al., 2018; docs/privacy.md):
    each update to the shared weights clipped on its client, Gaussian noise on their sum on the server."""

    enabled: StrictBool = False
    noise_multiplier: NonNegativeFloat | None = None  # sigma: noise std over the clip norm; None: from target_epsilon
    # The budget at privacy.delta. Without noise_multiplier, sigma is derived from it, the sampling rate and
    # train.rounds before the run starts; with one, the run stops before the round that would exceed it.
    target_epsilon: PositiveFloat | None = None
    delta: Annotated[float, Field(strict=True, gt=0, lt=1), BeforeValidator(_number)] = 1e-5
    clip_norm: PositiveFloat = 1.0  # S: the L2 norm each client's update is clipped to (adaptive: the first)
    sampling: Annotated[StrictStr, OneOf(SAMPLINGS)] = "poisson"  # see SAMPLINGS
    adaptive_clip: AdaptiveClipConfig | None = None  # None: the clip norm stays S
    secure_rng: StrictBool = False  # noise from the OS's CSPRNG instead of the run's seed (not reproducible)
    accountant: Annotated[StrictStr, OneOf(ACCOUNTANTS)] = "rdp"


# Experiment trackers a run can log to (fedrod_ray.tracking; `pip install -e ".[tracking]"`).
LOGGERS = ("tensorboard", "mlflow")


@dataclass(config=_CLOSED)
class TrackingConfig:
    # Each round's metrics, the config as hyperparameters, the final metrics (MLflow: and final/ as an
    # artifact): tensorboard into <run_dir>/tensorboard, mlflow into mlflow_uri. Empty: no tracking.
    loggers: list[StrictStr] = field(default_factory=list)
    mlflow_uri: StrictStr | None = None  # an MLflow tracking URI; None: a local store, <run_dir>/mlruns


@dataclass(config=_CLOSED)
class ExperimentConfig:
    """A fedrod-ray experiment: ``fedrod-ray train --config FILE``. Every key may be left out (its default)."""

    name: StrictStr = "fedrod"
    seed: Int = 0
    run_dir: StrictStr | None = None  # default runs/<name>
    data: Annotated[DataConfig, BeforeValidator(_section)] = field(default_factory=DataConfig)
    model: Annotated[ModelConfig, BeforeValidator(_section)] = field(default_factory=ModelConfig)
    train: Annotated[TrainConfig, BeforeValidator(_section)] = field(default_factory=TrainConfig)
    eval: Annotated[EvalConfig, BeforeValidator(_section)] = field(default_factory=EvalConfig)
    runtime: Annotated[RuntimeConfig, BeforeValidator(_section)] = field(default_factory=RuntimeConfig)
    tracking: Annotated[TrackingConfig, BeforeValidator(_section)] = field(default_factory=TrackingConfig)
    privacy: Annotated[PrivacyConfig, BeforeValidator(_section)] = field(default_factory=PrivacyConfig)

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
# Keys of earlier versions, with what replaced them.
_RENAMED = {
    "train.algorithm": "train.head (fedrod -> linear or hyper; fedavg -> none, with train.balanced_loss=ce "
                       "for plain FedAvg)",
    "train.variant": "train.head (linear | hyper)",
    "train.prox_mu": "train.rule_params.mu (with train.generic_rule=fedprox)",
    "train.feddyn_alpha": "train.rule_params.alpha (with train.generic_rule=feddyn)",
}
# What --resume may change: how and how long to run, never what is learned.
RESUMABLE = ("name", "run_dir", "data.data_dir", "data.path", "data.download", "train.rounds", "eval.",
             "runtime.", "tracking.")


# --- checking ----------------------------------------------------------------------------------------------

_EXPECTED = {"int_type": "expected an integer", "float_type": "expected a number", "bool_type": "expected true/false",
             "string_type": "expected a string", "dict_type": "expected a mapping",
             "dataclass_type": "expected a mapping"}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _build(cls: type, data: Any, prefix: str = "") -> Any:
    """``cls`` (a config dataclass) from a plain mapping, every key, type and range checked; errors name the
    dotted field (``prefix`` + name)."""
    try:
        return TypeAdapter(cls).validate_python(data)
    except ValidationError as e:
        raise ConfigError(_message(cls, e.errors(), prefix)) from None


def check_keys_and_types(data: dict[str, Any]) -> None:
    """Refuse an unknown key or a value of the wrong type in an experiment config mapping, naming the field;
    ranges, choices and the settings' effects are left to ``config_from_dict``."""
    try:
        TypeAdapter(ExperimentConfig).validate_python(data)
    except ValidationError as e:
        errors = [error for error in e.errors() if error["type"] not in _BOUNDS]
        if errors:
            raise ConfigError(_message(ExperimentConfig, errors, "")) from None


def _message(cls: type, errors: list[Any], prefix: str) -> str:
    """The first unknown key (a typo explains whatever follows it), else the first error."""
    unknown = [e for e in errors if e["type"] in ("unexpected_keyword_argument", "extra_forbidden")]
    e = min(unknown, key=lambda e: [str(part) for part in e["loc"]]) if unknown else errors[0]
    loc = [str(part) for part in e["loc"] if part != "[key]"]
    if unknown:
        section = prefix + "".join(f"{part}." for part in loc[:-1])
        path = section + loc[-1]
        if path in _RENAMED:
            return f"{path} was replaced by {_RENAMED[path]}"
        fields = _section_fields(cls, loc[:-1])
        return (f"unknown config key {path}{_did_you_mean(loc[-1], fields, section)}; "
                f"valid keys here: {', '.join(sorted(fields)) or 'none'}")
    path = prefix + ".".join(loc) if loc else prefix.rstrip(".") or "config"
    if e["type"] in _EXPECTED:
        return f"{path}: {_EXPECTED[e['type']]}, got {e['input']!r}"
    if e["type"] in _BOUNDS:
        (bound,) = e["ctx"].values()
        return f"{path}: must be {_BOUNDS[e['type']]} {bound:g}, got {e['input']!r}"
    return f"{path}: {e['msg']}, got {e['input']!r}"


def _section_fields(cls: type, loc: list[str]) -> list[str]:
    for name in loc:
        cls = typing.get_type_hints(cls)[name]
        # An optional section (privacy.adaptive_clip): the section's own class.
        cls = next((a for a in typing.get_args(cls) if dataclasses.is_dataclass(a)), cls)
    return [f.name for f in dataclasses.fields(cls)]


def _did_you_mean(given: str, options, prefix: str = "") -> str:
    close = difflib.get_close_matches(given, sorted(options), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _not_one_of(path: str, value: Any, names: Iterable[str]) -> ConfigError:
    return ConfigError(f"{path}: {value!r} is not one of {sorted(names)}{_did_you_mean(str(value), names)}")


def build_rule_params(rule: str, params: dict[str, Any] | None) -> Any:
    """The ``Params`` of generic rule ``rule`` from ``train.rule_params``; a ConfigError names the field."""
    if rule not in RULE_PARAMS:
        raise _not_one_of("train.generic_rule", rule, RULE_PARAMS)
    try:
        return _build(RULE_PARAMS[rule], params or {}, "train.rule_params.")
    except ConfigError as e:
        raise ConfigError(f"{e} (train.generic_rule={rule})") from None


def build_head_params(head: str, params: dict[str, Any] | None) -> Any:
    """The ``Params`` of personalization method ``head`` from ``train.head_params``; a ConfigError names the
    field."""
    if head not in HEADS:
        raise _not_one_of("train.head", head, HEADS)
    try:
        return _build(HEADS[head].params, params or {}, "train.head_params.")
    except ConfigError as e:
        raise ConfigError(f"{e} (train.head={head})") from None


def _check_choices(section: Any, prefix: str = "") -> None:
    for name, info in type(section).__pydantic_fields__.items():
        value = getattr(section, name)
        if dataclasses.is_dataclass(value):
            _check_choices(value, f"{prefix}{name}.")
        for choices in (m for m in info.metadata if isinstance(m, OneOf)):
            if choices.plugins == MODEL_PLUGINS and is_import_path(value):
                continue  # imported and built when the input shape is known (fedrod_ray.models)
            if value not in choices.choices():
                raise _not_one_of(prefix + name, value, choices.choices())


def _validate(cfg: ExperimentConfig) -> ExperimentConfig:
    _check_choices(cfg)
    for logger in cfg.tracking.loggers:
        if logger not in LOGGERS:
            raise _not_one_of("tracking.loggers", logger, LOGGERS)
    if len(set(cfg.tracking.loggers)) != len(cfg.tracking.loggers):
        raise ConfigError(f"tracking.loggers: each logger once, got {cfg.tracking.loggers}")
    if cfg.runtime.mode == "auto":
        # A Ray job's driver always has RAY_ADDRESS (the job supervisor sets it): there the federation
        # belongs on the cluster, not in the driver process. Resolved here, so config.yaml records it.
        # An http(s) RAY_ADDRESS is a dashboard, set for the `ray job` CLI: no cluster to train on from here.
        env = os.environ.get("RAY_ADDRESS", "")
        on_ray = cfg.runtime.address is not None or bool(env and not env.startswith(("http://", "https://")))
        cfg.runtime.mode = "ray" if on_ray else "local"
    _check_effective(cfg)
    # Stored as the rule and the method resolved them: typed, with defaults, so config.yaml records what ran.
    cfg.train.rule_params = dataclasses.asdict(build_rule_params(cfg.train.generic_rule, cfg.train.rule_params))
    cfg.train.head_params = dataclasses.asdict(build_head_params(cfg.train.head, cfg.train.head_params))
    return cfg


def _no_effect(key: str, why: str, instead: str = "", value: str = "") -> ConfigError:
    """The error for ``key`` (at ``value``) having no effect ``why``: it says how to take the setting out, from
    the file or from the command line over a base config (``--set key=null`` restores the default)."""
    return ConfigError(f"{key}: {value + ' ' if value else ''}has no effect {why}; remove it, or --set {key}=null"
                       + (f", or {instead}" if instead else ""))


def _check_effective(cfg: ExperimentConfig) -> None:
    """A setting that would change nothing is an error: the user meant something else."""
    if cfg.tracking.mlflow_uri is not None and "mlflow" not in cfg.tracking.loggers:
        raise _no_effect("tracking.mlflow_uri", "without mlflow in tracking.loggers", "add --logger mlflow")
    t = cfg.train
    if t.gamma is not None and t.balanced_loss not in GAMMA_LOSSES:
        raise _no_effect("train.gamma", f"with train.balanced_loss={t.balanced_loss} "
                                        f"(gamma is used by {', '.join(sorted(GAMMA_LOSSES))})")
    for key, (default, why) in _unused_settings(t.balanced_loss, cfg.data.partition).items():
        if functools.reduce(getattr, key.split("."), cfg) != default:
            raise _no_effect(key, f"with {why}")
    if cfg.model.hyper_hidden is not None and t.head != "hyper":
        raise _no_effect("model.hyper_hidden", f"with train.head={t.head} (only the hyper head has a hypernetwork)")
    _check_data(cfg)
    if cfg.data.min_per_client and cfg.data.partition != "dirichlet":
        raise _no_effect("data.min_per_client", f"with data.partition={cfg.data.partition} (only the Dirichlet "
                                                "split is topped up)")
    ev = cfg.eval
    if ev.finetune_train and ev.finetune_epochs == 0:
        raise _no_effect("eval.finetune_train", "with eval.finetune_epochs=0", "set eval.finetune_epochs")
    if ev.estimate_size and (ev.eval_every == 1 or t.rounds == 1):
        raise _no_effect("eval.estimate_size", f"when every round is evaluated exactly (eval.eval_every="
                                               f"{ev.eval_every}, train.rounds={t.rounds})", "raise eval.eval_every")
    if ev.clients and ev.clients >= cfg.data.num_clients:
        raise ConfigError(f"eval.clients: {ev.clients} is not a sample of the {cfg.data.num_clients} training "
                          "clients (data.num_clients); remove it, or --set eval.clients=null, to evaluate every "
                          "client")
    if not ev.at_end and ev.finetune_epochs and t.rounds % ev.eval_every:
        raise ConfigError("eval.finetune_epochs: fine-tuning happens at the last round's evaluation, which "
                          f"eval.at_end=false skips (train.rounds={t.rounds} is not a multiple of "
                          f"eval.eval_every={ev.eval_every}); remove one of them")
    if ev.finetune_epochs > 0 and not ev.finetune_train and cfg.data.new_clients == 0:
        raise _no_effect("eval.finetune_epochs", "without held-out clients (data.new_clients) or "
                                                 "eval.finetune_train=true")
    if t.momentum_buffers == "keep" and t.momentum == 0:
        raise _no_effect("train.momentum_buffers", "with train.momentum=0 (plain SGD has no momentum buffers to "
                                                   "keep)", "set train.momentum", value="keep")
    if t.momentum_buffers == "keep" and t.generic_rule == "scaffold":
        # Option II reads c_m from how far the K steps moved w, per unit of gradient, from buffers at zero
        # (local.effective_step_sum): a kept buffer moves w along earlier rounds' gradients as well, which
        # c_m would take for this round's.
        raise ConfigError("train.momentum_buffers: keep cannot be used with train.generic_rule=scaffold, whose "
                          "control variate assumes each local update's momentum starts at zero; use reset")
    _check_head(cfg)
    _check_privacy(cfg)
    if t.generic_rule == "local" and t.head == "hyper":
        raise ConfigError("train.generic_rule: local (local-only training) cannot use train.head=hyper, whose "
                          "hypernetwork the server averages; use train.head=none or linear")
    rt = cfg.runtime
    if rt.mode == "local" and rt.address is not None:
        raise _no_effect("runtime.address", "with runtime.mode=local", "set runtime.mode=ray")
    if rt.mode == "ray" and rt.device != "cpu":
        raise _no_effect("runtime.device", "with runtime.mode=ray (actors use a GPU when "
                                           "runtime.client_resources asks for num_gpus)")
    if rt.batched_clients and rt.mode == "ray":
        raise _no_effect("runtime.batched_clients", "with runtime.mode=ray (each actor trains its clients one at a "
                                                    "time)", "set runtime.mode=local")
    if rt.batched_clients and cfg.model.arch == "resnet20":
        raise ConfigError("runtime.batched_clients: the batched local update needs a model without buffers, and "
                          "model.arch=resnet20 has batch-norm statistics; set runtime.batched_clients=0")
    if rt.batched_clients and t.balanced_loss == "meta_bsm":
        raise ConfigError("runtime.batched_clients: the batched local update does not support "
                          "train.balanced_loss=meta_bsm; set runtime.batched_clients=0")
    if t.step == "compiled" and t.balanced_loss == "meta_bsm":
        raise _no_effect("train.step", "with train.balanced_loss=meta_bsm (its meta step runs eagerly)",
                         value="compiled")
    if t.step == "compiled" and rt.batched_clients:
        raise _no_effect("train.step", "with runtime.batched_clients (the batched update has a step of its own)",
                         "--set runtime.batched_clients=null", value="compiled")


def _check_head(cfg: ExperimentConfig) -> None:
    """What a personalization method rules out (``HeadSpec``)."""
    t, spec = cfg.train, HEADS[cfg.train.head]
    why = f"train.head={t.head}"
    if spec.erm:
        if t.balanced_loss != "ce":
            raise ConfigError(f"train.balanced_loss: {why} is a personalized-FL baseline trained with cross-entropy "
                              "(ERM), which has no balanced loss; set train.balanced_loss=ce")
        if t.generic_rule != "fedavg":
            raise ConfigError(f"train.generic_rule: {why} has its own local update and server step, which a "
                              f"generic rule ({t.generic_rule}) would not act on; set train.generic_rule=fedavg")
        for key, value, what in (("train.momentum_buffers", t.momentum_buffers != "reset", "keep"),
                                 ("train.step", t.step != "eager", t.step),
                                 ("runtime.batched_clients", cfg.runtime.batched_clients != 0,
                                  cfg.runtime.batched_clients)):
            if value:
                raise ConfigError(f"{key}: {what} is not supported with {why} (only Fed-RoD's heads none, linear "
                                  "and hyper support it); remove it")
    if spec.plain_steps:
        for key, value in (("train.momentum", t.momentum), ("train.weight_decay", t.weight_decay)):
            if value != 0:
                # Not "remove it": the default (momentum 0.9, weight decay 1e-5) is not 0 either.
                raise ConfigError(f"{key}: has no effect with {why}, whose updates are its own plain gradient "
                                  f"steps; set {key}=0")
    if not spec.global_model and cfg.eval.finetune_epochs:
        raise ConfigError(f"eval.finetune_epochs: {why} has no global model to fine-tune from; set it to 0")


def _check_privacy(cfg: ExperimentConfig) -> None:
    """What client-level DP needs of its settings and rules out (docs/privacy.md)."""
    p, t = cfg.privacy, cfg.train
    if not p.enabled:
        for f in dataclasses.fields(PrivacyConfig):
            if getattr(p, f.name) != getattr(PrivacyConfig(), f.name):
                raise ConfigError(f"privacy.{f.name}: has no effect without privacy.enabled=true")
        return
    for key in ("noise_multiplier", "target_epsilon"):
        if getattr(p, key) is not None and math.isinf(getattr(p, key)):
            raise ConfigError(f"privacy.{key}: must be finite, got {getattr(p, key)}")
    if p.noise_multiplier is None and p.target_epsilon is None:
        raise ConfigError("privacy.noise_multiplier: client-level DP needs its noise: set it (sigma) or "
                          "privacy.target_epsilon (sigma is then derived from it)")
    if math.isinf(p.clip_norm) and (p.noise_multiplier != 0 or p.adaptive_clip is not None):
        raise ConfigError("privacy.clip_norm: an infinite clip norm bounds nothing, and its noise would be infinite; "
                          "it is only for privacy.noise_multiplier=0 (no noise, no guarantee) without adaptive_clip")
    if p.accountant == "pld" and p.sampling != "poisson":
        raise ConfigError("privacy.accountant: pld (dp_accounting's) accounts for Poisson sampling only; use rdp "
                          "with privacy.sampling=fixed")
    why = {
        "local": "local-only training sends nothing to the server, so there is nothing to protect",
        "scaffold": "its clients upload control-variate increments besides their update, which the clip does not "
                    "bound, and a client's c_m would drift from a noised server c",
    }.get(t.generic_rule)
    if why:
        raise ConfigError(f"train.generic_rule: {t.generic_rule} cannot be used with privacy.enabled: {why}; "
                          "use fedavg, fedprox or feddyn")
    if not HEADS[t.head].global_model:
        reads = (" and its server reads every client's own upload" if t.head in ("fedfomo", "mtl") else "")
        raise ConfigError(f"train.head: {t.head} cannot be used with privacy.enabled: it has no global model, so "
                          f"its generic model (G-FL, final/) is the mean of the clients' own models{reads}, which "
                          "never pass through the clipped, noised aggregate; use none, linear, hyper, ditto, pfedme "
                          "or perfedavg")


def _check_data(cfg: ExperimentConfig) -> None:
    d = cfg.data
    if d.dataset in USER_DATASETS and d.path is None:
        raise ConfigError(f"data.path: data.dataset={d.dataset} reads the data from data.path; set it")
    if d.path is not None and d.dataset in DATASETS:
        raise _no_effect("data.path", f"with data.dataset={d.dataset} (a built-in set, found under data.data_dir)")
    if d.partition == "natural" and cfg.train.balanced_loss == "meta_bsm":
        raise ConfigError("train.balanced_loss: meta_bsm takes its meta set out of the clients' examples, "
                          "which data.partition=natural keeps whole; use another loss or partition")


def check_resume(saved: ExperimentConfig, new: ExperimentConfig, rounds_done: int) -> None:
    """Refuse a resumed config that changes what the checkpoint was trained with, naming the field."""
    before, after = _flatten(saved.to_dict()), _flatten(new.to_dict())
    for key in sorted(before.keys() | after.keys()):
        if key.startswith(RESUMABLE) or before.get(key) == after.get(key):
            continue
        raise ConfigError(f"{key}: the checkpoint was trained with {before.get(key)!r}, not {after.get(key)!r}; "
                          "a resumed run may change only " + ", ".join(RESUMABLE))
    if saved.privacy.enabled and saved.privacy.noise_multiplier is None and new.train.rounds != saved.train.rounds:
        raise ConfigError(f"train.rounds: the run's noise multiplier was derived from privacy.target_epsilon over "
                          f"{saved.train.rounds} rounds; a resumed run cannot change them")
    if new.train.rounds < rounds_done:
        raise ConfigError(f"train.rounds: the checkpoint has already completed {rounds_done} rounds, "
                          f"more than {new.train.rounds}")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("client_resources", "rule_params", "head_params"):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def apply_override(data: dict[str, Any], assignment: str) -> Any:
    """Apply one ``a.b.c=value`` override (value parsed as YAML) to a nested dict in place and return the value.
    A null value (``a.b.c=null``, or nothing after ``=``) removes the key, so that it takes its default: a
    setting of a base config can be taken out from the command line."""
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
    if value is None:
        node.pop(parts[-1], None)
    else:
        node[parts[-1]] = value
    return value


def config_from_dict(data: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    data = _deep_copy(data or {})
    for assignment in overrides:
        if apply_override(data, assignment) is None:
            _check_key(assignment.split("=", 1)[0].strip())
    return _validate(_build(ExperimentConfig, data))


def _check_key(key: str) -> None:
    """Refuse a dotted key that names no setting: a null override takes its key out, so nothing else would
    notice a typo in it. Below a free mapping (``train.rule_params``, ``runtime.client_resources``) any key
    goes, as its value's own check decides."""
    cls, parts = ExperimentConfig, key.split(".")
    for i, part in enumerate(parts):
        fields = [f.name for f in dataclasses.fields(cls)]
        if part not in fields:
            section = "".join(f"{p}." for p in parts[:i])
            raise ConfigError(f"unknown config key {section}{part}{_did_you_mean(part, fields, section)}; "
                              f"valid keys here: {', '.join(sorted(fields))}")
        cls = typing.get_type_hints(cls)[part]
        if not dataclasses.is_dataclass(cls):
            return


def _unused_settings(loss: str, partition: str) -> dict[str, tuple[Any, str]]:
    """The settings that have no effect under this loss and partition: key -> (its default, why not).

    Set by a user, one is an error (``_check_effective``); held by a record, it is dropped on loading
    (``config_from_record``)."""
    unused: dict[str, tuple[Any, str]] = {}
    if loss != "meta_bsm":
        why = f"train.balanced_loss={loss} (only meta_bsm uses it)"
        unused |= {f"train.meta_bsm.{k}": (v, why) for k, v in dataclasses.asdict(MetaBSMConfig()).items()}
    if partition == "natural":
        why = "data.partition=natural (each client keeps exactly its own examples)"
        unused |= {f"data.{k}": (getattr(DataConfig(), k), why) for k in ("alpha", "imbalance_ratio")}
    return unused


def config_from_record(record: dict[str, Any]) -> ExperimentConfig:
    """The config a record holds: a checkpoint's, a reproduction's (reproduce.yaml), written by any version.

    A record keeps every setting, defaults included, as the version that wrote it had them, unused ones too.
    Those never had an effect, so they are dropped whatever their values (a default changed since would
    otherwise read as a user's setting with no effect); everything else is checked as a user's config is."""
    data = _deep_copy(record)
    loss = _get(data, "train.balanced_loss", TrainConfig.balanced_loss)
    for key in _unused_settings(loss, _get(data, "data.partition", DataConfig.partition)):
        section, name = key.rsplit(".", 1)
        node = _get(data, section, None)
        if isinstance(node, dict):
            node.pop(name, None)
    return config_from_dict(data)


def _get(data: Any, key: str, default: Any) -> Any:
    for name in key.split("."):
        if not isinstance(data, dict) or name not in data:
            return default
        data = data[name]
    return data


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


def config_schema() -> dict[str, Any]:
    """The JSON Schema of an experiment config file (``fedrod-ray schema``; fedrod_ray/config.schema.json)."""
    return TypeAdapter(ExperimentConfig).json_schema()


def _deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deep_copy(v) for v in d]
    return d
