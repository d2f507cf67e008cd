"""``fedrod-ray``: what ``train`` prints and writes (in-process and on Ray), refusing to overwrite a run,
config and dataset errors (exit 2, naming the problem), and ``partition``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from served import CLI_WITH_SIGINT

import fedrod_ray
from fedrod_ray.cli import main
from fedrod_ray.config import load_config
from fedrod_ray.drivers.console import RoundProgress
from fedrod_ray.federation_state.checkpoint import load_checkpoint
from fedrod_ray.outputs.lock import LOCK_FILE, exclusive
from fedrod_ray.outputs.storage import RunStorage

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / "configs" / "synthetic_tiny.yaml")
ROUNDS = load_config(CONFIG).train.rounds
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file of a run directory but its lock's, which says who held it last."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}


def assert_round_lines(stdout: str) -> None:
    lines = [ln for ln in stdout.splitlines() if ln.startswith("[round")]
    assert len(lines) == ROUNDS, stdout
    for i, line in enumerate(lines, 1):
        assert line.startswith(f"[round {i:>3}/{ROUNDS}]"), line
        assert "G-FL" in line and "P-FL" in line, line


def assert_summary(stdout: str, run_dir: Path) -> None:
    """The end-of-run summary agrees with metrics.jsonl: final and best accuracies, and where the files are."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    i = stdout.index(f"done: {ROUNDS} rounds (")
    final, best, where = stdout[i:].splitlines()[1:4]
    last = records[-1]
    assert final == (f"  final (round {ROUNDS}): G-FL {100 * last['gfl_gm']:.2f}  P-FL GM {100 * last['pfl_gm']:.2f}"
                     f"  P-FL PM {100 * last['pfl_pm']:.2f}")
    top = max(records, key=lambda r: r["gfl_gm"])
    assert best.startswith(f"  best: G-FL {100 * top['gfl_gm']:.2f} (round {top['round']})")
    assert where.startswith(f"  run directory {run_dir}: metrics.jsonl")


def assert_run_directory(run_dir: Path) -> None:
    cfg = load_config(run_dir / "config.yaml")
    assert cfg.name == "synthetic_tiny" and cfg.data.dataset == "synthetic"
    assert cfg.run_dir == str(run_dir)  # what was used, not null

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))
    for r in records:
        assert {"round", "gfl_gm", "pfl_gm", "pfl_pm"} <= set(r)
        assert all(0.0 <= r[k] <= 1.0 for k in ("gfl_gm", "pfl_gm", "pfl_pm"))

    csv_lines = (run_dir / "metrics.csv").read_text().splitlines()
    assert len(csv_lines) == ROUNDS + 1
    header = csv_lines[0].split(",")
    assert {"round", "gfl_gm", "pfl_gm", "pfl_pm"} <= set(header)
    assert [line.split(",")[header.index("round")] for line in csv_lines[1:]] == [str(i) for i in range(1, ROUNDS + 1)]

    assert (run_dir / "curves.png").read_bytes().startswith(PNG_MAGIC)
    # The checkpoint after round N is round_00000N, as the console counts.
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"round_{ROUNDS:06d}"
    weights = load_file(run_dir / "final" / "model.safetensors")
    assert weights and all(k.startswith(("body", "generic_head")) for k in weights)
    meta = json.loads((run_dir / "final" / "meta.json").read_text())
    assert meta["round"] == ROUNDS and meta["dataset"] == "synthetic" and meta["head"] == "linear"
    assert meta["rule"] == "fedavg" and meta["metrics"]["gfl_gm"] == records[-1]["gfl_gm"]
    # Every client's phi_m, for serving a known client's personalized model.
    heads = load_file(run_dir / "final" / "personal.safetensors")
    cfg_clients = cfg.data.num_clients + cfg.data.new_clients
    assert sorted(heads, key=int) == [str(c) for c in range(cfg_clients)]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """``--set runtime.torch_threads=1`` sets this process's thread count: put it back after each test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> tuple[Path, str]:
    """One in-process ``train`` (one torch thread: this test machine's cores are shared)."""
    run_dir = tmp_path_factory.mktemp("cli") / "D"
    threads = torch.get_num_threads()
    try:
        rc, out, err = run_main(["train", "--config", CONFIG, "--run-dir", str(run_dir),
                                 "--set", "runtime.torch_threads=1"])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0, err
    return run_dir, out


def test_train_prints_rounds_and_writes_run_directory(local_run):
    run_dir, out = local_run
    assert_round_lines(out)
    assert_summary(out, run_dir)
    assert_run_directory(run_dir)


def test_train_refuses_an_existing_run_without_resume(local_run):
    run_dir, _ = local_run
    before = snapshot(run_dir)
    rc, out, err = run_main(["train", "--config", CONFIG, "--run-dir", str(run_dir)])
    assert rc == 2
    assert "--resume" in err and str(run_dir) in err
    assert "[round" not in out
    assert snapshot(run_dir) == before


def test_a_run_directory_in_use_is_refused_and_left_as_it_is(local_run):
    """A second command on a run directory that one holds (outputs/lock.py) stops at once naming the first."""
    run_dir, _ = local_run
    with exclusive(run_dir):
        before = (run_dir / LOCK_FILE).read_bytes(), snapshot(run_dir)
        for argv in (["train", "--resume", str(run_dir)], ["train", "--config", CONFIG, "--run-dir", str(run_dir)]):
            rc, out, err = run_main(argv)
            assert rc == 1 and f"fedrod-ray: {run_dir} is in use by pid {os.getpid()} on " in err, err
            assert "[round" not in out
        assert ((run_dir / LOCK_FILE).read_bytes(), snapshot(run_dir)) == before


def test_resume_takes_no_config(local_run):
    """--resume takes the config saved in the run directory."""
    run_dir, _ = local_run
    rc, _, err = run_main(["train", "--resume", str(run_dir), "--config", CONFIG])
    assert rc == 2 and "drop --config" in err


def test_resume_refuses_a_changed_method_and_takes_more_rounds(local_run, tmp_path):
    run_dir, _ = local_run
    copy = tmp_path / "copy"
    shutil.copytree(run_dir, copy)
    before = snapshot(copy)
    for override, field in (("seed=5", "seed"), ("train.generic_rule=scaffold", "train.generic_rule"),
                            ("data.alpha=0.9", "data.alpha")):
        rc, out, err = run_main(["train", "--resume", str(copy), "--set", override])
        assert rc == 2 and f"{field}: the checkpoint was trained with" in err, err
        assert "[round" not in out
    assert snapshot(copy) == before
    rc, out, err = run_main(["train", "--resume", str(copy), "--set", f"train.rounds={ROUNDS + 1}",
                             "--set", "runtime.torch_threads=1"])
    assert rc == 0, err
    assert [ln.split("]")[0] for ln in out.splitlines() if ln.startswith("[round")] == [
        f"[round {ROUNDS + 1:>3}/{ROUNDS + 1}"]
    records = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 2))
    assert json.loads((copy / "final" / "meta.json").read_text())["round"] == ROUNDS + 1


