"""What a loaded config must satisfy beyond each field's own type and range: its choices, the settings that
would have no effect (an error: the user meant something else), and the combinations a rule, method, loss
or dataset rules out, as its spec (``fedrod_ray.specs``) declares them."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

from ..specs.datasets import DATASETS, SITES, USER_DATASETS
from ..specs.losses import LOSSES
from ..specs.methods import ERM, HEADS
from ..specs.models import BUFFERED_ARCHS, MODEL_PLUGINS
from ..specs.rules import RULES
from .building import build
from .sections import (
    LOGGERS,
    DataConfig,
    ExperimentConfig,
    PrivacyConfig,
    RoundsConfig,
    RuntimeConfig,
    TrainConfig,
)
from .values import ConfigError, OneOf, is_import_path, no_effect, not_one_of


def build_rule_params(rule: str, params: dict[str, Any] | None) -> Any:
    """The ``Params`` of generic rule ``rule`` from ``train.rule_params``; a ConfigError names the field."""
    return _build_params(RULES, "train.generic_rule", rule, "train.rule_params", params)


def build_head_params(head: str, params: dict[str, Any] | None) -> Any:
    """The ``Params`` of personalization method ``head`` from ``train.head_params``; a ConfigError names the
    field."""
    return _build_params(HEADS, "train.head", head, "train.head_params", params)


def _build_params(specs: dict, key: str, name: str, params_key: str, params: dict[str, Any] | None) -> Any:
    """The ``Params`` of plug-in ``name`` (chosen by ``key``) from its settings under ``params_key``."""
    if name not in specs:
        raise not_one_of(key, name, specs)
    try:
        return build(specs[name].params, params or {}, f"{params_key}.")
    except ConfigError as e:
        raise ConfigError(f"{e} ({key}={name})") from None


def validate(cfg: ExperimentConfig) -> ExperimentConfig:
    """Check ``cfg`` as a whole, resolve ``runtime.mode: auto``, and store the rule's and the method's
    parameters typed, with their defaults, so that config.yaml records what ran."""
    _check_choices(cfg)
    for logger in cfg.tracking.loggers:
        if logger not in LOGGERS:
            raise not_one_of("tracking.loggers", logger, LOGGERS)
    if len(set(cfg.tracking.loggers)) != len(cfg.tracking.loggers):
        raise ConfigError(f"tracking.loggers: each logger once, got {cfg.tracking.loggers}")
    if cfg.runtime.mode == "auto":
        # A Ray job's driver always has RAY_ADDRESS (the job supervisor sets it): there the federation
        # belongs on the cluster, not in the driver process. Resolved here, so config.yaml records it.
        # An http(s) RAY_ADDRESS is a dashboard, set for the `ray job` CLI: no cluster to train on from here.
        env = os.environ.get("RAY_ADDRESS", "")
        on_ray = cfg.runtime.address is not None or bool(env and not env.startswith(("http://", "https://")))
        on_ray = on_ray or cfg.data.dataset == SITES  # sites are Ray nodes
        cfg.runtime.mode = "ray" if on_ray else "local"
    _check_effective(cfg)
    cfg.train.rule_params = dataclasses.asdict(build_rule_params(cfg.train.generic_rule, cfg.train.rule_params))
    cfg.train.head_params = dataclasses.asdict(build_head_params(cfg.train.head, cfg.train.head_params))
    return cfg


def _check_choices(section: Any, prefix: str = "") -> None:
    for name, info in type(section).__pydantic_fields__.items():
        value = getattr(section, name)
        if dataclasses.is_dataclass(value):
            _check_choices(value, f"{prefix}{name}.")
        for choices in (m for m in info.metadata if isinstance(m, OneOf)):
            if choices.plugins == MODEL_PLUGINS and is_import_path(value):
                continue  # imported and built when the input shape is known (fedrod_ray.models)
            if value not in choices.choices():
                raise not_one_of(prefix + name, value, choices.choices())


def unused_settings(loss: str, partition: str) -> dict[str, tuple[Any, str]]:
    """The settings that have no effect under this loss and partition: key -> (its default, why not).

    Set by a user, one is an error (``_check_effective``); held by a record, it is dropped on loading
    (``records.config_from_record``)."""
    unused: dict[str, tuple[Any, str]] = {}
    for objective in (name for name, spec in LOSSES.items() if spec.objective and name != loss):
        why = f"train.balanced_loss={loss} (only {objective} uses it)"
        defaults = dataclasses.asdict(getattr(TrainConfig(), objective))
        unused |= {f"train.{objective}.{k}": (v, why) for k, v in defaults.items()}
    if partition == "natural":
        why = "data.partition=natural (each client keeps exactly its own examples)"
        unused |= {f"data.{k}": (getattr(DataConfig(), k), why) for k in ("alpha", "imbalance_ratio")}
    return unused


# size: one flat list of independent checks, each a setting that would have no effect; split, they would only move
def _check_effective(cfg: ExperimentConfig) -> None:
    """A setting that would change nothing is an error: the user meant something else."""
    if cfg.tracking.mlflow_uri is not None and "mlflow" not in cfg.tracking.loggers:
        raise no_effect("tracking.mlflow_uri", "without mlflow in tracking.loggers", "add --logger mlflow")
    t, loss, rule = cfg.train, LOSSES[cfg.train.balanced_loss], RULES[cfg.train.generic_rule]
    if t.gamma is not None and not loss.gamma:
        with_gamma = ", ".join(sorted(n for n, s in LOSSES.items() if s.gamma))
        raise no_effect("train.gamma", f"with train.balanced_loss={t.balanced_loss} (gamma is used by {with_gamma})")
    for key, (default, why) in unused_settings(t.balanced_loss, cfg.data.partition).items():
        if functools.reduce(getattr, key.split("."), cfg) != default:
            raise no_effect(key, f"with {why}")
    if cfg.model.hyper_hidden is not None and not HEADS[t.head].hypernetwork:
        raise no_effect("model.hyper_hidden", f"with train.head={t.head} (only the hyper head has a hypernetwork)")
    _check_data(cfg)
    if cfg.data.min_per_client and cfg.data.partition != "dirichlet":
        raise no_effect("data.min_per_client", f"with data.partition={cfg.data.partition} (only the Dirichlet "
                                               "split is topped up)")
    ev = cfg.eval
    if ev.finetune_train and ev.finetune_epochs == 0:
        raise no_effect("eval.finetune_train", "with eval.finetune_epochs=0", "set eval.finetune_epochs")
    if ev.estimate_size and (ev.eval_every == 1 or t.rounds == 1):
        raise no_effect("eval.estimate_size", f"when every round is evaluated exactly (eval.eval_every="
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
        raise no_effect("eval.finetune_epochs", "without held-out clients (data.new_clients) or "
                                                "eval.finetune_train=true")
    if t.momentum_buffers == "keep" and t.momentum == 0:
        raise no_effect("train.momentum_buffers", "with train.momentum=0 (plain SGD has no momentum buffers to "
                                                  "keep)", "set train.momentum", value="keep")
    if t.momentum_buffers == "keep" and rule.momentum_from_zero:
        raise ConfigError(f"train.momentum_buffers: keep cannot be used with train.generic_rule={t.generic_rule}, "
                          "whose control variate assumes each local update's momentum starts at zero; use reset")
    _check_head(cfg)
    _check_privacy(cfg)
    _check_rounds(cfg)
    _check_sites(cfg)
    if not rule.server_model and HEADS[t.head].hypernetwork:
        raise ConfigError(f"train.generic_rule: {t.generic_rule} (local-only training) cannot use train.head="
                          f"{t.head}, whose hypernetwork the server averages; use train.head=none or linear")
    rt = cfg.runtime
    if rt.mode == "local" and rt.address is not None:
        raise no_effect("runtime.address", "with runtime.mode=local", "set runtime.mode=ray")
    for key in ("coordinator_restarts", "max_restarts"):
        if rt.mode == "local" and getattr(rt, key) != getattr(RuntimeConfig(), key):
            raise no_effect(f"runtime.{key}", "with runtime.mode=local (no Ray actor to restart)", "set runtime.mode=ray")
    if rt.mode == "ray" and rt.device != "cpu":
        raise no_effect("runtime.device", "with runtime.mode=ray (actors use a GPU when "
                                          "runtime.client_resources asks for num_gpus)")
    if rt.client_cache != RuntimeConfig().client_cache and rt.client_cache >= cfg.data.num_clients:
        raise no_effect("runtime.client_cache", f"with data.num_clients={cfg.data.num_clients} (every client's state "
                                                "stays in memory)")
    if rt.batched_clients and rt.mode == "ray":
        raise no_effect("runtime.batched_clients", "with runtime.mode=ray (each actor trains its clients one at a "
                                                   "time)", "set runtime.mode=local")
    if rt.batched_clients and cfg.model.arch in BUFFERED_ARCHS:
        raise ConfigError(f"runtime.batched_clients: the batched local update needs a model without buffers, and "
                          f"model.arch={cfg.model.arch} has batch-norm statistics; set runtime.batched_clients=0")
    if rt.batched_clients and loss.objective:
        raise ConfigError("runtime.batched_clients: the batched local update does not support "
                          f"train.balanced_loss={t.balanced_loss}; set runtime.batched_clients=0")
    if t.step == "compiled" and loss.objective:
        raise no_effect("train.step", f"with train.balanced_loss={t.balanced_loss} (its meta step runs eagerly)",
                        value="compiled")
    if t.step == "compiled" and rt.batched_clients:
        raise no_effect("train.step", "with runtime.batched_clients (the batched update has a step of its own)",
                        "--set runtime.batched_clients=null", value="compiled")


def _check_head(cfg: ExperimentConfig) -> None:
    """What a personalization method rules out (its ``HeadSpec``)."""
    t, spec = cfg.train, HEADS[cfg.train.head]
    why = f"train.head={t.head}"
    if spec.erm:
        why_not = {"train.balanced_loss": "is a personalized-FL baseline trained with cross-entropy (ERM), which has "
                                          "no balanced loss",
                   "train.generic_rule": "has its own local update and server step, which a generic rule would not "
                                         "act on"}
        for key, value in ERM.items():
            if functools.reduce(getattr, key.split("."), cfg) != value:
                raise ConfigError(f"{key}: {why} {why_not[key]}; set {key}={value}")
        own = ", ".join(n for n, s in HEADS.items() if not s.erm)
        for key, value, what in (("train.momentum_buffers", t.momentum_buffers != "reset", "keep"),
                                 ("train.step", t.step != "eager", t.step),
                                 ("runtime.batched_clients", cfg.runtime.batched_clients != 0,
                                  cfg.runtime.batched_clients)):
            if value:
                raise ConfigError(f"{key}: {what} is not supported with {why} (only Fed-RoD's heads {own} support "
                                  "it); remove it")
    if spec.plain_steps:
        for key, value in (("train.momentum", t.momentum), ("train.weight_decay", t.weight_decay)):
            if value != 0:
                # Not "remove it": the default (momentum 0.9, weight decay 1e-5) is not 0 either.
                raise ConfigError(f"{key}: has no effect with {why}, whose updates are its own plain gradient "
                                  f"steps; set {key}=0")
    if not spec.global_model and not spec.generates_model and cfg.eval.finetune_epochs:
        raise ConfigError(f"eval.finetune_epochs: {why} has no global model to fine-tune from; set it to 0")
    if spec.generates_model and cfg.eval.finetune_train:
        raise ConfigError(f"eval.finetune_train: {why} adapts only new clients (a training client's PM is made by "
                          "the server's hypernetwork); remove it")
    if spec.generates_model and cfg.model.arch in BUFFERED_ARCHS:
        raise ConfigError(f"model.arch: {why} generates every weight of each client's model on the server, and "
                          f"model.arch={cfg.model.arch} has batch-norm statistics, which no hypernetwork generates; "
                          "use a model without buffers")


def _check_distributed(p: PrivacyConfig) -> None:
    """The distributed discrete Gaussian's settings (docs/privacy.md, "Distributed DP"): errors for the
    settings it cannot account for, and for its own settings under the central mechanism."""
    own = ("bits", "min_participants", "max_participants")
    if p.mechanism == "central":
        for key in own:
            if getattr(p, key) is not None:
                raise ConfigError(f"privacy.{key}: has no effect without privacy.mechanism=distributed_dgauss")
        return
    if p.min_participants is None:
        raise ConfigError("privacy.min_participants: privacy.mechanism=distributed_dgauss needs the fewest "
                          "participants whose noise a round's sum holds (at most SecAgg+'s reconstruction threshold)")
    if p.max_participants is not None and p.max_participants < p.min_participants:
        raise ConfigError(f"privacy.max_participants: {p.max_participants} is below privacy.min_participants "
                          f"({p.min_participants})")
    for key, allowed, why in (("sampling", "poisson", "its accountant amplifies by Poisson sampling only"),
                              ("accountant", "rdp", "its bound is an RDP curve"),
                              ("adaptive_clip", None, "the unclipped count would need noise of its own"),
                              ("clip_norm", "finite", "the grid is sized from it")):
        value = getattr(p, key)
        ok = math.isfinite(value) if allowed == "finite" else value == allowed
        if not ok:
            raise ConfigError(f"privacy.{key}: {value!r} cannot be used with privacy.mechanism=distributed_dgauss: "
                              f"{why}")


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
    _check_distributed(p)
    why = RULES[t.generic_rule].not_private
    if why:
        private = ", ".join(n for n in RULES if not RULES[n].not_private)
        raise ConfigError(f"train.generic_rule: {t.generic_rule} cannot be used with privacy.enabled: {why}; "
                          f"use {private}")
    spec = HEADS[t.head]
    if not spec.global_model:
        reads = " and its server reads every client's own upload" if spec.reads_uploads else ""
        private = ", ".join(n for n, s in HEADS.items() if s.global_model and not s.not_private)
        raise ConfigError(f"train.head: {t.head} cannot be used with privacy.enabled: it has no global model, so "
                          f"its generic model (G-FL, final/) is the mean of the clients' own models{reads}, which "
                          f"never pass through the clipped, noised aggregate; use {private}")
    if spec.not_private:
        private = ", ".join(n for n, s in HEADS.items() if s.global_model and not s.not_private)
        raise ConfigError(f"train.head: {t.head} cannot be used with privacy.enabled: {spec.not_private}; use "
                          f"{private}")


# Each rounds.* setting's users: the modes (rounds.mode) or speed models (rounds.speeds) it has an effect in.
_ROUNDS_USERS = {
    "speed": ("speeds", ("lognormal", "pareto", "constant")), "sigma": ("speeds", ("lognormal",)),
    "shape": ("speeds", ("pareto",)), "trace": ("speeds", ("trace",)),
    "deadline": ("mode", ("deadline",)), "over_selection": ("mode", ("deadline",)),
    **{key: ("mode", ("fedbuff",)) for key in ("buffer_size", "concurrency", "staleness", "server_lr")},
}


def _check_rounds(cfg: ExperimentConfig) -> None:
    """Each mode's and speed model's settings only with it, and what each mode rules out (docs/rounds.md)."""
    r, t = cfg.rounds, cfg.train
    for key, (selector, users) in _ROUNDS_USERS.items():
        chosen = getattr(r, selector)
        if chosen not in users and getattr(r, key) != getattr(RoundsConfig(), key):
            raise no_effect(f"rounds.{key}", f"with rounds.{selector}={chosen} (only {', '.join(users)} uses it)")
    for key, selector in (("trace", "speeds"), ("deadline", "mode")):
        if getattr(r, selector) == key and getattr(r, key) is None:
            raise ConfigError(f"rounds.{key}: rounds.{selector}={key} needs it; set it")
    if r.mode != "sync" and cfg.privacy.enabled:
        raise ConfigError(f"rounds.mode: {r.mode} cannot be used with privacy.enabled: the accountant and the "
                          "noised mean assume every sampled client reports, in every round; use sync")
    if r.mode != "fedbuff":
        return
    why = RULES[t.generic_rule].not_buffered
    if why:
        buffered = ", ".join(n for n, s in RULES.items() if not s.not_buffered)
        raise ConfigError(f"train.generic_rule: {t.generic_rule} cannot be used with rounds.mode=fedbuff: {why}; "
                          f"use {buffered}")
    if HEADS[t.head].erm:
        own = ", ".join(n for n, s in HEADS.items() if not s.erm)
        raise ConfigError(f"train.head: {t.head} cannot be used with rounds.mode=fedbuff: a personalized-FL "
                          f"baseline has a server step of its own, which FedBuff's staleness-weighted step would "
                          f"replace; use {own}")
    if r.concurrency is not None and r.concurrency > cfg.data.num_clients:
        raise ConfigError(f"rounds.concurrency: {r.concurrency} clients in flight, but there are "
                          f"{cfg.data.num_clients} (data.num_clients)")
    if cfg.runtime.min_clients_per_round != RuntimeConfig().min_clients_per_round:
        raise no_effect("runtime.min_clients_per_round", "with rounds.mode=fedbuff (every server step takes "
                                                         "rounds.buffer_size updates)")


def _check_data(cfg: ExperimentConfig) -> None:
    d = cfg.data
    if d.dataset in USER_DATASETS and d.path is None:
        raise ConfigError(f"data.path: data.dataset={d.dataset} reads the data from data.path; set it")
    if d.path is not None and d.dataset in DATASETS:
        raise no_effect("data.path", f"with data.dataset={d.dataset} (a built-in set, found under data.data_dir)")
    if d.partition == "natural" and LOSSES[cfg.train.balanced_loss].meta_set:
        raise ConfigError(f"train.balanced_loss: {cfg.train.balanced_loss} takes its meta set out of the clients' "
                          "examples, which data.partition=natural keeps whole; use another loss or partition")


SITES_KEY: str = "sites"  # the config's list of sites (ExperimentConfig.sites), beside data.dataset's choice


def _check_sites(cfg: ExperimentConfig) -> None:
    """What training at sites (``data.dataset: sites``, docs/sites.md) needs and rules out: the clients are the
    sites' own (natural), trained on their sites' Ray nodes, and evaluated there (P-FL) or on the server (G-FL)."""
    d, sites = cfg.data, cfg.sites
    if d.dataset != SITES:
        if sites:
            raise no_effect(SITES_KEY, f"with data.dataset={d.dataset} (the driver reads the data)",
                            "set data.dataset=sites")
        if cfg.runtime.site_wait_s:
            raise no_effect("runtime.site_wait_s", f"with data.dataset={d.dataset} (only sites can be away)")
        return
    if not sites:
        raise ConfigError("sites: data.dataset=sites trains the clients where their data lives; list the sites "
                          "(each its name and path)")
    names = [s.name for s in sites]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ConfigError(f"sites.{i}.name: {name!r} names two sites; each site once")
    if d.partition != "natural":
        raise ConfigError("data.partition: the sites name their own clients (natural clients); set "
                          "data.partition=natural")
    for key, default in (("data.new_clients", 0), ("data.data_dir", None), ("data.download", True)):
        if functools.reduce(getattr, key.split("."), cfg) != default:
            raise no_effect(key, "with data.dataset=sites (every client lives at a site and trains)"
                            if key == "data.new_clients" else "with data.dataset=sites (data.path is the "
                            "server's test set; the clients' data is at the sites)")
    rt, ev = cfg.runtime, cfg.eval
    if rt.mode != "ray":
        raise ConfigError("runtime.mode: data.dataset=sites trains on the sites' Ray nodes; set runtime.mode=ray "
                          "(or leave it auto)")
    if rt.clients_per_actor:
        raise no_effect("runtime.clients_per_actor", "with data.dataset=sites (each site's actors host its "
                                                     "clients)")
    for key, value in (("eval.estimate_size", ev.estimate_size), ("eval.finetune_epochs", ev.finetune_epochs),
                       ("eval.clients", ev.clients)):
        if value:
            raise ConfigError(f"{key}: not supported with data.dataset=sites (P-FL is computed at the sites "
                              "over every client); remove it")
    if cfg.rounds.mode == "fedbuff":
        raise ConfigError("rounds.mode: fedbuff cannot be used with data.dataset=sites (its clients in flight "
                          "carry their state through the server); use sync or deadline")
    spec = HEADS[cfg.train.head]
    if not spec.global_model or spec.reads_uploads:
        usable = ", ".join(n for n, s in HEADS.items() if s.global_model and not s.reads_uploads)
        raise ConfigError(f"train.head: {cfg.train.head} cannot be used with data.dataset=sites: its server reads "
                          f"the clients' own models, which stay at their sites; use {usable}")
