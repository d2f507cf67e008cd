"""How the suite runs on its parallel workers (tests/conftest.py, "parallel workers"): the files that must never
run at the same time are named by the names they have, so a renamed file cannot silently leave its group."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest
from conftest import GROUPS, LONGEST_FIRST

TESTS = Path(__file__).parent


def test_the_groups_and_the_longest_files_name_test_files_that_exist():
    files = {p.name for p in TESTS.glob("test_*.py")}
    assert set(GROUPS) <= files, set(GROUPS) - files
    assert set(LONGEST_FIRST) <= files | set(GROUPS.values()), set(LONGEST_FIRST) - files - set(GROUPS.values())


def test_a_test_runs_with_its_files_group_or_its_file():
    assert conftest._work_unit("tests/test_api_servers.py::test_ray_serve_deployment") == "ray-serve"
    assert conftest._work_unit("tests/test_api_limits.py::test_x[uvicorn]") == "ray-serve"
    assert conftest._work_unit("tests/test_sites.py::test_two_sites_on_a_cluster") == "test_sites.py"
    assert conftest._work_unit("tests/test_cli.py::test_a[b::c]") == "test_cli.py"


def test_the_whole_suite_runs_on_the_workers_and_a_named_file_in_this_process():
    sources = pytest.Config.ArgsSource
    assert conftest.pytest_xdist_auto_num_workers(SimpleNamespace(args_source=sources.TESTPATHS)) == conftest.WORKERS
    assert conftest.pytest_xdist_auto_num_workers(SimpleNamespace(args_source=sources.ARGS)) == 0