def test_train_with_scaffold(tmp_path):
    """The method seam from the command line: SCAFFOLD's server and client control variates are checkpointed."""
    run_dir = tmp_path / "S"
    rc, out, err = run_main(["train", "--config", CONFIG, "--run-dir", str(run_dir), "--set",
                             "train.generic_rule=scaffold", "--set", "train.rounds=2",
                             "--set", "runtime.torch_threads=1"])
    assert rc == 0, err
    assert "[round   2/2]" in out
    manifest = json.loads((run_dir / "checkpoints" / "round_000002" / "manifest.json").read_text())
    assert manifest["rule"] == "scaffold"
    server = load_file(run_dir / "checkpoints" / "round_000002" / "global.safetensors")
    assert any(k.startswith("server/scaffold/body.") for k in server)
    clients = load_checkpoint(RunStorage(str(run_dir))).clients
    assert any(any(k.startswith("body.") for k in st.rule_state) for st in clients.values())
    assert json.loads((run_dir / "final" / "meta.json").read_text())["rule"] == "scaffold"


@pytest.mark.slow
def test_config_yaml_records_the_data_directory_used(tmp_path, shared_data_dir, monkeypatch):
    """Found through $FEDROD_DATA_DIR once, the data directory is written into the run's config, so the
    run resumes without the variable."""
    monkeypatch.setenv("FEDROD_DATA_DIR", str(shared_data_dir))
    run_dir = tmp_path / "M"
    # Real MNIST split 100 ways, two clients a round: the point is where the data came from, not training.
    rc, _, err = run_main(["train", "--config", CONFIG, "--run-dir", str(run_dir), "--set", "data.dataset=mnist",
                           "--set", "train.rounds=1", "--set", "data.download=false", "--set", "data.num_clients=100",
                           "--set", "train.client_fraction=0.02", "--set", "runtime.torch_threads=1"])
    assert rc == 0, err
    assert load_config(run_dir / "config.yaml").data.data_dir == str(shared_data_dir.resolve())
    monkeypatch.delenv("FEDROD_DATA_DIR")
    rc, out, err = run_main(["train", "--resume", str(run_dir), "--set", "train.rounds=2",
                             "--set", "runtime.torch_threads=1"])
    assert rc == 0, err
    assert "done: 2 rounds" in out


