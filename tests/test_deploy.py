"""Deployment files: manifests that parse and agree with the CLI and with each other, job commands in
the docs that the CLI accepts, and the documented ``ray job submit`` commands (docs/ray.md's cluster job,
docs/data.md's example job) run as written against a private local head node."""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from fedrod_ray.cli import _overrides, build_parser
from fedrod_ray.config import load_config

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
IMAGE_REPO = "ghcr.io/fedrod-ray/fedrod-ray:"
DATA_MOUNT, RUNS_MOUNT = "/mnt/data", "/mnt/runs"
CONFIG_REF = re.compile(r"configs/[\w.-]+\.ya?ml")
# Provided by the image (deploy/Dockerfile), or needed only by the HTTP service (pillow: its PNG input;
# fastapi-offline: its /docs assets), not by training jobs.
NOT_IN_JOB_PIP = {"torch", "ray", "fastapi", "uvicorn", "pillow", "fastapi-offline"}


def _yaml(rel: str) -> dict:
    data = yaml.safe_load((DEPLOY / rel).read_text())
    assert isinstance(data, dict), rel
    return data


def _req_name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _dockerfile() -> str:
    return (DEPLOY / "Dockerfile").read_text()


def _docker_workdir() -> str:
    return re.findall(r"^WORKDIR\s+(\S+)", _dockerfile(), re.MULTILINE)[-1]


def _parse_train(argv: list[str]):
    """Parse ``fedrod-ray`` arguments exactly as the CLI does; returns (args, config)."""
    args = build_parser().parse_args(argv)
    assert args.command == "train"
    return args, load_config(REPO / args.config, _overrides(args))


# ---------------------------------------------------------------------------------------------------
# Job commands in the docs

# Where `ray job submit` commands are documented (in YAML and Dockerfile comments too).
# (docs/data.md's example job runs from examples/, with its paths: test_ray_job_submit_of_the_example_package.)
DOC_FILES = ("README.md", "docs/ray.md", "deploy/README.md", "deploy/runtime_env.yaml", "deploy/cluster.yaml",
             "deploy/kuberay/raycluster.yaml", "deploy/kuberay/rayjob.yaml", "deploy/Dockerfile")


def doc_section(rel: str, heading: str) -> str:
    """The ``## heading`` section of a Markdown doc, up to the next ``## `` heading (subsections included)."""
    text = (REPO / rel).read_text()
    section = text[text.index(f"\n## {heading}\n"):]
    end = section.find("\n## ", 1)
    return section if end < 0 else section[:end]


def cluster_section() -> str:
    """docs/ray.md's "On a cluster" section: the cluster job that README.md shows too."""
    return doc_section("docs/ray.md", "On a cluster")


def _job_submit_commands(rel: str) -> list[str]:
    """The ``ray job submit`` commands of a doc file, backslash-continued lines joined into one."""
    text = (REPO / rel).read_text()
    if rel.endswith(".md"):
        text = "\n".join(re.findall(r"^```bash\n(.*?)^```", text, re.DOTALL | re.MULTILINE))
    else:
        text = re.sub(r"^[ \t]*#", "", text, flags=re.MULTILINE)  # commands in comments
    text = re.sub(r"\\\n\s*", " ", text)
    # A command line: `ray job submit ...`, maybe after VAR=value assignments.
    return [m.group(1) for m in re.finditer(r"^\s*(?:[A-Z_]+=\S*\s+)*(ray job submit\b.*)$", text, re.MULTILINE)]


def test_documented_job_commands_are_plain_train_commands(monkeypatch):
    """Every documented job runs ``fedrod-ray train`` itself (no wrapper script, no ``--address auto``),
    and inside a job, where the job supervisor sets RAY_ADDRESS, it trains on Ray."""
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # what a job's driver sees
    commands = {rel: _job_submit_commands(rel) for rel in DOC_FILES}
    assert commands["README.md"] and commands["docs/ray.md"] and commands["deploy/README.md"], commands
    assert sum(map(len, commands.values())) >= 6, commands
    for rel, cmds in commands.items():
        assert "deploy/job.py" not in (REPO / rel).read_text(), f"{rel} mentions the removed deploy/job.py"
        for cmd in cmds:
            submit, _, entrypoint = cmd.partition(" -- ")
            argv = shlex.split(entrypoint, comments=True)
            assert argv[:2] == ["fedrod-ray", "train"], f"{rel}: {cmd}"
            submit_argv = shlex.split(submit, comments=True)
            if "--runtime-env" in submit_argv:
                assert (REPO / submit_argv[submit_argv.index("--runtime-env") + 1]).is_file(), f"{rel}: {cmd}"
            args, cfg = _parse_train(argv[1:])
            assert args.address is None and args.mode is None, f"{rel}: the job's own cluster is implied"
            assert cfg.runtime.mode == "ray" and cfg.runtime.address is None, f"{rel}: {cmd}"
            assert args.run_dir, f"{rel}: give --run-dir (the job's cwd is a temporary copy)"


