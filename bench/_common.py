"""Helpers shared by the benchmark scripts in bench/ (imported as ``_common``; not part of the library)."""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence

from fedrod_ray.config import DataConfig, ExperimentConfig, config_from_dict
from fedrod_ray.data import DatasetNotFoundError, load_dataset, resolve_data_dir

SYNTHETIC_NOTE = (
    "note: real MNIST not found under {dir}/mnist; using data.dataset=synthetic "
    "(same 1x28x28 shape, so the timings are comparable)"
)


def mnist_data_section(data_dir: str | None) -> dict:
    """The ``data:`` overrides for real MNIST when it is on disk, else for same-sized synthetic data.

    Never downloads: a benchmark should not depend on the network.
    """
    root = resolve_data_dir(data_dir)
    try:
        load_dataset(DataConfig(dataset="mnist", data_dir=str(root), download=False))
        return {"dataset": "mnist", "data_dir": str(root), "download": False}
    except DatasetNotFoundError:
        print(SYNTHETIC_NOTE.format(dir=root))
        # 60k training / 10k test images, like MNIST, so partitions give the same client sizes.
        return {"dataset": "synthetic", "synthetic_train_per_class": 6000, "synthetic_test_per_class": 1000}


def make_config(data: dict, **sections) -> ExperimentConfig:
    """An ExperimentConfig from a ``data`` section plus other sections given as dicts."""
    return config_from_dict({"data": dict(data), **sections})


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def md_table(
    headers: Sequence[str] | str, rows: Sequence[Sequence[object]], right: Sequence[bool] | None = None
) -> str:
    """A Markdown table; ``headers`` a list or one string split at "|"; ``right[i]`` right-aligns column i
    (default: every column but the first)."""
    if isinstance(headers, str):
        headers = headers.split("|")
    if right is None:
        right = [False] + [True] * (len(headers) - 1)
    lines = [
        "| " + " | ".join(str(h) for h in headers) + " |",
        "|" + "|".join("---:" if r else "---" for r in right) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_note() -> str:
    """One line on the machine and its load, printed above the tables."""
    import platform

    import torch

    load = os.getloadavg()
    return (
        f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, python {platform.python_version()}; "
        f"load average at start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
    )


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def _memory(pid: int) -> tuple[str, int, int]:
    """(command line, RSS, PSS) of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    sizes = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                sizes[key] = int(rest.split()[0]) * 1024
    return cmd, sizes.get("Rss", 0), sizes.get("Pss", 0)


def ray_memory() -> dict[str, tuple[int, int, int]]:
    """(processes, RSS, PSS) in bytes of this driver and of the Ray processes it started (its descendants),
    by kind. PSS shares each page among the processes that map it, so the PSS figures add up."""

    def kind(pid: int, cmd: str) -> str:
        if pid == os.getpid():
            return "driver"
        for prefix, name in (("ray::ClientActor", "client actors"), ("ray::Coordinator", "coordinator"),
                             ("ray::IDLE", "idle workers")):
            if cmd.startswith(prefix):
                return name
        for needle in ("gcs_server", "raylet"):
            if needle in cmd.split(" ", 1)[0]:
                return needle
        return "other (agents, monitors)"

    groups: dict[str, tuple[int, int, int]] = {}
    for pid in _descendants(os.getpid()):
        try:
            cmd, rss, pss = _memory(pid)
        except OSError:  # gone meanwhile
            continue
        name = kind(pid, cmd)
        n, r, p = groups.get(name, (0, 0, 0))
        groups[name] = (n + 1, r + rss, p + pss)
    return groups


def tree_memory(root: int) -> tuple[int, int]:
    """(processes, object store) bytes of process ``root`` and its descendants (a driver and the Ray it
    started): the processes' PSS without their shared-memory mappings, and the pages allocated in Ray's
    object store files under /dev/shm, each file counted once however many processes map it (Linux)."""
    processes, stores = 0, {}
    for pid in _descendants(root):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                sizes = {key: int(rest.split()[0]) * 1024 for key, _, rest in (line.partition(":") for line in f)
                         if key in ("Pss", "Pss_Shmem")}
            processes += sizes["Pss"] - sizes.get("Pss_Shmem", 0)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/shm/plasma"):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    stores[st.st_dev, st.st_ino] = st.st_blocks * 512
        except (OSError, KeyError):  # gone meanwhile, or not ours to read
            continue
    return processes, sum(stores.values())