def test_train_says_what_auto_and_null_chose(tmp_path):
    """The console names what the config left to the run: the torch threads (runtime.torch_threads: auto),
    the network (model.arch: auto) and what each --set key=null left (data.alpha's default, 0.1)."""
    rc, out, err = run_main(["train", "--config", CONFIG, "--run-dir", str(tmp_path / "r"), "--set", "train.rounds=1",
                             "--set", "data.alpha=null"])
    assert rc == 0, err
    lines = out.splitlines()
    assert "--set data.alpha=null: data.alpha takes its default, 0.1" in lines
    assert "model.arch: auto -> mnist_cnn (for 1 x 28 x 28 images)" in lines
    (threads,) = [ln for ln in lines if ln.startswith("torch threads: ")]
    # torch was loaded before main() here: no wait policy to set, so a busy machine gets the free cores.
    assert re.fullmatch(rf"torch threads: {torch.get_num_threads()} \(auto: \d+ cores, load average [\d.]+: "
                        r"(a thread per core|the cores it leaves free)\)", threads)


def test_auto_threads_take_the_cores_the_load_leaves_free():
    from fedrod_ray.drivers.threads import choose_threads, free_cores

    assert [free_cores(2, load) for load in (0.0, 0.3, 0.6, 1.7, 7.0)] == [2, 2, 1, 1, 1]
    assert [free_cores(16, load) for load in (0.2, 3.2, 15.9, 40.0)] == [16, 13, 1, 1]
    assert choose_threads(3) == (3, "runtime.torch_threads")
    assert choose_threads(0) == (None, "runtime.torch_threads: 0, torch's default")


@pytest.mark.parametrize(("load", "preset", "policy", "threads", "why"), [
    (0.1, None, None, "cores", "a thread per core"),
    (50.0, None, "PASSIVE", "cores", "a thread per core, sleeping when it waits (OMP_WAIT_POLICY=PASSIVE)"),
    (50.0, "ACTIVE", "ACTIVE", 1, "the cores it leaves free"),  # the user's policy stays
])
def test_auto_threads_sleep_when_waiting_on_a_busy_machine(load, preset, policy, threads, why):
    """What the command line does first: on a busy machine (a faked load average), OpenMP's passive wait
    policy before torch loads, and then a thread per core; idle, torch's default. In a fresh interpreter."""
    code = (f"import os, sys\nos.getloadavg = lambda: ({load}, 0.0, 0.0)\n"
            "from fedrod_ray.drivers import threads\nthreads.passive_if_busy()\nimport torch\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), threads.usable_cores(), *threads.choose_threads(None), sep='|')")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | ({"OMP_WAIT_POLICY": preset} if preset else {})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=120).stdout.strip()
    got_policy, cores, got_threads, got_why = out.split("|")
    assert got_policy == str(policy) and got_threads == (cores if threads == "cores" else str(threads))
    assert got_why == f"auto: {cores} cores, load average {load:.2f}: {why}"


