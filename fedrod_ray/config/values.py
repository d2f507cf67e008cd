"""The config's value types, its error, and the wording of its errors: strict types (no "3" for 3, no true
for 1) converting only where nothing is lost; every error names the dotted field."""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict, Field

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid; the message names the field."""


def integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def number(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    # YAML 1.1 reads "1e-3" (no dot) as a string, and Python prints small floats that way.
    if isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
        return float(value)
    return value


# The bounds come before the conversion so that they check the converted value and reach the JSON Schema.
Int = Annotated[int, Field(strict=True), BeforeValidator(integral)]
PositiveInt = Annotated[int, Field(strict=True, gt=0), BeforeValidator(integral)]
NonNegativeInt = Annotated[int, Field(strict=True, ge=0), BeforeValidator(integral)]
PositiveFloat = Annotated[float, Field(strict=True, gt=0), BeforeValidator(number)]
NonNegativeFloat = Annotated[float, Field(strict=True, ge=0), BeforeValidator(number)]
Fraction = Annotated[float, Field(strict=True, gt=0, le=1), BeforeValidator(number)]

CLOSED = ConfigDict(extra="forbid")  # an unknown key is an error


def section(value: Any) -> Any:
    return {} if value is None else value  # an empty YAML section ("eval:") is all defaults


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


_IMPORT_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_import_path(value: str) -> bool:
    """``package.module:factory``: a model factory named by where it lives."""
    return _IMPORT_PATH.fullmatch(value) is not None


def check_registry(registry: Iterable[str], names: Iterable[str], key: str) -> None:
    """A registry must hold exactly the names its spec (``fedrod_ray.specs``) declares for ``key``: neither
    may list one the other lacks."""
    if set(registry) != set(names):
        raise ImportError(f"{key}: the registry holds {sorted(registry)} but its spec declares {sorted(names)}")


def did_you_mean(given: str, options, prefix: str = "") -> str:
    close = difflib.get_close_matches(given, sorted(options), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def not_one_of(path: str, value: Any, names: Iterable[str]) -> ConfigError:
    return ConfigError(f"{path}: {value!r} is not one of {sorted(names)}{did_you_mean(str(value), names)}")


def no_effect(key: str, why: str, instead: str = "", value: str = "") -> ConfigError:
    """The error for ``key`` (at ``value``) having no effect ``why``: it says how to take the setting out, from
    the file or from the command line over a base config (``--set key=null`` restores the default)."""
    return ConfigError(f"{key}: {value + ' ' if value else ''}has no effect {why}; remove it, or --set {key}=null"
                       + (f", or {instead}" if instead else ""))
