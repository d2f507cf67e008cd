"""Deployment files: manifests that parse and agree with the CLI and with each other, and a real
``ray job submit`` of ``deploy/job.py`` to a private local head node."""

from __future__ import annotations

import copy
import importlib.util
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
# Provided by the image (deploy/Dockerfile), or needed only by the HTTP service, not by training jobs.
NOT_IN_JOB_PIP = {"torch", "ray", "fastapi", "uvicorn"}


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


def _load_job_module():
    spec = importlib.util.spec_from_file_location("fedrod_deploy_job", DEPLOY / "job.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parse_train(argv: list[str]):
    """Parse ``fedrod-ray`` arguments exactly as the CLI does; returns (args, config)."""
    args = build_parser().parse_args(argv)
    assert args.command == "train"
    return args, load_config(REPO / args.config, _overrides(args))


# ---------------------------------------------------------------------------------------------------
# deploy/job.py


def test_job_entry_joins_the_cluster_with_address_auto():
    job = _load_job_module()
    argv = job.job_argv(["--config", "configs/quickstart.yaml", "--set", "train.rounds=2"])
    assert argv == ["train", "--config", "configs/quickstart.yaml", "--set", "train.rounds=2",
                    "--address", "auto"]
    args, cfg = _parse_train(argv)
    assert cfg.runtime.mode == "ray" and cfg.runtime.address == "auto" and cfg.train.rounds == 2

    # An explicit address wins, in either spelling.
    for given in (["--address", "ray://head:10001"], ["--address=ray://head:10001"]):
        argv = job.job_argv(["--config", "configs/quickstart.yaml", *given])
        assert argv.count("auto") == 0
        _, cfg = _parse_train(argv)
        assert cfg.runtime.address == "ray://head:10001" and cfg.runtime.mode == "ray"

    # --resume takes no --config; the address is still added.
    args = build_parser().parse_args(job.job_argv(["--resume", "/mnt/runs/x"]))
    assert args.resume == "/mnt/runs/x" and args.address == "auto"


# ---------------------------------------------------------------------------------------------------
# KubeRay


def _container_mounts(container: dict) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def _check_pod_template(template: dict, what: str) -> dict:
    pod = template["spec"]
    container = pod["containers"][0]
    assert container["image"].startswith(IMAGE_REPO), f"{what}: image {container['image']}"
    mounts = _container_mounts(container)
    assert DATA_MOUNT in mounts and RUNS_MOUNT in mounts, f"{what}: mounts {mounts}"
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for path, name in mounts.items():
        assert name in volumes, f"{what}: volume {name} mounted at {path} is not defined"
    assert "persistentVolumeClaim" in volumes[mounts[RUNS_MOUNT]], f"{what}: run dirs must be shared"
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    assert env.get("FEDROD_DATA_DIR") == DATA_MOUNT, f"{what}: FEDROD_DATA_DIR {env.get('FEDROD_DATA_DIR')}"
    return container


def _check_ray_cluster_spec(spec: dict, *, need_gpu_group: bool) -> None:
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    head_container = _check_pod_template(head["template"], "head")
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


def test_rayjob_manifest_runs_a_valid_train_command():
    from ray.runtime_env import RuntimeEnv

    rj = _yaml("kuberay/rayjob.yaml")
    assert rj["apiVersion"] == "ray.io/v1" and rj["kind"] == "RayJob"
    assert rj["metadata"]["name"]
    spec = rj["spec"]
    entrypoint = spec["entrypoint"]
    assert "fedrod-ray train" in entrypoint and "--address auto" in entrypoint
    argv = shlex.split(entrypoint)
    assert argv[0] == "fedrod-ray"
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fedrod-ray"] == "fedrod_ray.cli:main"
    args, cfg = _parse_train(argv[1:])
    assert cfg.runtime.mode == "ray" and cfg.runtime.address == "auto"
    assert args.run_dir and args.run_dir.startswith(RUNS_MOUNT + "/"), "the run dir must be on the shared volume"

    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec["ttlSecondsAfterFinished"], int) and spec["ttlSecondsAfterFinished"] >= 0
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert isinstance(runtime_env, dict)
    # The submitter pod runs the head's image: the working dir is the image's copy of the project.
    assert runtime_env["working_dir"] == _docker_workdir()
    assert runtime_env["env_vars"]["FEDROD_DATA_DIR"] == DATA_MOUNT
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
    assert env_vars["FEDROD_DATA_DIR"] == DATA_MOUNT
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
        "deploy/job.py": True,
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
    assert "pip install ." in text


def test_configs_referenced_by_deploy_files_exist_and_load():
    refs = set()
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            refs |= set(CONFIG_REF.findall(path.read_text()))
    assert {"configs/mnist_paper.yaml", "configs/quickstart.yaml"} <= refs
    for ref in sorted(refs):
        assert (REPO / ref).is_file(), ref
        load_config(REPO / ref)


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


