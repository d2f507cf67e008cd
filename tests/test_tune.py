"""Ray Tune sweeps: the sweep file's checks (before any trial), the objective and the Pareto front by
hand, and real sweeps on the session's Ray: the quickstart, ASHA stopping a trial that cannot learn
(and leaving no actor or placement group behind), best.yaml training as it is, and resume after a kill."""

from __future__ import annotations

import json
import math
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from fedrod_ray_tune.space import load_sweep
from fedrod_ray_tune.sweep import pareto_front, run_sweep, trial_folder, tune_state_readable
from fedrod_ray_tune.trial import RUN_CHECKPOINT_FILE, objective, own_checkpoint, resume_point

from fedrod_ray.cli import main
from fedrod_ray.config import ConfigError, load_config
from fedrod_ray.federation_state.checkpoint import load_checkpoint
from fedrod_ray.models.export import load_final
from fedrod_ray.outputs.storage import RunStorage

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "tune" / "quickstart.yaml"


def sweep_file(tmp_path: Path, **fields) -> Path:
    doc = {"name": "t", "base": str(REPO / "configs" / "synthetic_tiny.yaml"),
           "search": {"train.lr": {"grid": [0.01, 0.05]}}, **fields}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


# --- the sweep file, checked before any trial starts ------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    ({"search": {"train.lrr": {"grid": [0.1]}}}, r"search: .*train\.lrr"),
    ({"search": {"train.lr": {"uniform": [0.1, 0.01]}}}, r"search\.train\.lr\.uniform: low must be below high"),
    ({"search": {"train.lr": {"loguniform": [0.0, 0.1]}}}, r"search\.train\.lr\.loguniform: needs low > 0"),
    ({"search": {"train.lr": {"grid": []}}}, r"search\.train\.lr\.grid: must be a non-empty list"),
    ({"search": {"train.lr": {"normal": [0, 1]}}}, r"search\.train\.lr: must be one of"),
    ({"search": {"train.lr": {"grid": [-1.0]}}}, r"search: train\.lr: must be > 0"),
    ({"search": {"train.gamma": {"grid": [0.5]}}, "set": {"train.balanced_loss": "ce"}},
     r"search: train\.gamma: has no effect"),
    ({"search": {"train.rule_params.mu": {"grid": [0.1]}}}, r"search: unknown config key train\.rule_params\.mu"),
    ({"metric": "accuracy"}, r"metric: 'accuracy' is not one of"),
    ({"scheduler": "none", "asha": {"grace_period": 2}}, r"asha: has no effect with scheduler: none"),
    ({"num_samples": 0}, r"num_samples: must be an integer >= 1"),
    ({"searhc": {}}, r"searhc: not a sweep setting"),
    ({"resources": {"client_slots": 0}}, r"resources\.client_slots: must be an integer >= 1"),
    ({"set": {"train.rounds": 0}}, r"set: train\.rounds: must be > 0"),
    ({"set": {"runtime.checkpoint_every": 5}},
     r"set\.runtime\.checkpoint_every: has no effect: every trial sets runtime\.checkpoint_every itself \(it check"),
    ({"search": {"runtime.mode": {"grid": ["local"]}}},
     r"search\.runtime\.mode: has no effect: every trial sets runtime\.mode itself \(it runs on its placement"),
    ({"set": {"runtime": {"address": "auto"}}}, r"set\.runtime: has no effect: every trial sets runtime\.mode"),
])
def test_a_bad_sweep_fails_before_any_trial_naming_the_key(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(sweep_file(tmp_path, **fields))


def test_a_sweep_files_setting_without_effect_is_taken_out_as_its_error_says(tmp_path):
    path = sweep_file(tmp_path, scheduler="none", asha={"grace_period": 2})
    with pytest.raises(ConfigError, match=r"asha: .*; remove it, or --set asha=null$"):
        load_sweep(path)
    assert load_sweep(path, ["asha=null"]).scheduler == "none"


@pytest.mark.parametrize("path", sorted((REPO / "tune").glob("*.yaml")), ids=lambda p: p.name)
def test_the_shipped_sweep_files_load(path):
    spec = load_sweep(path)
    assert spec.search and spec.name == path.stem


def test_a_sweep_file_gives_trial_configs_and_the_plain_experiment_config(tmp_path):
    base = yaml.safe_load((REPO / "configs" / "synthetic_tiny.yaml").read_text())
    base.setdefault("runtime", {})["checkpoint_every"] = 5
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = load_sweep(sweep_file(tmp_path, base=str(tmp_path / "base.yaml"),
                                 set={"train.rounds": 2, "eval.eval_every": 2},
                                 search={"train.generic_rule": {"choice": ["fedprox"]},
                                         "train.rule_params.mu": {"loguniform": [0.001, 0.1]}}),
                      ["num_samples=3", "set.train.local_epochs=2"])
    assert spec.num_samples == 3 and spec.fixed["train.local_epochs"] == 2
    params = {"train.generic_rule": "fedprox", "train.rule_params.mu": 0.02}
    plain = spec.experiment_config(params)
    assert plain.train.rule_params == {"mu": 0.02} and plain.train.rounds == 2 and plain.eval.eval_every == 2
    trial = spec.trial_config(params)
    # A trial evaluates every round (its reports feed ASHA), runs on its placement group's actors and
    # checkpoints every round (what each report's Tune checkpoint names).
    assert trial.eval.eval_every == 1 and trial.runtime.mode == "ray" and trial.runtime.clients_per_actor == 0
    assert trial.runtime.checkpoint_every == 1 and plain.runtime.checkpoint_every == 5
    assert spec.bundles() == [{"memory": 512 * 2**20}, {"CPU": 1.0}]
    # What --resume reads back is the same sweep.
    (tmp_path / "saved.yaml").write_text(yaml.safe_dump(spec.to_dict()))
    assert load_sweep(tmp_path / "saved.yaml") == spec
    none = load_sweep(sweep_file(tmp_path, scheduler="none"))
    (tmp_path / "saved.yaml").write_text(yaml.safe_dump(none.to_dict()))
    assert load_sweep(tmp_path / "saved.yaml") == none


def test_with_an_estimate_a_trial_keeps_its_exact_evaluations_as_the_config_says(tmp_path):
    spec = load_sweep(sweep_file(tmp_path, set={"train.rounds": 4, "eval.eval_every": 2, "eval.estimate_size": 100}))
    trial = spec.trial_config({"train.lr": 0.01})
    # ASHA reads the estimate every round; the exact evaluations stay every eval_every and at the last.
    assert trial.eval.eval_every == 2 and trial.eval.estimate_size == 100
    record = {"gfl_gm": 0.6, "pfl_pm": 0.9, "gfl_gm_est": 0.5, "pfl_pm_est": 0.75}
    assert objective(record, "gfl", estimate=True) == 0.5 and objective(record, "pfl_pm", estimate=True) == 0.75
    assert math.isclose(objective(record, "hmean", estimate=True), 2 * 0.5 * 0.75 / 1.25)  # 0.6


@pytest.mark.parametrize("fields, message", [
    ({"metric": "pfl_new_after", "set": {"data.new_clients": 0}}, r"metric: pfl_new_after is the held-out clients' P-FL; set data\.new_clients"),
    ({"metric": "pfl_new_after", "set": {"data.new_clients": 2}}, r"metric: pfl_new_after is measured after fine-t"),
    ({"metric": "pfl_new_before", "set": {"data.new_clients": 2}}, r"scheduler: asha ranks trials every round"),
])
def test_a_sweep_ranked_on_new_clients_needs_them_and_no_asha(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(sweep_file(tmp_path, **fields))
    ok = load_sweep(sweep_file(tmp_path, metric="pfl_new_after", scheduler="none",
                               set={"data.new_clients": 2, "eval.finetune_epochs": 1}))
    assert ok.metric == "pfl_new_after"


def test_a_new_client_metric_is_the_exact_evaluations_never_an_estimate():
    from fedrod_ray_tune.trial import round_objective

    record = {"gfl_gm": 0.6, "pfl_pm": 0.9, "pfl_new_before": 0.7, "pfl_new_after": 0.8, "gfl_gm_est": 0.5}
    assert objective(record, "pfl_new_after") == 0.8 and objective(record, "pfl_new_before", estimate=True) == 0.7
    assert round_objective({"gfl_gm_est": 0.5, "pfl_pm_est": 0.7}, "pfl_new_after", estimate=True) is None


def test_objective_and_pareto_front_by_hand():
    record = {"gfl_gm": 0.6, "pfl_pm": 0.9}
    assert objective(record, "gfl") == 0.6 and objective(record, "pfl_pm") == 0.9
    assert math.isclose(objective(record, "hmean"), 2 * 0.6 * 0.9 / 1.5)  # 0.72
    # (x, y): (1, 5) and (4, 4) and (5, 1) are on the front; (3, 3) is beaten by (4, 4); (4, 4) twice: both.
    assert pareto_front([(1, 5), (3, 3), (4, 4), (5, 1), (4, 4)]) == [0, 2, 3, 4]


# --- real sweeps on the session's Ray ---------------------------------------------------------------


def live_state(ray) -> tuple[set, set]:
    """The ids of the cluster's live actors and placement groups (from the GCS tables)."""
    from ray.util import placement_group_table

    actors = {a for a, info in ray._private.state.actors().items() if info["State"] != "DEAD"}
    groups = {g for g, info in placement_group_table().items() if info["state"] != "REMOVED"}
    return actors, groups


@pytest.mark.slow
def test_quickstart_sweep_and_its_best_config_trains(ray_session, tmp_path, capsys):
    spec = load_sweep(QUICKSTART)
    rows = run_sweep(spec, tmp_path / "sweep")
    assert len(rows) == 4
    assert {(r["train.gamma"], r["train.lr"]) for r in rows} == {(0.5, 0.01), (0.5, 0.05), (1.0, 0.01), (1.0, 0.05)}
    assert [r["objective"] for r in rows] == sorted((r["objective"] for r in rows), reverse=True)
    for name in ("results.csv", "results.md", "pareto.png", "best.yaml", "sweep.yaml"):
        assert (tmp_path / "sweep" / name).is_file(), name
    out = capsys.readouterr().out
    assert out.count("trial train.gamma=") == 4  # a line per finished trial
    for trial in (p.parent for p in (tmp_path / "sweep" / "trials").glob("*/trial.json")):
        # Tune's checkpoint of the last report names the run's own checkpoint of that round, and holds nothing
        # else: the client states are written once, in the run's files.
        (tune_checkpoint,) = trial.glob("checkpoint_0*")
        assert [p.name for p in tune_checkpoint.iterdir()] == [RUN_CHECKPOINT_FILE]
        named = json.loads((tune_checkpoint / RUN_CHECKPOINT_FILE).read_text())["checkpoint"]
        last_report = json.loads((trial / "result.json").read_text().splitlines()[-1])["round"]
        assert named == (trial / "checkpoints" / "latest").read_text() == f"round_{last_report:06d}"

    best = tmp_path / "sweep" / "best.yaml"
    cfg = load_config(best)
    assert (cfg.train.gamma, cfg.train.lr) == (rows[0]["train.gamma"], rows[0]["train.lr"])
    assert main(["train", "--config", str(best), "--run-dir", str(tmp_path / "best"), "--mode", "local"]) == 0
    assert (tmp_path / "best" / "final" / "meta.json").is_file()


@pytest.mark.slow
def test_asha_stops_a_trial_that_cannot_learn_and_nothing_is_left_behind(ray_session, tmp_path):
    ray = ray_session
    before = live_state(ray)
    # lr 1e-7 cannot learn in 3 rounds. The trials run good, bad, good, bad, at most two at once (two
    # CPUs, one each), so the last one starts after two others have ended, one of them a good one: it
    # reaches round 1 below the rung's median and is stopped there.
    spec = load_sweep(sweep_file(tmp_path, search={"train.lr": {"grid": [0.05, 1e-7]}}, num_samples=2,
                                 set={"train.rounds": 3}, asha={"grace_period": 1, "reduction_factor": 2}))
    rows = run_sweep(spec, tmp_path / "sweep")
    assert len(rows) == 4
    stopped = [r for r in rows if r["status"] == "stopped"]
    assert stopped and all(r["train.lr"] == 1e-7 and r["rounds"] < 3 for r in stopped), rows
    assert all(r["status"] == "finished" and r["rounds"] == 3 for r in rows if r["train.lr"] == 0.05)
    assert rows[0]["train.lr"] == 0.05  # best first
    # final/ is a finished trial's only: a stopped trial has its run's files up to where it stopped.
    trials = sorted(p.parent for p in (tmp_path / "sweep" / "trials").glob("*/params.json"))
    finals = sorted(json.loads((t / "params.json").read_text())["train.lr"] for t in trials if (t / "final").exists())
    assert finals == sorted(r["train.lr"] for r in rows if r["status"] == "finished")
    assert all((t / "metrics.jsonl").is_file() for t in trials)

    # Nothing of the sweep's is left (the actors and groups an earlier test left dying may still go).
    def new_since_before() -> tuple[set, set]:
        actors, groups = live_state(ray)
        return actors - before[0], groups - before[1]

    deadline = time.monotonic() + 30
    while any(new_since_before()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert new_since_before() == (set(), set())


ROUNDS = 3


@pytest.mark.slow
def test_a_sweep_on_the_estimate_reports_it_every_round_and_tables_the_exact_figures(ray_session, tmp_path):
    # synthetic_tiny: 10 classes x 30 test images; the estimate reads 10 of each.
    spec = load_sweep(sweep_file(tmp_path, search={"train.lr": {"grid": [0.05]}}, scheduler="none",
                                 set={"train.rounds": 3, "eval.eval_every": 2, "eval.estimate_size": 100}))
    (row,) = run_sweep(spec, tmp_path / "sweep")
    (result,) = (tmp_path / "sweep" / "trials").glob("*/result.json")
    reports = [json.loads(line) for line in result.read_text().splitlines()]
    assert [r["round"] for r in reports] == [1, 2, 3]
    # Every report: the objective of the estimate; the exact figures at rounds 1 (the estimate's first
    # anchor), 2 (eval_every) and 3 (the last).
    for r in reports:
        assert r["objective"] == objective(r, "hmean", estimate=True)
    assert ["gfl_gm" in r for r in reports] == [True, True, True]
    # The table's objective is the exact one.
    assert row["rounds"] == 3 and row["objective"] == objective(reports[-1], "hmean") == objective(row, "hmean")

    # The trial's folder is a run directory: its run's files, and final/ of its last round, which a resumed
    # run trains on from.
    trial = result.parent
    assert_trial_run_directory(trial, ROUNDS)
    assert load_final(str(trial)).meta.metrics["gfl_gm"] == reports[-1]["gfl_gm"]
    assert main(["train", "--resume", str(trial), "--set", "train.rounds=4"]) == 0
    assert load_final(str(trial)).meta.round == 4


def assert_trial_run_directory(trial: Path, rounds: int) -> None:
    """A trial that ran to its end: config.yaml, a metrics record per round, its checkpoints and final/."""
    assert load_config(trial / "config.yaml").runtime.mode == "ray"
    assert [json.loads(line)["round"] for line in (trial / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, rounds + 1))
    assert (trial / "checkpoints" / "latest").read_text() == f"round_{rounds:06d}"
    assert load_final(str(trial)).meta.round == rounds


def _parses(path: Path) -> bool:
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return True


@pytest.mark.slow
def test_a_killed_sweep_resumes_without_redoing_finished_rounds_or_trials(tmp_path, private_ray_env):
    # Three trials, on two cores two at a time: the third starts when one of the first two has finished.
    # Rounds of 10 local epochs take seconds, so the next report is far off when the kill comes.
    sweep = sweep_file(tmp_path, search={"train.lr": {"grid": [0.01, 0.02, 0.05]}}, scheduler="none",
                       set={"train.rounds": ROUNDS, "train.local_epochs": 10})
    sweep_dir = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "fedrod_ray.cli", "tune", "--config", str(sweep), "--sweep-dir", str(sweep_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=private_ray_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)

    def results() -> list[Path]:
        return sorted((sweep_dir / "trials").glob("*/result.json"))

    def one_finished_one_under_way() -> bool:
        rounds = [len(p.read_text().splitlines()) for p in results()]
        return ROUNDS in rounds and any(0 < n < ROUNDS for n in rounds)

    def state_saved_after_last_checkpoint() -> bool:
        # A trial resumes from the checkpoint the saved state names. Tune writes a report to result.json,
        # then saves its checkpoint and registers it, and saves the experiment's state now and then: killed
        # before the state names a trial's last checkpoint, the trial would go on from an earlier one.
        files = sorted((sweep_dir / "trials").glob("experiment_state-*.json"))
        # Tune rewrites the state file in place: killed while it is half written, the resume finds no state
        # and starts the experiment again, each trial from its run's own last checkpoint (the test below),
        # not from its last report.
        if not files or not _parses(files[-1]):
            return False
        state = json.loads(files[-1].read_text())
        # Per trial: its settings, and its run's (the checkpoint manager, pickled: the names of its
        # checkpoints appear in the bytes, hex-encoded).
        registered = {json.loads(settings)["trial_id"]: json.dumps(run["checkpoint_manager"])
                      for settings, run in ((s, json.loads(r)) for s, r in state["trial_data"])}
        for result in results():
            reports = [json.loads(line) for line in result.read_text().splitlines()]
            if not reports:
                continue
            latest = f"checkpoint_{len(reports) - 1:06d}"
            if not (result.parent / latest).is_dir():
                return False
            if latest.encode().hex() not in registered.get(reports[-1]["trial_id"], ""):
                return False
        return True

    try:
        # Killed once a trial has finished and another has reported a round, as soon as Tune has saved the
        # experiment's state after the last checkpoint (rounds take seconds here: the next one is far off).
        deadline = time.monotonic() + 240
        while not one_finished_one_under_way() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert one_finished_one_under_way(), "no finished trial beside one under way within 240 s"
        deadline = time.monotonic() + 30
        while not state_saved_after_last_checkpoint() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert state_saved_after_last_checkpoint(), "Tune saved no experiment state after the last checkpoint"
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = {p.parent.name: [json.loads(line)["round"] for line in p.read_text().splitlines()] for p in results()}
    private_ray_env.reap_after_killed_driver()

    out = subprocess.run([sys.executable, "-m", "fedrod_ray.cli", "tune", "--resume", str(sweep_dir)], check=False,
                         cwd=REPO, env=private_ray_env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    after = {p.parent.name: [json.loads(line)["round"] for line in p.read_text().splitlines()] for p in results()}
    assert len(after) == 3 and all(rounds[-1:] == [ROUNDS] for rounds in after.values()), (before, after, out.stdout)
    for trial, rounds in before.items():
        # A finished trial is not run again, and a trial goes on from its last reported round.
        assert after[trial][:len(rounds)] == rounds
    for trial, rounds in after.items():  # those started after the kill too: no round twice
        assert rounds == list(range(1, ROUNDS + 1)), (trial, rounds)
        # The trial's own metrics files too: a resumed trial keeps them to its checkpoint's round.
        assert_trial_run_directory(sweep_dir / "trials" / trial, ROUNDS)
    assert (sweep_dir / "results.md").is_file()


def test_a_trial_folder_is_named_by_what_an_experiment_started_again_gives_the_same_trial():
    class Trial:  # what trial_folder reads of Tune's Trial
        trial_id, config = "f443e_00003", {"row": "Fed-RoD (hyper)", "seed": 0}

    assert trial_folder(Trial()) == "trial_00003_row=Fed-RoD_hyper_,seed=0"
    Trial.trial_id = "58481_00003"  # another experiment's id, the same trial
    assert trial_folder(Trial()) == "trial_00003_row=Fed-RoD_hyper_,seed=0"
    Trial.config = {"train.lr": 0.0123456789, "train.head_params.lam": 15.0}
    assert trial_folder(Trial()) == "trial_00003_train.lr=0.01235,train.head_params.lam=15"


def test_tunes_record_of_an_experiment_is_readable_when_its_newest_file_parses(tmp_path):
    assert not tune_state_readable(tmp_path)  # none yet (killed before Tune wrote one)
    (tmp_path / "experiment_state-2026-11-26_21-35-49.json").write_text('{"trial_data": []}')
    assert tune_state_readable(tmp_path)
    (tmp_path / "experiment_state-2026-11-26_22-51-46.json").touch()  # the newest, cut short by a kill
    assert not tune_state_readable(tmp_path)


def test_tunes_record_is_unreadable_when_its_search_state_was_cut_short(tmp_path):
    # The search's state is a pickle that Tune copies into place as it does the experiment's state: a kill
    # mid-copy leaves it short, and Tuner.restore then fails on it (EOFError) and runs nothing of the sweep.
    (tmp_path / "experiment_state-2026-11-26_21-35-49.json").write_text('{"trial_data": []}')
    search = pickle.dumps({"iterators": [], "trial_count": 3})
    (tmp_path / "basic-variant-state-2026-11-26_21-35-49.json").write_bytes(search)
    assert tune_state_readable(tmp_path)
    for cut in (b"", search[:-1]):
        (tmp_path / "basic-variant-state-2026-11-26_22-51-46.json").write_bytes(cut)  # the newest by name
        assert not tune_state_readable(tmp_path)


def test_a_trial_goes_on_from_the_run_checkpoint_its_last_tune_checkpoint_names(tmp_path):
    """Killed after its run committed round 3 but before reporting it, a trial goes on from round 2, the
    round Tune last heard of, so that Tune's reports and the run's files agree; without a Tune checkpoint
    (its experiment started again), or with one of a sweep whose Tune checkpoints held the snapshot itself,
    from the run's own last checkpoint."""
    from ray.tune import Checkpoint

    run_dir = tmp_path / "trial"
    assert main(["train", "--config", str(REPO / "configs" / "synthetic_tiny.yaml"), "--run-dir", str(run_dir),
                 "--mode", "local", "--set", "runtime.checkpoint_every=1"]) == 0
    storage, cfg = RunStorage(str(run_dir)), load_config(run_dir / "config.yaml")
    assert (run_dir / "checkpoints" / "latest").read_text() == "round_000003"
    reported = tmp_path / "tune_checkpoint"
    reported.mkdir()
    (reported / RUN_CHECKPOINT_FILE).write_text(json.dumps({"checkpoint": "round_000002"}))
    snapshot = resume_point(Checkpoint.from_directory(str(reported)), storage, cfg)
    assert snapshot.rounds_done == 2
    assert snapshot.global_shared.keys() == load_checkpoint(storage).global_shared.keys()
    assert resume_point(None, storage, cfg).rounds_done == 3
    cfg.runtime.checkpoint_every = 5  # a trial of a sweep started when trials saved less often: the same trial
    assert resume_point(None, storage, cfg).rounds_done == 3
    (reported / RUN_CHECKPOINT_FILE).unlink()
    (reported / "checkpoints").mkdir()
    assert resume_point(Checkpoint.from_directory(str(reported)), storage, cfg).rounds_done == 3


@pytest.mark.slow
def test_a_sweep_whose_tune_record_was_cut_short_goes_on_from_each_trials_own_checkpoint(
        ray_session, tmp_path, capsys):
    """Tune copies its record of the experiment, and its copies of a trial's reports, into place without a
    rename: a kill mid-copy leaves them empty (seen on a machine stopped under a reproduction). --resume
    then starts the experiment again: the trial lands in its folder and goes on from its run's own last
    checkpoint, to the same figures as the run that was not stopped, and the results are read from the
    run's files."""
    rounds_before = 2
    spec = load_sweep(sweep_file(tmp_path, search={"train.lr": {"grid": [0.05]}}, scheduler="none",
                                 set={"train.rounds": ROUNDS}))
    sweep_dir = tmp_path / "sweep"
    (uninterrupted,) = run_sweep(spec, sweep_dir)
    (trial,) = (p for p in (sweep_dir / "trials").iterdir() if p.is_dir())
    assert trial.name == "trial_00000_train.lr=0.05"
    assert json.loads((trial / "trial.json").read_text()) == {"train.lr": 0.05}
    records = (trial / "metrics.jsonl").read_text().splitlines()
    # As the machine left it: the run's checkpoint of round 2 its latest, round 3 trained but not saved;
    # Tune's files empty.
    (trial / "checkpoints" / "latest").write_text(f"round_{rounds_before:06d}")
    for name in ("final", *(p.name for p in trial.glob("checkpoint_0*"))):
        shutil.rmtree(trial / name)
    for path in [*(sweep_dir / "trials").glob("*.json"), *(trial / n for n in ("params.json", "result.json",
                                                                              "progress.csv"))]:
        path.write_bytes(b"")
    capsys.readouterr()

    (row,) = run_sweep(spec, sweep_dir, resume=True)
    assert "cannot be read" in capsys.readouterr().out
    assert [p.name for p in (sweep_dir / "trials").iterdir() if p.is_dir()] == [trial.name]
    # Tune's reports of the experiment started again: round 3 only.
    assert [json.loads(line)["round"] for line in (trial / "result.json").read_text().splitlines()] == [ROUNDS]
    assert_trial_run_directory(trial, ROUNDS)
    timing = ("seconds", "train_seconds", "virtual_time", "round_virtual_seconds")
    resumed = [{k: v for k, v in json.loads(line).items() if k not in timing}
               for line in (trial / "metrics.jsonl").read_text().splitlines()]
    assert resumed == [{k: v for k, v in json.loads(line).items() if k not in timing} for line in records]
    assert {k: v for k, v in row.items() if k != "status"} == {k: v for k, v in uninterrupted.items() if k != "status"}
    assert row["status"] == uninterrupted["status"] == "finished" and row["best_round"] >= 1

    # The folder's own checkpoint is the trial's only: a run of another config there is an error.
    cfg = spec.trial_config({"train.lr": 0.05})
    cfg.run_dir = RunStorage(str(trial)).uri
    assert own_checkpoint(RunStorage(str(trial)), cfg).rounds_done == ROUNDS
    cfg.train.lr = 0.01
    with pytest.raises(ConfigError, match="holds a run of another config than its trial's"):
        own_checkpoint(RunStorage(str(trial)), cfg)


@pytest.mark.slow
def test_a_sweep_logs_its_trials_with_tunes_tensorboard_and_mlflow_callbacks(ray_session, tmp_path):
    """``tracking.loggers`` in a sweep: Ray Tune's TBXLoggerCallback writes each trial's reports into its
    folder, MLflowLoggerCallback one run per trial into ``<sweep>/mlruns``; both read back agree."""
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec = load_sweep(sweep_file(tmp_path, search={"train.lr": {"grid": [0.05]}}, scheduler="none",
                                 set={"train.rounds": 2, "tracking.loggers": ["tensorboard", "mlflow"]}))
    [row] = run_sweep(spec, tmp_path / "sweep")
    client = MlflowClient(f"sqlite:///{tmp_path / 'sweep' / 'mlruns' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("synthetic_tiny").experiment_id])
    assert run.data.params["train.lr"] == "0.05"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "gfl_gm"))
    assert [step for step, _ in history] == [1, 2]
    assert run.data.tags["metric.gfl_gm"] == "G-FL: the generic model's (GM) accuracy on the balanced test set"
    [events] = list((tmp_path / "sweep" / "trials").glob("*/events.out.tfevents.*"))
    acc = EventAccumulator(str(events.parent), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = acc.Scalars("ray/tune/gfl_gm")
    assert [e.step for e in scalars] == [1, 2]
    assert [e.value for e in scalars] == pytest.approx([value for _, value in history], rel=1e-6)
    assert history[-1][1] == pytest.approx(row["gfl_gm"])


def test_a_sweep_over_natural_clients_of_an_npz(ray_session, tmp_path):
    """The user's own arrays with natural clients, swept like a built-in set: every trial reads data.path."""
    import numpy as np

    rng = np.random.default_rng(0)
    y = np.arange(120) % 3
    x = (rng.integers(0, 60, (120, 28, 28)) + 60 * y[:, None, None]).astype(np.uint8)  # learnable by brightness
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=x[:30], y_test=y[:30], client_train=np.arange(120) % 4)
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump({
        "name": "npz", "data": {"dataset": "arrays", "path": str(tmp_path / "d.npz"), "partition": "natural",
                                "num_clients": 4},
        "train": {"head": "linear", "rounds": 2, "client_fraction": 0.5, "local_epochs": 1, "batch_size": 10}}))
    spec = load_sweep(sweep_file(tmp_path, base=str(base)))
    rows = run_sweep(spec, tmp_path / "sweep")
    assert sorted(r["train.lr"] for r in rows) == [0.01, 0.05]
    assert all(0 <= r["gfl_gm"] <= 1 for r in rows)
    best = load_config(tmp_path / "sweep" / "best.yaml")
    assert best.data.dataset == "arrays" and best.data.partition == "natural"


@pytest.mark.slow
def test_a_sweep_of_the_server_model_methods_trains_each_trial_with_its_server_step(ray_session, tmp_path):
    """pFedHN and PeFLL under Tune: each trial a federation whose server holds and steps its own model (PeFLL's
    exchanges with its clients in the trial), its server learning rate the searched value, metric P-FL (PM)."""
    spec = load_sweep(sweep_file(tmp_path, search={"train.head": {"grid": ["pfedhn", "pefll"]},
                                                   "train.head_params.server_lr": {"grid": [0.001]}},
                                 set={"train.balanced_loss": "ce", "train.rounds": 2}, metric="pfl_pm",
                                     scheduler="none"))  # ASHA may stop the worse trial after round 1
    rows = run_sweep(spec, tmp_path / "sweep")
    assert sorted(r["train.head"] for r in rows) == ["pefll", "pfedhn"]
    assert all(0 <= r["pfl_pm"] <= 1 and r["train.head_params.server_lr"] == 0.001 for r in rows)
    for trial in (p.parent for p in (tmp_path / "sweep" / "trials").glob("*/trial.json")):
        snap = load_checkpoint(RunStorage(str(trial)))
        assert snap.rounds_done == 2 and snap.method_state  # the server's model, checkpointed by the trial