def test_checkpoint_every_and_eval_every(tmp_path):
    """checkpoint_every=2, eval_every=2 over 5 rounds: evaluations after rounds 2, 4 and the last;
    checkpoints after 2, 4 and 5, of which the newest two are kept."""
    run_dir = tmp_path / "E"
    rc, out, err = run_main(["train", "--config", CONFIG, "--run-dir", str(run_dir), "--set", "train.rounds=5",
                             "--set", "runtime.checkpoint_every=2", "--set", "eval.eval_every=2",
                             "--set", "runtime.torch_threads=1"])
    assert rc == 0, err
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records if "gfl_gm" in r] == [2, 4, 5]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["clients", "latest", "round_000004", "round_000005"]
    assert sum("G-FL" in line for line in out.splitlines() if line.startswith("[round")) == 3


def test_a_round_with_too_many_failures_stops_with_exit_code_1(tmp_path):
    """Every client diverges (lr 1e30): the round fails past runtime.max_failed_fraction, and the CLI
    says so in one message, exit code 1, with nothing checkpointed."""
    run_dir = tmp_path / "F"
    rc, out, err = run_main(["train", "--config", CONFIG, "--run-dir", str(run_dir), "--set", "train.lr=1e30",
                             "--set", "runtime.torch_threads=1"])
    assert rc == 1 and "[round   1/" not in out  # no round line: only the failed clients' reports
    assert "[round 1] client 1 failed: LocalTrainingError" in out
    # It stops as soon as the limit is passed: at the third failure of four (max_failed_fraction 0.5).
    assert err.startswith("fedrod-ray: training stopped: round 1: 3 of 4 clients failed")
    assert "LocalTrainingError: non-finite loss" in err and "Traceback" not in err
    assert not (run_dir / "checkpoints").exists()


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_round_progress_rewrites_one_line_on_a_terminal():
    stream = _Stream(tty=True)
    progress = RoundProgress(10, every=30.0, stream=stream)
    log = progress.log(lambda line: stream.write(line + "\n"))
    for done in (0, 1, 1, 2):
        progress.update(3, done, 2)
    log("[round   3/10] the round's line")
    assert stream.getvalue() == ("\r\x1b[K[round   3/10] clients 0/2\r\x1b[K[round   3/10] clients 1/2"
                                 "\r\x1b[K[round   3/10] clients 2/2\r\x1b[K[round   3/10] the round's line\n")


def test_round_progress_prints_plain_lines_at_most_every_interval_elsewhere():
    now = [0.0]
    stream = _Stream(tty=False)
    progress = RoundProgress(10, every=30.0, stream=stream, clock=lambda: now[0])
    for t, done in ((0, 0), (10, 1), (31, 2), (40, 3), (65, 4)):
        now[0] = t
        progress.update(1, done, 4)
    assert stream.getvalue() == ("[round   1/10] clients 2/4 done (31 s)\n"
                                 "[round   1/10] clients 4/4 done (65 s)\n")
    log = progress.log(stream.write)
    log("x")  # nothing to wipe off a plain stream
    assert stream.getvalue().endswith("(65 s)\nx")


def test_train_shows_progress_inside_rounds(tmp_path):
    rc, out, err = run_main(["train", "--config", CONFIG, "--run-dir", str(tmp_path / "P"), "--set", "train.rounds=1",
                             "--set", "runtime.progress_seconds=0", "--set", "runtime.torch_threads=1"])
    assert rc == 0, err
    lines = [ln for ln in out.splitlines() if ln.startswith("[round")]
    assert [ln.split(" done")[0] for ln in lines[:4]] == [f"[round   1/1] clients {k}/4" for k in range(1, 5)]
    assert lines[4].startswith("[round   1/1]") and "G-FL" in lines[4]


