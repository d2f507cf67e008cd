"""Shared fixtures: where the real datasets live, and one Ray instance per test session."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[1]

# --- a home of its own for the whole run -------------------------------------------------------------

# Set before anything imports ray, matplotlib or mlflow, and inherited by every subprocess: whatever the
# suite and the programs it starts (Ray, chromium, mkdocs, moto) write under ~ lands here, never in the user's
# home, which other programs may change meanwhile. ``home_holds_nothing_of_the_users`` (at the end)
# checks what the tests wrote here that they must not write into a user's home.
TEST_HOME = Path(tempfile.mkdtemp(prefix="frt-home-"))
os.environ.update(
    HOME=str(TEST_HOME),
    XDG_CONFIG_HOME=str(TEST_HOME / ".config"),
    XDG_CACHE_HOME=str(TEST_HOME / ".cache"),
    XDG_DATA_HOME=str(TEST_HOME / ".local" / "share"),
    MPLCONFIGDIR=str(TEST_HOME / ".mplconfig"),  # matplotlib's font cache; not ~/.cache/matplotlib
    MLFLOW_DISABLE_TELEMETRY="true",
    DO_NOT_TRACK="true",
)
# What the library must never leave in a user's home: a Ray token (which switches token auth on for the
# user's own Ray), datasets downloaded into the user's cache (the tests' data is on disk or served locally),
# matplotlib's caches where MPLCONFIGDIR is not set.
NOT_IN_HOME = (".ray", ".cache/fedrod-ray", ".cache/matplotlib", ".config/matplotlib")

SHARED_DATA = Path(os.environ.get("FEDROD_TEST_DATA", REPO.parent / "shared" / "data"))
MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    """The directory holding the verified real datasets (``../shared/data``).

    Absent, the tests that need it skip on a developer's machine, but fail in CI (``CI`` set), where the
    data is always beside the clone: a CI run must never pass without decoding real MNIST and Fashion-MNIST.
    """
    missing = [name for name in ("mnist", "fmnist") if not all((SHARED_DATA / name / f).is_file() for f in MNIST_FILES)]
    if missing:
        message = f"real {' and '.join(missing)} not found under {SHARED_DATA} (set FEDROD_TEST_DATA)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return SHARED_DATA


@pytest.fixture
def one_torch_thread():
    """One intra-op thread: fastest for tiny batches, and every reduction then runs in the same order
    in this process and in single-threaded Ray actors."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --- the fast lane -----------------------------------------------------------------------------------