# ---------------------------------------------------------------------------------------------------
# KubeRay


def _container_mounts(container: dict) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def _check_pod_template(template: dict, what: str, *, head: bool = False) -> dict:
    pod = template["spec"]
    container = pod["containers"][0]
    assert container["image"].startswith(IMAGE_REPO), f"{what}: image {container['image']}"
    mounts = _container_mounts(container)
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for path, name in mounts.items():
        assert name in volumes, f"{what}: volume {name} mounted at {path} is not defined"
    if head:
        # Job drivers run on the head: the driver reads the dataset (and ships it to the client actors
        # through the object store), and it and the coordinator actor, pinned to its node, write the run
        # directory. Workers need neither volume.
        assert DATA_MOUNT in mounts and RUNS_MOUNT in mounts, f"{what}: mounts {mounts}"
        assert "persistentVolumeClaim" in volumes[mounts[RUNS_MOUNT]], f"{what}: runs must outlive the pod"
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get("FEDROD_DATA_DIR") == DATA_MOUNT, f"{what}: FEDROD_DATA_DIR {env.get('FEDROD_DATA_DIR')}"
    return container


def _check_ray_cluster_spec(spec: dict, *, need_gpu_group: bool) -> None:
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    head_container = _check_pod_template(head["template"], "head", head=True)
    assert head_container["image"] == IMAGE_REPO + "0.1.0"
    ports = {p["containerPort"] for p in head_container.get("ports", [])}
    assert {6379, 8265} <= ports, ports

    ray_tag = re.search(r"^ARG RAY_TAG=(\d+\.\d+\.\d+)", _dockerfile(), re.MULTILINE).group(1)
    assert spec["rayVersion"] == ray_tag, "rayVersion must match the image's Ray"

    groups = spec["workerGroupSpecs"]
    assert groups
    assert len({g["groupName"] for g in groups}) == len(groups)
    gpu_groups = []
    for g in groups:
        name = g["groupName"]
        assert isinstance(g["rayStartParams"], dict), name
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], name
        assert g["maxReplicas"] >= 1, name
        container = _check_pod_template(g["template"], name)
        limits = container["resources"]["limits"]
        assert float(limits["cpu"]) >= 1 and limits["memory"], name
        if "nvidia.com/gpu" in limits:
            assert int(limits["nvidia.com/gpu"]) >= 1, name
            assert container["image"].endswith("-gpu"), f"{name}: a GPU group needs the CUDA image"
            gpu_groups.append(name)
    if need_gpu_group:
        assert gpu_groups, "no worker group with an nvidia.com/gpu limit"
    assert any("nvidia.com/gpu" not in g["template"]["spec"]["containers"][0]["resources"]["limits"]
               for g in groups), "no CPU worker group"


def test_raycluster_manifest():
    rc = _yaml("kuberay/raycluster.yaml")
    assert rc["apiVersion"] == "ray.io/v1" and rc["kind"] == "RayCluster"
    assert rc["metadata"]["name"]
    _check_ray_cluster_spec(rc["spec"], need_gpu_group=True)


def test_rayjob_manifest_runs_a_valid_train_command(monkeypatch):
    from ray.runtime_env import RuntimeEnv

    rj = _yaml("kuberay/rayjob.yaml")
    assert rj["apiVersion"] == "ray.io/v1" and rj["kind"] == "RayJob"
    assert rj["metadata"]["name"]
    spec = rj["spec"]
    entrypoint = spec["entrypoint"]
    argv = shlex.split(entrypoint)
    assert argv[:2] == ["fedrod-ray", "train"] and "--address" not in argv
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fedrod-ray"] == "fedrod_ray.cli:main"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # set for every job's driver by the job supervisor
    args, cfg = _parse_train(argv[1:])
    assert cfg.runtime.mode == "ray" and cfg.runtime.address is None
    assert args.data_dir == DATA_MOUNT, "the dataset is read from the head's volume"
    assert args.run_dir and args.run_dir.startswith(RUNS_MOUNT + "/"), "the run dir must be on the shared volume"

    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec["ttlSecondsAfterFinished"], int) and spec["ttlSecondsAfterFinished"] >= 0
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert isinstance(runtime_env, dict)
    # The submitter pod runs the head's image: the working dir is the image's copy of the project.
    assert runtime_env["working_dir"] == _docker_workdir()
    assert all(isinstance(v, str) for v in runtime_env["env_vars"].values())
    assert "torch" not in {_req_name(r) for r in runtime_env.get("pip", [])}
    # Ray's own validation (less working_dir: it exists only inside the image).
    RuntimeEnv(**{k: v for k, v in runtime_env.items() if k != "working_dir"})
    _check_ray_cluster_spec(spec["rayClusterSpec"], need_gpu_group=False)


