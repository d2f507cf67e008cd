"""Nothing of one development machine in what users read or run: no tracked text file names a path under a
developer's home or work tree (``/work/``, ``/root/``, ``/home/<user>/``, ``/Users/``) or a scratch folder
under ``/tmp/``, except the few kept below, each with its reason. Commands name data by a relative path
(``FEDROD_DATA_DIR=../shared/data``) or say what to set; recorded configs name the repository's file."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# A path at the root of a filesystem (not inside a URL or a longer path) under a developer's machine.
MACHINE_PATH = re.compile(r"(?<![\w.~/-])/(?:(?:work|root|Users|tmp)/|home/(?!ray/))")
# Lines that must keep such a path: (file, or a folder ending in "/"; the line's text; why).
ALLOWED = (
    ("bench/results/", re.compile(r"^\s*(run_dir|data_dir|data\.data_dir):"),
     ("a run's own record of where its run directory and data were (its config.yaml copied byte for byte, "
      "or its reproduction's --set data.data_dir): rewriting it would forge the record")),
    ("deploy/reproduce_fmnist.sh", re.compile(r"RAY_TMPDIR:-/tmp/"),
     "a default scratch folder the script creates on whatever machine runs it"),
    ("tune/trial.py", re.compile(r"/tmp/ray/session_"), "Ray's own session folder, named to explain Tune"),
    ("docs/tune.md", re.compile(r"/tmp/ray/session_"), "Ray's own session folder, named to explain Tune"),
    ("docs/benchmarks.md", re.compile(r"/tmp/dataonce-before"),
     "a scratch tree the `git archive ... | tar -x -C` beside it creates"),
    ("tests/hosts.py", re.compile(r"/tmp/"), ("the multi-host harness's scratch under /tmp, which it creates, "
                                               "mounts tmpfs over and removes on any machine")),
    ("tests/test_hosts.py", re.compile(r"/tmp/fh-"), "a path the harness must refuse to hide (its own prefix)"),
    ("tests/test_machine_paths.py", re.compile(r"."), "this test's own patterns and examples"),
)


def tracked_files() -> list[Path]:
    """The repository's tracked files (git ls-files); without git (an unpacked archive), every file but
    git's, caches and build outputs."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
        return [REPO / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", "__pycache__", ".pytest_cache", "site", ".ruff_cache"}
        return [p for p in REPO.rglob("*") if p.is_file() and not skip & set(p.relative_to(REPO).parts)
                and not p.parts[-2].endswith(".egg-info")]


def allowed(name: str, line: str) -> bool:
    return any((name.startswith(where) if where.endswith("/") else name == where) and pattern.search(line)
               for where, pattern, _ in ALLOWED)


def machine_paths(files: list[Path]) -> list[str]:
    """``file:line: text`` of every line naming a machine path that ALLOWED does not keep."""
    found = []
    for path in files:
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary (an image, a checkpoint)
        name = path.relative_to(REPO).as_posix()
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if MACHINE_PATH.search(line) and not allowed(name, line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    return found


def test_the_pattern_finds_machine_paths_and_leaves_urls_and_container_paths(tmp_path):
    assert [bool(MACHINE_PATH.search(text)) for text in (
        "FEDROD_DATA_DIR=/work/shared/data", "default='/root/venv/bin/python'", "base: /home/alice/x.yaml",
        "--before /tmp/old", "see https://example.org/work/x", "WORKDIR /home/ray/fedrod-ray",
        "--data-dir /mnt/data", "../shared/data", "a/work/b")] == [True, True, True, True, False, False, False,
                                                                 False, False]
    assert allowed("bench/results/fmnist/x/runs/a_s0.yaml", "run_dir: /tmp/out/jobs/a_s0")
    assert not allowed("bench/results/fmnist/x/reproduce.yaml", "base: /work/clone/configs/fmnist_paper.yaml")
    assert not allowed("bench/flower_compare.py", "/tmp/ray/session_x")


def test_no_tracked_file_names_a_development_machines_path():
    found = machine_paths(tracked_files())
    assert not found, "paths of one machine (use a relative path, or say what to set):\n" + "\n".join(found)