# A test that starts a Ray (through these fixtures, directly or through another fixture) is slow whether or
# not it is marked: `pytest -m "not slow"` runs without starting one (docs/getting-started.md).
RAY_FIXTURES = {"ray_session", "private_ray_env", "module_private_ray_env"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


# --- parallel workers (pytest-xdist) -----------------------------------------------------------------

# Most of the suite's time is waiting (a Ray or Flower's processes starting, a server, a subprocess): two
# workers run two test files at a time, one waiting while the other computes. Each file runs whole on one
# worker, so its module fixtures (a cluster, a head node, a Flower federation) start once; each worker has its
# own session Ray (``ray_session``), home and tmp_path. Files that must never run at the same time share a
# group, which runs on one worker, file after file.
WORKERS = 2


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (pyproject.toml's addopts): ``WORKERS`` for the whole suite or its fast lane (no path named,
    pyproject's testpaths); none, so in this process as without xdist, for the files or tests a command names."""
    return WORKERS if config.args_source == pytest.Config.ArgsSource.TESTPATHS else 0

GROUPS = {
    # Ray Serve's HAProxy binds fixed ports (stats 8404, metrics 9101): one Serve on the host at a time.
    **dict.fromkeys(("test_api_limits.py", "test_api_release.py", "test_api_servers.py"), "ray-serve"),
}
# The files that take longest (by --durations), handed out first so that none is left to run alone at the end:
# Flower's processes, killed and restarted Ray runs, a multi-node cluster, a head node's job submissions, runs
# trained and resumed in this process, Tune runs.
LONGEST_FIRST = ("test_flower.py", "test_ray_runtime.py", "test_sites.py", "test_deploy.py",
                 "test_personalization.py", "test_privacy.py", "test_tune.py", "test_flower_secagg.py",
                 "test_reproduce.py", "ray-serve", "test_api.py", "test_cli.py")


def _work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its file's group, or its file (``GROUPS``)."""
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return GROUPS.get(name, name)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with ``GROUPS`` kept together and ``LONGEST_FIRST`` handed out first."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            # The base class hands out the queue's first unit: put the longest one left there.
            first = min(self.workqueue, key=lambda unit: rank.get(unit, len(rank)))
            self.workqueue.move_to_end(first, last=False)
            super()._assign_work_unit(node)

    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    return Scheduling(config, log)


# --- Ray: one private local instance per test session -------------------------------------------------

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # before anything imports ray
# Every Ray the suite starts is private and local: no token auth. Left to Ray's default, the first local
# cluster writes ~/.ray/auth_token, which then switches token auth on for the user's own
# `ray start --head` and breaks their `ray job submit` (deploy/README.md). Subprocesses inherit this.
os.environ["RAY_AUTH_MODE"] = "disabled"


@pytest.fixture(scope="session", autouse=True)
def home_holds_nothing_of_the_users():
    """Fails the session (an error in its last test's teardown) if a test wrote into its home what the
    library must not write into a user's: ``NOT_IN_HOME``. The home is removed afterwards."""
    yield
    written = sorted(str(p.relative_to(TEST_HOME)) for rel in NOT_IN_HOME
                     for p in [TEST_HOME / rel] if p.exists() or p.is_symlink())
    shutil.rmtree(TEST_HOME, ignore_errors=True)
    assert not written, f"the test suite wrote into the home directory what it must not: {written}"


def pytest_unconfigure(config: pytest.Config) -> None:
    """The home goes in every process, also in the controller of parallel workers, which runs no test (and so
    not the fixture above) but made a home of its own when it imported this file."""
    shutil.rmtree(TEST_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def ray_session():
    """A private local Ray (2 CPUs, no dashboard) for the whole session (each parallel worker's own), shut down
    and removed at the end.

    Its temp dir is short because Ray's unix socket paths must fit in 107 bytes. Tests that need a Ray of
    their own (a multi-node cluster, the CLI's ``--mode ray``) start it in a subprocess instead.
    """
    import ray

    if ray.is_initialized():
        pytest.fail("Ray was already initialised before the ray_session fixture")
    from fedrod_ray_api.serve import LOCAL_RAY_ENV, haproxy_env
    from fedrod_ray_api.settings import Connections

    temp_dir = tempfile.mkdtemp(prefix="frt-", dir="/tmp")
    # Ray Serve in the mode `fedrod-ray serve --ray` starts (HAProxy ingress, with the default header timeout
    # and connection limit): Ray's processes read it when they start.
    with mock.patch.dict(os.environ, {**LOCAL_RAY_ENV, **haproxy_env(Connections())}):
        ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=temp_dir,
                 log_to_driver=False, configure_logging=False)
        try:
            yield ray
        finally:
            ray.shutdown()
            shutil.rmtree(temp_dir, ignore_errors=True)


def _processes_mentioning(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of the processes, other than this one, whose command line or environment
    contains ``marker``."""
    needle = marker.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone, or not ours to read
            continue
        if needle in cmdline or needle in environ:
            found.append((int(entry), cmdline.replace(b"\0", b" ").decode(errors="replace").strip()))
    return found


class PrivateRayEnv(dict):
    """An environment (a dict for ``subprocess``) whose Ray lives under its own ``temp_dir``."""

    def __init__(self, temp_dir: str):
        env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TMPDIR")}
        super().__init__(env, RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=temp_dir, PYTHONUNBUFFERED="1")
        self.temp_dir = temp_dir

    def processes(self) -> list[tuple[int, str]]:
        """The processes of any Ray started with this environment (they inherit it)."""
        return _processes_mentioning(self.temp_dir)

    def reap_after_killed_driver(self) -> None:
        """After its driver's SIGKILL, the private Ray's core processes must go (Ray's reaper kills them).

        Its dashboard and runtime-env agents then linger up to ~60 s (they report the raylet's death to
        the dead GCS with a fixed 60 s timeout) before exiting on their own; we end those by pid rather
        than wait.
        """
        import signal
        import time

        deadline = time.monotonic() + 30
        while True:
            left = self.processes()
            core = [cmd for _, cmd in left if not cmd.startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent"))]
            if not core:
                break
            assert time.monotonic() < deadline, f"the killed driver's Ray is still running: {core}"
            time.sleep(0.5)
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _private_ray():
    """A ``PrivateRayEnv`` (a private, short RAY_TMPDIR); afterwards, every process carrying that directory in
    its command line or environment (Ray's gcs_server, raylet, workers, agents) must be gone within 30 s;
    stragglers are killed by pid and fail the test."""
    import signal
    import time

    env = PrivateRayEnv(tempfile.mkdtemp(prefix="frt-", dir="/tmp"))
    yield env
    deadline = time.monotonic() + 30
    left = env.processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = env.processes()
    for pid, _ in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    shutil.rmtree(env.temp_dir, ignore_errors=True)
    assert not left, "Ray processes outlived the subprocess that started them:\n" + "\n".join(
        f"{pid} {cmd[:120]}" for pid, cmd in left)


@pytest.fixture
def private_ray_env():
    """Environment for a subprocess that starts (and must stop) a Ray of its own (``_private_ray``).

    The subprocess gets a private, short RAY_TMPDIR, so its Ray never meets the session's or anyone
    else's. On teardown every process of that Ray must be gone within 30 s.
    """
    yield from _private_ray()


@pytest.fixture(scope="module")
def module_private_ray_env():
    """``private_ray_env`` for one subprocess whose result several tests of a module check."""
    yield from _private_ray()
