"""What fedrod-ray installs: every package folder, under names that collide with no other project."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SETUPTOOLS = PROJECT["tool"]["setuptools"]


def _folder(package: str) -> Path:
    top, *rest = package.split(".")
    return REPO / SETUPTOOLS["package-dir"].get(top, top) / Path(*rest)


def test_every_package_folder_is_installed_and_nothing_else():
    folders = {p.parent for top in ("fedrod_ray", "api", "tune", "flower") for p in (REPO / top).rglob("__init__.py")}
    assert {_folder(p) for p in SETUPTOOLS["packages"]} == folders


def test_api_tune_and_flower_install_under_the_projects_own_names():
    """The repository keeps its api/, tune/ and flower/ folders; installed, they are fedrod_ray_api,
    fedrod_ray_tune and fedrod_ray_flower (a package named "tune" is on the public index, "flower" is a Celery
    monitor's, and "api" is anyone's name)."""
    tops = {p.split(".")[0] for p in SETUPTOOLS["packages"]}
    assert tops == {"fedrod_ray", "fedrod_ray_api", "fedrod_ray_tune", "fedrod_ray_flower"}
    assert SETUPTOOLS["package-dir"] == {"fedrod_ray_api": "api", "fedrod_ray_tune": "tune",
                                         "fedrod_ray_flower": "flower"}


def test_the_commands_load_from_the_installed_names():
    commands = {e.name: e for e in entry_points(group="fedrod_ray.commands")}
    assert {name: e.value.split(".")[0] for name, e in commands.items()} == {
        "serve": "fedrod_ray_api", "tune": "fedrod_ray_tune", "reproduce": "fedrod_ray_tune"}
    for e in commands.values():
        assert callable(e.load())


def test_dependencies_are_declared_and_floored_where_the_suite_runs():
    deps = PROJECT["project"]["dependencies"]
    assert any(d.startswith("pydantic>=2") for d in deps)  # config and api/ use it directly
    assert "ray[default,tune]>=2.60" in deps
    assert "torch>=2.4" in deps  # a range: CI and the README install the CPU wheel first
    assert "vision" not in PROJECT["project"]["optional-dependencies"]  # nothing imports torchvision
