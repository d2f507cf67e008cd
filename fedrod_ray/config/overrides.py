"""``--set key=value`` on the command line: a dotted key, a value parsed as YAML; ``null`` takes a setting
out so that it takes its default."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import yaml

from .sections import ExperimentConfig
from .values import ConfigError, did_you_mean


def parse_override(assignment: str) -> tuple[str, Any]:
    """``a.b.c=value`` as its dotted key and its value parsed as YAML (None: ``null`` or nothing after ``=``)."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    key, raw = assignment.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    try:
        return key, yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: cannot parse value {raw!r}: {e}") from None


def apply_override(data: dict[str, Any], assignment: str) -> Any:
    """Apply one ``a.b.c=value`` override (value parsed as YAML) to a nested dict in place and return the value.
    A null value (``a.b.c=null``, or nothing after ``=``) removes the key, so that it takes its default: a
    setting of a base config can be taken out from the command line."""
    key, value = parse_override(assignment)
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


def check_key(key: str) -> None:
    """Refuse a dotted key that names no setting: a null override takes its key out, so nothing else would
    notice a typo in it. Below a free mapping (``train.rule_params``, ``runtime.client_resources``) any key
    goes, as its value's own check decides."""
    cls, parts = ExperimentConfig, key.split(".")
    for i, part in enumerate(parts):
        fields = [f.name for f in dataclasses.fields(cls)]
        if part not in fields:
            section = "".join(f"{p}." for p in parts[:i])
            raise ConfigError(f"unknown config key {section}{part}{did_you_mean(part, fields, section)}; "
                              f"valid keys here: {', '.join(sorted(fields))}")
        cls = typing.get_type_hints(cls)[part]
        if not dataclasses.is_dataclass(cls):
            return


def defaults_taken(cfg: ExperimentConfig, overrides: list[str] | tuple[str, ...]) -> list[str]:
    """A line for each ``--set key=null`` of ``overrides`` saying what ``key`` is in ``cfg``: null takes a
    setting out, so that it has its default, which the console should name (``data.alpha=null`` is 0.1)."""
    lines = []
    for assignment in overrides:
        key, value = parse_override(assignment)
        if value is not None:
            continue
        node: Any = cfg
        for part in key.split("."):
            parent, node = node, node.get(part) if isinstance(node, dict) else getattr(node, part, None)
        if dataclasses.is_dataclass(node):
            lines.append(f"--set {key}=null: {key} has its defaults")
        elif isinstance(parent, dict):  # a free mapping's key (train.rule_params.mu): its owner's default
            lines.append(f"--set {key}=null: {key} is taken out")
        else:
            lines.append(f"--set {key}=null: {key} takes its default, {'null' if node is None else repr(node)}")
    return lines
