"""Configs written earlier: a record's (a checkpoint's, a reproduction's), read back by any later version,
and what a resumed run may change of the config it was trained with."""

from __future__ import annotations

from typing import Any

from .checks import unused_settings
from .loading import config_from_dict, deep_copy
from .sections import DataConfig, ExperimentConfig, TrainConfig
from .values import ConfigError

# What --resume may change: how and how long to run, never what is learned.
RESUMABLE = ("name", "run_dir", "data.data_dir", "data.path", "data.download", "train.rounds", "eval.",
             "runtime.", "tracking.")


# Keys that only a record of an earlier version holds, which config_from_record reads (a user's config may not).
RECORD_KEYS = ("privacy.secure_rng",)


def without_record_keys(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (a record's config, as a mapping) without ``RECORD_KEYS``: what checks a record's keys and
    types as a user's config is checked, before config_from_record reads the whole of it."""
    data = deep_copy(data)
    for key in RECORD_KEYS:
        section, name = key.rsplit(".", 1)
        node = _get(data, section, None)
        if isinstance(node, dict):
            node.pop(name, None)
    return data


def config_from_record(record: dict[str, Any]) -> ExperimentConfig:
    """The config a record holds: a checkpoint's, a reproduction's (reproduce.yaml), written by any version.

    A record keeps every setting, defaults included, as the version that wrote it had them, unused ones too.
    Those never had an effect, so they are dropped whatever their values (a default changed since would
    otherwise read as a user's setting with no effect); everything else is checked as a user's config is.
    ``privacy.secure_rng`` (before ``privacy.noise_seed``): ``false`` seeded the noise by the run's seed and
    the round, which ``noise_seed: <seed>`` does the same way; ``true`` is today's default."""
    data = deep_copy(record)
    privacy = _get(data, "privacy", None)
    if isinstance(privacy, dict) and privacy.pop("secure_rng", None) is False and privacy.get("enabled"):
        privacy["noise_seed"] = data.get("seed", ExperimentConfig.seed)
    loss = _get(data, "train.balanced_loss", TrainConfig.balanced_loss)
    for key in unused_settings(loss, _get(data, "data.partition", DataConfig.partition)):
        section, name = key.rsplit(".", 1)
        node = _get(data, section, None)
        if isinstance(node, dict):
            node.pop(name, None)
    return config_from_dict(data)


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


def fixed_settings(cfg: ExperimentConfig) -> dict[str, Any]:
    """The config's settings, flattened, less those a resumed run may change (``check_resume``): what stays the
    same over a run's restarts (a Flower SuperNode keys its clients' states by them)."""
    return {k: v for k, v in _flatten(cfg.to_dict()).items() if not k.startswith(RESUMABLE)}


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and k not in ("client_resources", "rule_params", "head_params"):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _get(data: Any, key: str, default: Any) -> Any:
    for name in key.split("."):
        if not isinstance(data, dict) or name not in data:
            return default
        data = data[name]
    return data