def test_version_and_list():
    with pytest.raises(SystemExit) as e, contextlib.redirect_stdout(io.StringIO()) as out:
        main(["--version"])
    assert e.value.code == 0 and out.getvalue().strip() == f"fedrod-ray {fedrod_ray.__version__}"
    rc, out, _ = run_main(["list"])
    assert rc == 0
    lines = dict(line.split(": ", 1) for line in out.splitlines())
    assert lines["datasets (data.dataset)"] == "mnist, fmnist, emnist, cifar10, cifar100, synthetic"
    assert lines["personalization methods (train.head)"] == (
        "none, linear, hyper, fedper, fedrep, lg_fedavg, ditto (train.head_params: lam=0.1), "
        "pfedme (train.head_params: lam=15.0, personal_lr=0.01, inner_steps=5), "
        "perfedavg (train.head_params: beta=0.001), "
        "fedfomo (train.head_params: models=4, epsilon=0.3, epsilon_decay=0.05, val_fraction=0.2), "
        "mtl (train.head_params: lam=0.1), fedbabu (train.head_params: finetune_epochs=5), "
        "pfedhn (train.head_params: embed_dim=None, hidden=100, server_lr=0.001), "
        "pefll (train.head_params: embed_dim=None, hidden=100, server_lr=0.0002, reg_hyper=0.001, "
        "reg_embed=0.001, reg_model=0.0, descriptor_scaling=none), gpfl (train.head_params: lam=0.01, mu=0.1), "
        "fedcp (train.head_params: lam=5.0), "
        "fedala (train.head_params: eta=1.0, rand_percent=80.0, layer_idx=1, threshold=0.1, num_pre_loss=10), "
        "feddbe (train.head_params: momentum=1.0, kl_weight=50.0)")
    assert lines["generic rules (train.generic_rule)"] == (
        "fedavg, feddyn (train.rule_params: alpha=0.01), fedprox (train.rule_params: mu=0.01), local, scaffold")
    assert lines["balanced losses (train.balanced_loss)"] == (
        "bsm (train.gamma), cdt (train.gamma), ce, ldam (train.gamma), reweight, meta_bsm (train.gamma, train.meta_bsm)")


def test_help_shows_no_rest_markup():
    """The docstring that becomes ``--help``'s description is written in reST; a terminal shows it plain."""
    from fedrod_ray.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, text in [("fedrod-ray", parser.format_help())] + [
            (name, command.format_help()) for name, command in sub.choices.items()]:
        assert "``" not in text, (name, text)
    assert "fedrod-ray: train a federation" in " ".join(parser.format_help().split())


HEAVY_MODULES = ("torch", "ray", "fastapi", "uvicorn", "matplotlib", "mlflow", "tensorboard", "pyarrow")


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["tune", "--help"],
                                  ["train", "--config", CONFIG, "--set", "train.lr=-1"],
                                  ["partition", "--config", CONFIG, "--set", "rounds=3"]])
