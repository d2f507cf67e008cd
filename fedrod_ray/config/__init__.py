"""Typed experiment configuration, loaded from YAML with ``--set key=value`` overrides.

Every section is a pydantic dataclass with strict types and its ranges as field constraints; unknown
keys, values of the wrong type or range, and settings that would change nothing fail with a
``ConfigError`` that names the dotted field (``train.lr``), so a typo in a sweep never silently runs
the default. ``config_schema()`` is the same description as a JSON Schema, for editors.

The bottom layer; it imports no torch. A plug-in's name, parameters and constraints are its spec's
(``fedrod_ray.specs``), read here; this package lists none of them. Its modules, one job each:

- ``values``: the value types, ``ConfigError`` and the wording of errors;
- ``sections``: the schema, a dataclass per section (``ExperimentConfig`` and below);
- ``building``: a section from a mapping, its errors naming the field;
- ``checks``: choices, settings with no effect, what each spec rules out;
- ``overrides``: ``--set``;
- ``loading``: YAML in and out, the JSON Schema;
- ``records``: configs written earlier (checkpoints, reproductions) and what ``--resume`` may change.
"""

from __future__ import annotations

from .building import check_keys_and_types
from .checks import build_head_params, build_rule_params
from .loading import config_from_dict, config_schema, dump_config, load_config
from .overrides import apply_override
from .records import check_resume, config_from_record, without_record_keys
from .sections import DataConfig, EvalConfig, ExperimentConfig, ModelConfig, RuntimeConfig, TrainConfig
from .values import ConfigError

__all__ = ["ConfigError", "DataConfig", "EvalConfig", "ExperimentConfig", "ModelConfig", "RuntimeConfig",
           "TrainConfig", "apply_override", "build_head_params", "build_rule_params", "check_keys_and_types",
           "check_resume", "config_from_dict", "config_from_record", "config_schema", "dump_config", "load_config",
           "without_record_keys"]