@pytest.mark.slow
def test_ray_job_submit_to_a_local_head(tmp_path):
    from safetensors.numpy import load_file

    ray_cli = _ray_cli()
    if ray_cli is None:
        pytest.skip("the `ray` CLI is not installed")

    # Ray's unix socket paths must stay short: a private temp dir directly under /tmp.
    ray_tmp = tempfile.mkdtemp(prefix="frj", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({
        # Token auth (the 2.52+ default once ~/.ray/auth_token exists) must agree on both sides.
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        # SIGTERM otherwise drains the node for up to 30 s before stopping.
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    })
    dport = _free_port()
    address = f"http://127.0.0.1:{dport}"
    head_log = tmp_path / "head.log"
    head_cmd = [
        ray_cli, "start", "--head", "--block", f"--port={_free_port()}", "--num-cpus=2",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dport}",
        f"--ray-client-server-port={_free_port()}", f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}", f"--runtime-env-agent-port={_free_port()}",
        f"--metrics-export-port={_free_port()}", "--object-store-memory=200000000",
        f"--temp-dir={ray_tmp}", "--disable-usage-stats",
    ]
    t0 = time.monotonic()
    with open(head_log, "w") as log:
        head = subprocess.Popen(head_cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path,
                                start_new_session=True)
    tracked: dict[int, tuple[int, str]] = {}
    try:
        deadline = time.monotonic() + 180
        while True:
            r = subprocess.run([ray_cli, "job", "list", "--address", address], check=False, env=env,
                               capture_output=True, text=True, timeout=60)
            if r.returncode == 0:
                break
            assert head.poll() is None, f"ray start exited {head.returncode}:\n{head_log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"head never answered `ray job list`:\n{r.stderr[-2000:]}"
            time.sleep(1)

        runtime_env = _yaml("runtime_env.yaml")
        runtime_env.pop("pip")  # no network here: the dependencies are installed already
        runtime_env.pop("working_dir")  # given by --working-dir
        runtime_env["env_vars"]["FEDROD_DATA_DIR"] = str(tmp_path / "data")
        run_dir = tmp_path / "run"
        sid = f"fedrod-test-{os.getpid()}-{dport}"
        submit_log = tmp_path / "submit.log"
        with open(submit_log, "w") as log:
            submit = subprocess.Popen(
                [ray_cli, "job", "submit", "--address", address, "--submission-id", sid,
                 "--working-dir", str(REPO), "--runtime-env-json", json.dumps(runtime_env), "--",
                 sys.executable, "deploy/job.py", "--config", "configs/synthetic_tiny.yaml",
                 "--run-dir", str(run_dir), "--set", "train.rounds=2"],
                env=env, stdout=log, stderr=subprocess.STDOUT)
        # `ray job submit` blocks until the job ends; meanwhile note every process the head starts
        # (job supervisor, driver, client actors) for the leak check at the end.
        deadline = time.monotonic() + 420
        while submit.poll() is None and time.monotonic() < deadline:
            tracked.update(_processes_of(head.pid, ray_tmp))
            time.sleep(0.5)
        if submit.poll() is None:
            submit.kill()
            submit.wait()
        out = submit_log.read_text()
        r = submit
        assert r.returncode == 0, out[-5000:]
        assert f"Job '{sid}' succeeded" in out, out[-5000:]
        assert "Connecting to existing Ray cluster" in out, "the driver must join the head, not start Ray"
        status = subprocess.run([ray_cli, "job", "status", "--address", address, sid], check=False, env=env,
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0 and f"Job '{sid}' succeeded" in status.stdout + status.stderr

        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [rec["round"] for rec in records] == [1, 2]
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        assert (run_dir / "checkpoints" / latest / "global.safetensors").is_file()
        assert load_file(run_dir / "final" / "model.safetensors")
        saved = load_config(run_dir / "config.yaml")
        assert saved.runtime.mode == "ray" and saved.runtime.address == "auto" and saved.train.rounds == 2

        cmds = [cmd for _, cmd in tracked.values()]
        assert any("deploy/job.py" in cmd for cmd in cmds), "the driver was not seen running on this head"
        infrastructure = ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::JobSupervisor", "ray::IDLE")
        assert any(c.startswith("ray::") and not c.startswith(infrastructure) for c in cmds), \
            "none of the job's actors was seen running on this head"
    finally:
        tracked.update(_processes_of(head.pid, ray_tmp))
        # Stop only this head: its own process group (never `ray stop`, which stops every Ray on the host).
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
        for pid in leftover:  # clean up after a failure, but still report it below
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
        print(f"local head started, used and stopped in {time.monotonic() - t0:.1f}s")
    assert not leftover, f"Ray processes outlived their head: {leftover}"