def test_help_and_config_errors_import_nothing_heavy(argv):
    """``--help`` and a config error answer without loading torch, Ray or the servers (seconds on a busy
    machine): the CLI imports them only once a command needs them. Checked in a fresh interpreter."""
    code = ("import sys\nfrom fedrod_ray.cli import main\ntry:\n    rc = main(sys.argv[1:])\n"
            "except SystemExit as e:\n    rc = e.code\n"
            f"print('rc', rc, sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    rc = 0 if "--help" in argv else 2
    assert proc.stdout.splitlines()[-1] == f"rc {rc} []", proc.stdout + proc.stderr


def test_schema_prints_the_committed_json_schema_that_the_shipped_configs_name():
    """fedrod_ray/config.schema.json is what ``fedrod-ray schema`` prints (regenerate it with that command
    when the config changes), and every shipped config points an editor at it."""
    rc, out, _ = run_main(["schema"])
    assert rc == 0
    schema = json.loads(out)
    assert schema["additionalProperties"] is False and set(schema["properties"]) >= {"data", "train", "runtime"}
    train = schema["$defs"]["TrainConfig"]["properties"]
    assert train["generic_rule"]["enum"] == ["fedavg", "fedprox", "feddyn", "scaffold", "local"]
    assert train["lr"]["exclusiveMinimum"] == 0 and train["client_fraction"]["maximum"] == 1
    assert (REPO / "fedrod_ray" / "config.schema.json").read_text() == out
    for path in sorted((REPO / "configs").glob("*.yaml")):
        first = path.read_text().splitlines()[0]
        assert first == "# yaml-language-server: $schema=../fedrod_ray/config.schema.json", path.name


def test_a_near_miss_key_gets_a_suggestion(tmp_path):
    rc, _, err = run_main(["train", "--config", CONFIG, "--run-dir", str(tmp_path / "r"), "--set", "train.gama=0.5"])
    assert rc == 2 and "unknown config key train.gama (did you mean train.gamma?)" in err
    rc, _, err = run_main(["train", "--config", CONFIG, "--run-dir", str(tmp_path / "r"),
                           "--set", "train.generic_rule=scafold"])
    assert rc == 2 and "(did you mean scaffold?)" in err


@contextlib.contextmanager
def sigint_ignored(ignored: bool):
    """This (the parent) process with SIGINT ignored, as under such a harness, while the block runs."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if ignored else None
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, previous)


def first_round_line(proc: subprocess.Popen, timeout: float) -> str:
    """The child's first round line on stdout (after the lines saying what the run chose), or a failure after
    ``timeout`` seconds (never a hang)."""
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            if line.startswith("[round"):
                lines.append(line)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    assert lines, f"no round line on stdout within {timeout} s"
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "parent_ignores_sigint", "rc", "said"), [
    (signal.SIGINT, False, 130, "interrupted"),
    (signal.SIGINT, True, 130, "interrupted"),
    (signal.SIGTERM, False, 143, "stopped by SIGTERM"),
], ids=["ctrl-c", "ctrl-c-under-a-harness-that-ignores-it", "sigterm"])
def test_a_stop_signal_stops_with_one_line_naming_resume(tmp_path, sig, parent_ignores_sigint, rc, said):
    """SIGINT (Ctrl-C) or SIGTERM (ray job stop, Kubernetes, a scheduler) after the first round: exit 130 or
    143, one line on stderr that names the resume command (no traceback), and that command finishes the run."""
    run_dir = tmp_path / "I"
    cmd = [*CLI_WITH_SIGINT, "train", "--config", CONFIG, "--run-dir", str(run_dir),
           "--set", "train.rounds=500", "--set", "runtime.torch_threads=1"]
    with sigint_ignored(parent_ignores_sigint):
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = first_round_line(proc, timeout=120)
        assert first.startswith("[round   1/500]"), first
        deadline = time.monotonic() + 60
        while not (run_dir / "checkpoints" / "latest").is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (run_dir / "checkpoints" / "latest").is_file(), "no checkpoint within 60 s"
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == rc
    assert err.splitlines() == [f"fedrod-ray: {said}; continue it with: fedrod-ray train --resume {run_dir}"]
    done = int((run_dir / "checkpoints" / "latest").read_text().strip()[len("round_"):])
    assert 1 <= done < 500
    before = signal.getsignal(signal.SIGTERM)
    rc, out, err = run_main(["train", "--resume", str(run_dir), "--set", f"train.rounds={done + 1}",
                             "--set", "runtime.torch_threads=1"])
    assert rc == 0, err
    assert f"done: {done + 1} rounds" in out
    # The handler was the run's: this process's SIGTERM action is back to what it was.
    assert signal.getsignal(signal.SIGTERM) is before


def test_resume_needs_a_checkpoint(tmp_path):
    rc, _, err = run_main(["train", "--resume", str(tmp_path)])
    assert rc == 2 and "no checkpoint" in err and str(tmp_path) in err


def test_train_needs_a_config():
    rc, _, err = run_main(["train"])
    assert rc == 2 and "--config" in err


def test_bad_value_names_the_field(tmp_path):
    rc, out, err = run_main(["train", "--config", CONFIG, "--run-dir", str(tmp_path / "r"),
                             "--set", "train.lr=abc"])
    assert rc == 2
    assert "train.lr" in err and "abc" in err
    assert "[round" not in out and not (tmp_path / "r").exists()


def test_unknown_key_names_it(tmp_path):
    rc, _, err = run_main(["train", "--config", CONFIG, "--run-dir", str(tmp_path / "r"),
                           "--set", "train.learning_rate=0.1"])
    assert rc == 2 and "train.learning_rate" in err


def test_missing_dataset_names_directory_and_suggests_synthetic(tmp_path):
    empty = tmp_path / "no_data"
    empty.mkdir()
    rc, out, err = run_main(["train", "--config", CONFIG, "--run-dir", str(tmp_path / "r"),
                             "--set", "data.dataset=mnist", "--data-dir", str(empty), "--set", "data.download=false"])
    assert rc == 2
    assert str(empty / "mnist") in err
    assert "data.dataset=synthetic" in err
    assert "[round" not in out
    assert not (tmp_path / "r").exists()  # a run that never started leaves no run directory


def test_partition_prints_per_client_table():
    rc, out, _ = run_main(["partition", "--config", CONFIG])
    assert rc == 0
    cfg = load_config(CONFIG)
    n = cfg.data.num_clients + cfg.data.new_clients
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["client", "kind", "n"]
    assert lines[0].split()[3:] == [f"c{c}" for c in range(10)]
    rows = [ln.split() for ln in lines[1:n + 1]]
    assert [int(r[0]) for r in rows] == list(range(n))
    assert [r[1] for r in rows] == ["train"] * cfg.data.num_clients + ["new"] * cfg.data.new_clients
    for r in rows:  # n is the sum of the class counts
        assert int(r[2]) == sum(int(v) for v in r[3:])
    per_class = cfg.data.synthetic_train_per_class
    assert sum(int(r[2]) for r in rows) == 10 * per_class
    assert f"clients: {n} ({cfg.data.num_clients} train, {cfg.data.new_clients} new)" in out


@pytest.mark.slow
def test_train_on_ray_subprocess(tmp_path, private_ray_env):
    run_dir = tmp_path / "D"
    cmd = [sys.executable, "-m", "fedrod_ray.cli", "train", "--config", CONFIG, "--run-dir", str(run_dir),
           "--mode", "ray", "--set", "runtime.address=local", "--set", "runtime.torch_threads=1",
           # A loaded machine's slow first round would add a progress line inside it: only round lines here.
           "--set", "runtime.progress_seconds=3600"]
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=private_ray_env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^ray: 2 client actor\(s\) \(any client\), 2 training\(s\) at once", proc.stdout, re.MULTILINE), proc.stdout
    assert_round_lines(proc.stdout)
    assert_summary(proc.stdout, run_dir)
    assert_run_directory(run_dir)
    assert load_config(run_dir / "config.yaml").runtime.mode == "ray"


def test_the_library_never_imports_api_or_tune():
    """api/ and tune/ build on the library, never the reverse: their commands reach the CLI through the
    ``fedrod_ray.commands`` entry point."""
    root = Path(fedrod_ray.__file__).parent
    offending = [f"{path.relative_to(root)}:{n}: {line.strip()}"
                 for path in sorted(root.rglob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1)
                 if re.match(r"\s*(from|import)\s+(api|tune|fedrod_ray_api|fedrod_ray_tune)\b", line)]
    assert not offending, offending
    assert "serve" in build_parser_commands()


def build_parser_commands() -> set[str]:
    from fedrod_ray.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return set(sub.choices)
