"""A config from YAML or a mapping with ``--set`` overrides, checked as a whole; a config back to YAML; the
JSON Schema of a config file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter

from .building import build
from .checks import validate
from .overrides import apply_override, check_key
from .sections import ExperimentConfig
from .values import ConfigError


def config_from_dict(data: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    data = deep_copy(data or {})
    for assignment in overrides:
        if apply_override(data, assignment) is None:
            check_key(assignment.split("=", 1)[0].strip())
    return validate(build(ExperimentConfig, data))


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


def deep_copy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: deep_copy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [deep_copy(v) for v in d]
    return d