# ---------------------------------------------------------------------------------------------------
# ray up


def test_cluster_launcher_config():
    from ray.autoscaler._private.util import prepare_config, validate_config

    cfg = _yaml("cluster.yaml")
    assert cfg["cluster_name"]
    assert cfg["provider"]["type"] == "aws" and cfg["provider"]["region"]
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    assert isinstance(cfg["max_workers"], int) and cfg["max_workers"] >= 1
    for name, node_type in types.items():
        assert isinstance(node_type["resources"], dict), name
        assert node_type["node_config"]["InstanceType"], name
        if name != cfg["head_node_type"]:
            assert 0 <= node_type["min_workers"] <= node_type["max_workers"] <= cfg["max_workers"], name
    assert any(t["resources"].get("GPU", 0) >= 1 for t in types.values()), "no GPU node type"
    assert cfg["docker"]["image"].startswith(IMAGE_REPO)
    # The checkout is synced over the image's copy and installed there.
    assert cfg["file_mounts"] == {_docker_workdir(): "."}
    assert any("pip install" in c and _docker_workdir() in c for c in cfg["setup_commands"])
    assert any("ray start --head" in c for c in cfg["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c for c in cfg["worker_start_ray_commands"])
    run_options = " ".join(cfg["docker"]["run_options"])
    assert f"{DATA_MOUNT}:{DATA_MOUNT}" in run_options and f"{RUNS_MOUNT}:{RUNS_MOUNT}" in run_options
    assert "RAY_AUTH_MODE=" in run_options

    # Ray's own schema check, as `ray up` runs it (unknown keys and bad node types fail here).
    validate_config(prepare_config(copy.deepcopy(cfg)))


# ---------------------------------------------------------------------------------------------------
# runtime env


def test_runtime_env_yaml():
    from ray.runtime_env import RuntimeEnv

    env = _yaml("runtime_env.yaml")
    assert env["working_dir"] == "."
    assert "runs/" in env["excludes"] and any(e.strip("/") == ".git" for e in env["excludes"])
    env_vars = env["env_vars"]
    assert env_vars["RAY_USAGE_STATS_ENABLED"] == "0"
    # The job command names its dataset directory (--data-dir); a value here would override the head's own
    # FEDROD_DATA_DIR for a command that does not.
    assert "FEDROD_DATA_DIR" not in env_vars
    assert env_vars["OMP_NUM_THREADS"] == "1"
    assert all(isinstance(v, str) for v in env_vars.values()), "Ray needs string env var values"

    pip = env["pip"]
    assert not any(re.match(r"\s*torch\s*(==|$)", r) for r in pip)
    names = {_req_name(r) for r in pip}
    deps = {_req_name(d) for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert names & NOT_IN_JOB_PIP == set()
    assert names == deps - NOT_IN_JOB_PIP, "runtime_env pip must list the project's job dependencies"

    RuntimeEnv(**env)  # Ray's own validation of the fields


def test_runtime_env_excludes_keep_code_and_drop_runs_and_data(tmp_path):
    """Package a small tree with Ray's own packager and the excludes of runtime_env.yaml."""
    from zipfile import ZipFile

    from ray._private.runtime_env.packaging import create_package

    root = tmp_path / "proj"
    files = {
        "fedrod_ray/cli.py": True,
        "fedrod_ray/data/files.py": True,  # a package named data/ must survive the data excludes
        "configs/quickstart.yaml": True,
        "deploy/runtime_env.yaml": True,
        "runs/quickstart/metrics.jsonl": False,
        "runs/quickstart/final/model.safetensors": False,
        ".git/HEAD": False,
        "fedrod_ray/__pycache__/cli.cpython-311.pyc": False,
        "data/mnist/train-images-idx3-ubyte.gz": False,
        "data/cifar-10-python.tar.gz": False,
    }
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    pkg = tmp_path / "pkg.zip"
    create_package(str(root), pkg, include_gitignore=False, excludes=_yaml("runtime_env.yaml")["excludes"])
    shipped = {n for n in ZipFile(pkg).namelist() if not n.endswith("/")}
    assert shipped == {rel for rel, keep in files.items() if keep}


# ---------------------------------------------------------------------------------------------------
# Dockerfile


def test_dockerfile():
    text = _dockerfile()
    stages = re.findall(r"^FROM\s+(\S+)", text, re.MULTILINE)
    assert stages and all(s.startswith("rayproject/ray:") for s in stages)
    assert re.search(r"^ARG RAY_TAG=\d+\.\d+\.\d+-py311$", text, re.MULTILINE)
    assert re.search(r"pip install .*torch.*--index-url", text), "torch from its own (CPU/CUDA) index"
    copies = re.findall(r"^COPY\s+(?:--\S+\s+)*(.+)$", text, re.MULTILINE)
    assert copies
    for line in copies:
        *sources, _dest = line.split()
        for src in sources:
            assert src not in (".", "./", "*"), "copying the whole context would bake in runs/ and data"
            assert not re.match(r"(runs|data)(/|$)", src)
            if not re.search(r"[*?\[]", src):
                assert (REPO / src).exists(), f"COPY source {src} missing"
    # The package with its HTTP service: api/ is copied and the serve extra installed.
    assert 'pip install ".[serve]"' in text and re.search(r"^COPY\s+(--\S+\s+)*api ", text, re.MULTILINE)


def test_configs_referenced_by_deploy_files_exist_and_load():
    refs = set()
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            refs |= set(CONFIG_REF.findall(path.read_text()))
    assert {"configs/mnist_paper.yaml", "configs/quickstart.yaml"} <= refs
    for ref in sorted(refs):
        assert (REPO / ref).is_file(), ref
        load_config(REPO / ref)


FMNIST_JOBS = ("main_a0.3", "new_clients", "main_a0.1", "init_a0.3", "seeds_a0.3", "normalize_a0.3", "momentum_a0.3",
               "meta_bsm_a0.3", "meta_bsm_a0.1", "pfl_a0.3", "pfl_a0.1", "pfl_tuned_a0.3", "pfl_tuned_a0.1",
               "pfl_plain_a0.3", "pfl_plain_a0.1", "seeds_a0.1", "seed3_a0.1", "ditto_a0.3", "local_a0.1", "privacy",
               "privacy_epsinf", "sweep_lambda", "fedbabu_sweep", "fedbabu_a0.3", "fedbabu_a0.1",
               "fedbabu_new_clients", "pfedhn_sweep", "pefll_sweep", "pfedhn_a0.3", "pfedhn_a0.1", "pefll_a0.3",
               "pefll_a0.1", "pfedhn_new_clients", "pefll_new_clients")
SWEEPS = {"sweep_lambda": "tune/pfl_lambda.yaml", "fedbabu_sweep": "tune/pfl_fedbabu.yaml",
          "pfedhn_sweep": "tune/pfl_pfedhn.yaml", "pefll_sweep": "tune/pfl_pefll.yaml"}


def test_the_fmnist_queue_runs_valid_reproductions_and_logs_their_exit_status(tmp_path, shared_data_dir):
    """deploy/reproduce_fmnist.sh with a stand-in ``fedrod-ray`` that records its arguments and fails: every
    job's reproduction is one the CLI accepts, every seed it names has a split that trains (FMNIST Dir(0.1)
    seed 2 has not), and each job's log line gives the command's exit status."""
    from fedrod_ray_tune.repro_spec import build_spec, check_splits, parse_seeds, parse_sets

    calls = tmp_path / "calls.jsonl"
    stub = tmp_path / "bin" / "fedrod-ray"
    stub.parent.mkdir()
    stub.write_text(f"#!{sys.executable}\nimport json, sys\n"
                    f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\nsys.exit(3)\n")
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", "BEST_PFL": "FedPer",
           "RAY_TMPDIR": str(tmp_path / "ray")}
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(DEPLOY / "reproduce_fmnist.sh"), str(out), *FMNIST_JOBS], env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    for job in FMNIST_JOBS:
        assert re.search(rf"^=== \S+ {re.escape(job)} exit 3$", (out / f"{job}.log").read_text(),
                         re.MULTILINE), job

    parser = build_parser()
    reproductions = [json.loads(line) for line in calls.read_text().splitlines() if line.startswith('["reproduce"')]
    assert len(reproductions) == len(FMNIST_JOBS) - len(SWEEPS)
    specs = {}
    for job, argv in zip([j for j in FMNIST_JOBS if j not in SWEEPS], reproductions):
        args = parser.parse_args(argv)
        spec = build_spec(args.table, REPO / args.config, parse_seeds(args.seeds), args.rounds,
                          {**parse_sets(args.set), "data.data_dir": str(shared_data_dir)}, None, args.row,
                          args.finetune_epochs)
        specs[job] = spec
        if spec.seeds != [0]:
            assert check_splits(spec), argv
    # A sweep's job runs its sweep file.
    sweeps = [json.loads(line) for line in calls.read_text().splitlines() if line.startswith('["tune"')]
    assert [argv[argv.index("--config") + 1] for argv in sweeps] == list(SWEEPS.values())
    # The new-clients table's own rows, and FedBABU's alone on the same split; FedBABU's main rows at both alphas.
    assert list(specs["new_clients"].rows) == ["FedAvg", "FedDyn", "Fed-RoD (linear)", "Fed-RoD (hyper)"]
    assert list(specs["fedbabu_new_clients"].rows) == ["FedBABU"]
    assert specs["fedbabu_new_clients"].fixed == specs["new_clients"].fixed
    assert specs["fedbabu_new_clients"].row_config("FedBABU", 0).data.new_clients == 50
    for alpha in ("0.3", "0.1"):
        cfg = specs[f"fedbabu_a{alpha}"].row_config("FedBABU", 0)
        assert (cfg.train.head, cfg.data.alpha, cfg.seed) == ("fedbabu", float(alpha), 0)
    # pFedHN's and PeFLL's likewise.
    for job, row, head in (("pfedhn", "pFedHN", "pfedhn"), ("pefll", "PeFLL", "pefll")):
        assert list(specs[f"{job}_new_clients"].rows) == [row]
        assert specs[f"{job}_new_clients"].fixed == specs["new_clients"].fixed
        assert specs[f"{job}_new_clients"].row_config(row, 0).eval.finetune_epochs > 0
        for alpha in ("0.3", "0.1"):
            cfg = specs[f"{job}_a{alpha}"].row_config(row, 0)
            assert (cfg.train.head, cfg.data.alpha, cfg.seed) == (head, float(alpha), 0)


# ---------------------------------------------------------------------------------------------------
# A real job submission


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_cli() -> str | None:
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.is_file() else shutil.which("ray")


def _proc(pid: int) -> tuple[int, int, int, str, str] | None:
    """(ppid, session, start time, state, command line) of a live process, from /proc; None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
    state, ppid, session, start = fields[0], int(fields[1]), int(fields[3]), int(fields[19])
    return None if state in ("Z", "X") else (ppid, session, start, state, cmdline)


def _processes_of(head_pid: int, marker: str) -> dict[int, tuple[int, str]]:
    """The head's process tree, its session, and anything naming the private temp dir: pid -> (start, cmd).

    (Ray's workers retitle themselves ``ray::...``, so the command line alone would miss them.)
    """
    procs = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (info := _proc(int(entry.name))) is not None:
            procs[int(entry.name)] = info
    found = {pid for pid, (_, session, _, _, cmd) in procs.items() if session == head_pid or marker in cmd}
    found |= {head_pid} & procs.keys()
    grew = True
    while grew:  # descendants, even those that left the session
        new = {pid for pid, (ppid, *_) in procs.items() if ppid in found} - found
        found |= new
        grew = bool(new)
    return {pid: (procs[pid][2], procs[pid][4]) for pid in found}


def _still_running(tracked: dict[int, tuple[int, str]]) -> dict[int, str]:
    alive = {}
    for pid, (start, cmd) in tracked.items():
        info = _proc(pid)
        if info is not None and info[2] == start:  # the same process, not a reused pid
            alive[pid] = cmd
    return alive


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def _arg(command: str, flag: str) -> str:
    """The value of ``flag`` in a (backslash-continued) shell command."""
    argv = shlex.split(command.replace("\\\n", " "), comments=True)
    return argv[argv.index(flag) + 1]


def _sub(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"expected {old!r} once in the documented command:\n{text}"
    return text.replace(old, new)


def _head_command(ray_cli: str, ray_tmp: str) -> tuple[list[str], str]:
    """``ray start`` for a private head node (2 CPUs, every port free, its own temp dir) and its dashboard's
    address."""
    dport = _free_port()
    return [
        ray_cli, "start", "--head", "--block", f"--port={_free_port()}", "--num-cpus=2",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dport}",
        f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
        f"--metrics-export-port={_free_port()}", "--object-store-memory=200000000",
        f"--temp-dir={ray_tmp}", "--disable-usage-stats",
    ], f"http://127.0.0.1:{dport}"


def _wait_for_head(ray_cli: str, address: str, env: dict, head: subprocess.Popen, head_log: Path) -> None:
    deadline = time.monotonic() + 180
    while True:
        r = subprocess.run([ray_cli, "job", "list", "--address", address], check=False, env=env,
                           capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            return
        assert head.poll() is None, f"ray start exited {head.returncode}:\n{head_log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"head never answered `ray job list`:\n{r.stderr[-2000:]}"
        time.sleep(1)


def _stop_head(head: subprocess.Popen, ray_tmp: str, tracked: dict[int, tuple[int, str]]) -> dict[int, str]:
    """Stop only this head: its own process group (never `ray stop`, which stops every Ray on the host), then
    whatever it started that outlived it; returns those (killed, but reported)."""
    try:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait(timeout=30)
    except ProcessLookupError:
        pass
    tracked.update(_processes_of(head.pid, ray_tmp))
    deadline = time.monotonic() + 20
    while (leftover := _still_running(tracked)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in leftover:  # clean up after a failure, but still report it
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(ray_tmp, ignore_errors=True)
    return leftover


class Head:
    """A private head node started by ``ray start`` (``_head_command``), shared by the job-submission tests:
    the ``ray`` CLI, its dashboard's address, the environment it runs with, and every process it started that
    was seen (``track``), all of which must be gone once it is stopped."""

    def __init__(self, ray_cli: str, tmp: Path):
        self.ray_cli = ray_cli
        # Ray's unix socket paths must stay short: a private temp dir directly under /tmp.
        self.ray_tmp = tempfile.mkdtemp(prefix="frj", dir="/tmp")
        # The head finds no data and no code but through what a job brings (its --data-dir, its runtime env).
        base_env = {k: v for k, v in os.environ.items()
                    if not k.startswith("RAY_") and k not in ("FEDROD_DATA_DIR", "PYTHONPATH")}
        base_env["PATH"] = f"{Path(ray_cli).parent}{os.pathsep}{base_env.get('PATH', '')}"  # the `ray` beside us
        self.base_env = base_env
        # The documented auth setting (docs/ray.md; test_ray_job_submit_to_a_local_head checks the docs say it).
        self.env = {**base_env, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                    # SIGTERM otherwise drains the node for up to 30 s before stopping.
                    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
                    # On a loaded machine the raylet can take longer than the default 60 s to register.
                    "RAY_raylet_start_wait_time_s": "180"}
        head_cmd, self.address = _head_command(ray_cli, self.ray_tmp)
        self.log = tmp / "head.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(head_cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
                                         start_new_session=True)
        self.tracked: dict[int, tuple[int, str]] = {}

    def track(self) -> dict[int, tuple[int, str]]:
        """The head's processes now (``_processes_of``), noted for the check at its stop."""
        procs = _processes_of(self.proc.pid, self.ray_tmp)
        self.tracked.update(procs)
        return procs

    def job(self, *args: str) -> str:
        """``ray job <args>`` against this head: its output."""
        r = subprocess.run([self.ray_cli, "job", *args, "--address", self.address], check=False, env=self.env,
                           capture_output=True, text=True, timeout=60)
        return r.stdout + r.stderr


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """One private head node for this module's job submissions, started once (the first test that needs it
    waits until it answers) and stopped at the end: nothing it started may outlive it."""
    ray_cli = _ray_cli()
    if ray_cli is None:
        pytest.skip("the `ray` CLI is not installed")
    head = Head(ray_cli, tmp_path_factory.mktemp("head"))
    t0 = time.monotonic()
    try:
        _wait_for_head(ray_cli, head.address, head.env, head.proc, head.log)
        yield head
    finally:
        head.track()
        leftover = _stop_head(head.proc, head.ray_tmp, head.tracked)
        print(f"local head started, used and stopped in {time.monotonic() - t0:.1f}s")
    assert not leftover, f"Ray processes outlived their head: {leftover}"


# Lines that must not appear in a healthy job's output (the C++ core's errors read "[... E pid tid] ...").
ERROR_LINE = re.compile(r"Traceback \(most recent call last\)|\bERROR\b|\bE \d+ \d+\]|Error:")


@pytest.mark.slow
def test_ray_job_submit_to_a_local_head(ray_head, tmp_path, shared_data_dir):
    """docs/ray.md's "On a cluster" command (README.md's too), run as written against a private head node
    started here.

    The only changes to the documented text, each one asserted to apply exactly once:
    * its dashboard address -> this head's (an ``export RAY_ADDRESS=...`` would be set in the environment
      instead);
    * ``/mnt/data`` -> the real datasets (``shared_data_dir``, which holds ``mnist/``);
    * ``/mnt/runs`` -> a temporary directory;
    * ``deploy/runtime_env.yaml`` -> a copy without its ``pip:`` list, since creating a virtualenv per
      job needs the network and time that CI does not have (test_runtime_env_yaml checks that list).
    """
    from safetensors.numpy import load_file

    head = ray_head
    section = cluster_section()
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    exports = {}
    for line in block.splitlines():
        if line.startswith("export "):
            exports.update(w.split("=", 1) for w in shlex.split(line[len("export "):], comments=True))
    # The documented auth setting, the one this private head runs with (token auth needs a token on
    # both sides).
    assert exports.get("RAY_AUTH_MODE") == "disabled", exports
    command = re.search(r"^ray job submit (?:.*\\\n)*.*$", block, re.MULTILINE).group(0)
    config = load_config(REPO / _arg(command, "--config"))

    # The head (``ray_head``) runs with that setting; neither it nor the job may find data other than through
    # the command's --data-dir.
    assert head.env["RAY_AUTH_MODE"] == exports["RAY_AUTH_MODE"]

    # The documented command, with its substitutions.
    submit_env = {**head.base_env, **exports}
    if "RAY_ADDRESS" in exports:
        submit_env["RAY_ADDRESS"] = head.address
    else:
        command = _sub(command, "--address http://127.0.0.1:8265", f"--address {head.address}")
    runtime_env = _yaml("runtime_env.yaml")
    runtime_env.pop("pip")
    (tmp_path / "runtime_env.yaml").write_text(yaml.safe_dump(runtime_env))
    command = _sub(command, "deploy/runtime_env.yaml", shlex.quote(str(tmp_path / "runtime_env.yaml")))
    data_dir = shared_data_dir.resolve()
    good = _sub(_sub(command, "/mnt/data", shlex.quote(str(data_dir))), "/mnt/runs", shlex.quote(str(tmp_path / "runs")))
    # The same with an empty data directory, and without a download that a machine with internet access
    # would make.
    empty = tmp_path / "no-data"
    empty.mkdir()
    bad = _sub(_sub(command, "/mnt/data", shlex.quote(str(empty))), "/mnt/runs",
               shlex.quote(str(tmp_path / "runs-no-data")))
    bad += " --set data.download=false"
    run_dir = Path(_arg(good, "--run-dir"))

    ray_job = head.job
    drivers: dict[int, str] = {}  # pid -> PYTHONPATH of the job's entrypoint process
    # Every command line seen, apart from the head's latest: a process on its way out has an empty one.
    titles: set[str] = set()

    def submit(cmd: str, name: str, timeout: float) -> tuple[int, str, str]:
        """Run the documented command through bash from the repository root, noting every process the head
        starts meanwhile (job supervisor, driver, actors); (exit status, its output, the job's id)."""
        out_path = tmp_path / f"{name}.log"
        with open(out_path, "w") as out:
            proc = subprocess.Popen(["bash", "-c", cmd], cwd=REPO, env=submit_env, stdout=out,
                                    stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            procs = head.track()
            titles.update(cmd for _, cmd in procs.values())
            for pid, (_, cmdline) in procs.items():
                if "fedrod-ray train" in cmdline and pid not in drivers:
                    drivers[pid] = _environ(pid).get("PYTHONPATH", "")
            time.sleep(0.5)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        text = out_path.read_text()
        job_id = re.search(r"Job '(\w+)' submitted successfully", text)
        assert job_id, text[-5000:]
        return proc.returncode, text, job_id.group(1)

    # 1. The documented command trains on this head.
    rc, out, job = submit(good, "submit", 420)
    assert rc == 0 and f"Job '{job}' succeeded" in out, out[-5000:]
    assert f"Job '{job}' succeeded" in ray_job("status", job)
    logs = ray_job("logs", job)
    assert "Connecting to existing Ray cluster" in logs, "the driver must join the head, not start a Ray"
    assert "Started a local Ray instance" not in logs
    errors = [line for line in logs.splitlines() if ERROR_LINE.search(line)]
    assert not errors, "error lines in a successful job's output:\n" + "\n".join(errors)

    saved = load_config(run_dir / "config.yaml")
    assert saved.runtime.mode == "ray" and saved.runtime.address is None  # `auto`, resolved in the job
    assert Path(saved.data.data_dir) == data_dir
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [rec["round"] for rec in records] == list(range(1, config.train.rounds + 1))
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert (run_dir / "checkpoints" / latest / "global.safetensors").is_file()
    assert load_file(run_dir / "final" / "model.safetensors")

    # The uploaded working directory, not an installed copy, comes first on the driver's import path.
    assert drivers, "the job's driver was not seen running on this head"
    for pythonpath in drivers.values():
        first = pythonpath.split(os.pathsep)[0]
        assert first.startswith(head.ray_tmp) and "working_dir_files" in first, pythonpath
    for actor in ("ray::CoordinatorImpl", "ray::ClientActorImpl"):
        assert any(c.startswith(actor) for c in titles), f"no {actor} process was seen on this head"

    # 2. Without the dataset: the CLI's one-paragraph error, raised in the driver before Ray starts.
    rc, out, job = submit(bad, "submit-no-data", 120)
    assert rc != 0 and f"Job '{job}' failed" in out, out[-5000:]
    assert f"Job '{job}' failed" in ray_job("status", job)
    logs = ray_job("logs", job)
    lines = logs.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("fedrod-ray: error:")]
    assert len(starts) == 1, logs
    assert lines[starts[0]].startswith(f"fedrod-ray: error: dataset 'mnist' not found: {empty}/mnist "), logs
    ends = [i for i, line in enumerate(lines) if line.startswith("To run offline")]
    assert ends and ends[0] > starts[0] and all(lines[starts[0]:ends[0]]), f"not one paragraph:\n{logs}"
    assert "Traceback (most recent call last)" not in logs and "ActorDiedError" not in logs, logs
    assert "Connecting to existing Ray cluster" not in logs, logs

    # 3. `ray job stop` sends the driver SIGTERM (then SIGKILL after a few seconds): the job's log
    # carries the line that names the resume command.
    long = _sub(_sub(command, "/mnt/data", shlex.quote(str(data_dir))), "/mnt/runs",
                shlex.quote(str(tmp_path / "runs-stop")))
    # Not evaluated: the stop needs a checkpoint (each round's), and the first comes sooner without round 1's
    # evaluation.
    long = _sub(long, "ray job submit", "ray job submit --no-wait") + " --set train.rounds=500 --set eval.eval_every=500"
    stop_dir = Path(_arg(long, "--run-dir"))
    rc, out, job = submit(long, "submit-stop", 60)
    assert rc == 0, out[-5000:]
    deadline = time.monotonic() + 240
    while not (stop_dir / "checkpoints" / "latest").is_file():
        head.track()
        assert time.monotonic() < deadline, ray_job("logs", job)[-5000:]
        time.sleep(0.5)
    ray_job("stop", job)
    deadline = time.monotonic() + 60
    while f"Job '{job}' was stopped" not in (status := ray_job("status", job)):
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
    logs = ray_job("logs", job)
    said = [line for line in logs.splitlines() if line.startswith("fedrod-ray:")]
    assert said == [f"fedrod-ray: stopped by SIGTERM; continue it with: fedrod-ray train --resume {stop_dir}"], logs


def _example_submit() -> str:
    """The ``ray job submit`` command of docs/data.md's "Your own data and model" section."""
    section = doc_section("docs/data.md", "Your own data and model")
    blocks = re.findall(r"```bash\n(.*?)```", section, re.DOTALL)
    return next(re.search(r"^ray job submit (?:.*\\\n)*.*$", b, re.MULTILINE).group(0)
                for b in blocks if "ray job submit" in b)


@pytest.mark.slow
def test_ray_job_submit_of_the_example_package(ray_head, tmp_path):
    """docs/data.md's example job, run as written from a copy of examples/ against a private head node: the
    user's factory and data travel with the job's working_dir, the driver and the client actors import the
    factory, and the run's final/ names it. The only changes: the dashboard address, /mnt/runs, and this
    checkout's fedrod_ray in the runtime env's py_modules."""
    head = ray_head
    example = tmp_path / "examples"
    shutil.copytree(REPO / "examples", example, ignore=shutil.ignore_patterns("__pycache__", "data", "runs"))
    gen = subprocess.run([sys.executable, "-m", "fedrod_example.data", "data/example"], cwd=example,
                         capture_output=True, text=True, timeout=120, check=False)
    assert gen.returncode == 0, gen.stderr

    # The job uploads only examples/, and runs the fedrod-ray the cluster has installed; here that must be
    # this checkout, shipped with the job as a py_modules entry of the copy's runtime env.
    runtime_env = yaml.safe_load((example / "runtime_env.yaml").read_text())
    runtime_env["py_modules"] = [str(REPO / "fedrod_ray")]
    (example / "runtime_env.yaml").write_text(yaml.safe_dump(runtime_env))
    command = _sub(_example_submit(), "--address http://127.0.0.1:8265", f"--address {head.address}")
    command = _sub(command, "/mnt/runs", shlex.quote(str(tmp_path / "runs")))
    run_dir = Path(_arg(command, "--run-dir"))
    seen: dict[int, tuple[int, str]] = {}  # the head's processes while this job ran
    for _ in range(5):
        proc = subprocess.Popen(["bash", "-c", command], cwd=example, env=head.env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 420
        while proc.poll() is None and time.monotonic() < deadline:
            seen.update(head.track())
            time.sleep(0.5)
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
        # The head answers `ray job list` before its job agent is up (slow on a loaded machine): the
        # submission was refused, nothing ran, and it is tried again.
        if "No available agent to submit job" not in out:
            break
        time.sleep(5)
    job = re.search(r"Job '(\w+)' submitted successfully", out)
    assert proc.returncode == 0 and job and f"Job '{job.group(1)}' succeeded" in out, out[-5000:]
    assert "Connecting to existing Ray cluster" in out and "Started a local Ray instance" not in out
    errors = [line for line in out.splitlines() if ERROR_LINE.search(line)]
    assert not errors, "error lines in a successful job's output:\n" + "\n".join(errors)
    cmds = [cmd for _, cmd in seen.values()]
    assert any(c.startswith("ray::ClientActorImpl") for c in cmds), "no client actor ran on this head"

    saved = load_config(run_dir / "config.yaml")
    assert saved.runtime.mode == "ray" and saved.model.arch == "fedrod_example.model:small_cnn"
    assert saved.data.dataset == "folder" and saved.data.partition == "natural"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == list(range(1, saved.train.rounds + 1))
    meta = json.loads((run_dir / "final" / "meta.json").read_text())
    assert meta["arch"] == "fedrod_example.model:small_cnn" and meta["class_names"][0] == "class_a"
