"""A config dataclass from a plain mapping, every key, type and range checked; an error names the dotted
field, the nearest valid key for a typo, and what replaced a key of an earlier version."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pydantic import TypeAdapter, ValidationError

from .sections import ExperimentConfig
from .values import ConfigError, did_you_mean

# Keys of earlier versions, with what replaced them.
RENAMED = {
    "train.algorithm": "train.head (fedrod -> linear or hyper; fedavg -> none, with train.balanced_loss=ce "
                       "for plain FedAvg)",
    "train.variant": "train.head (linear | hyper)",
    "train.prox_mu": "train.rule_params.mu (with train.generic_rule=fedprox)",
    "train.feddyn_alpha": "train.rule_params.alpha (with train.generic_rule=feddyn)",
    "privacy.secure_rng": "privacy.noise_seed (the noise and the client sampling now come from the OS's CSPRNG "
                          "by default; an integer noise_seed opts into seeded, reproducible ones for experiments, "
                          "which are not private against anyone who knows the seed)",
    "train.head_params.standardize": "train.head_params.descriptor_scaling (PeFLL: standardize: true -> "
                                     "descriptor_scaling: standardize, each descriptor by its own mean and std; "
                                     "official: the official code's fixed rescaling; none)",
}
_EXPECTED = {"int_type": "expected an integer", "float_type": "expected a number", "bool_type": "expected true/false",
             "string_type": "expected a string", "dict_type": "expected a mapping",
             "dataclass_type": "expected a mapping"}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def build(cls: type, data: Any, prefix: str = "") -> Any:
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
        if path in RENAMED:
            return f"{path} was replaced by {RENAMED[path]}"
        fields = _section_fields(cls, loc[:-1])
        return (f"unknown config key {path}{did_you_mean(loc[-1], fields, section)}; "
                f"valid keys here: {', '.join(sorted(fields)) or 'none'}")
    path = prefix + ".".join(loc) if loc else prefix.rstrip(".") or "config"
    if e["type"] in ("dict_type", "dataclass_type") and loc:
        # A value given to a section's name: the setting of that name in another section, likely.
        elsewhere = [leaf for leaf in _leaves(ExperimentConfig) if leaf.rsplit(".", 1)[-1] == loc[-1]]
        hint = f" ({path} is a section; did you mean {' or '.join(elsewhere)}?)" if elsewhere else ""
        return f"{path}: {_EXPECTED[e['type']]}, got {e['input']!r}{hint}"
    if e["type"] in _EXPECTED:
        return f"{path}: {_EXPECTED[e['type']]}, got {e['input']!r}"
    if e["type"] in _BOUNDS:
        (bound,) = e["ctx"].values()
        return f"{path}: must be {_BOUNDS[e['type']]} {bound:g}, got {e['input']!r}"
    return f"{path}: {e['msg']}, got {e['input']!r}"


def _section_fields(cls: type, loc: list[str]) -> list[str]:
    for name in loc:
        if name.isdigit():  # an item of a list of sections (sites): the list's class, already taken
            continue
        cls = typing.get_type_hints(cls)[name]
        # An optional section (privacy.adaptive_clip) or a list of them (sites): the section's own class.
        cls = next((a for a in typing.get_args(cls) if dataclasses.is_dataclass(a)), cls)
    return [f.name for f in dataclasses.fields(cls)]


def _leaves(cls: type, prefix: str = "") -> list[str]:
    """The dotted names of every setting of a config dataclass that is not a section itself."""
    out = []
    for name, hint in typing.get_type_hints(cls).items():
        inner = next((a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a)), None)
        out += _leaves(inner, f"{prefix}{name}.") if inner else [f"{prefix}{name}"]
    return out
