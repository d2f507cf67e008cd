"""``fedrod-ray reproduce``: every table's rows are valid configs, the checks before any trial (conflicting
--set, seeds, rows), mean ± std and the table by hand, and a tiny reproduction on the session's Ray
(2 rows x 2 seeds x 2 rounds) with its table, results and curves, then resumed without rerunning."""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
from pathlib import Path

import pytest
import yaml
from fedrod_ray_tune.report import format_table, mean_std
from fedrod_ray_tune.repro_spec import SPEC_FILE, build_spec, check_splits, load_spec, parse_seeds, parse_sets
from fedrod_ray_tune.reproduce import reproduce
from fedrod_ray_tune.sweep import start_dir
from fedrod_ray_tune.tables import DP_CLIP_NORM, DP_EPSILONS, FINETUNE_EPOCHS, TABLES

from fedrod_ray.cli import main
from fedrod_ray.config import ConfigError
from fedrod_ray.outputs.lock import exclusive
from fedrod_ray.outputs.plotting import png as png_bytes

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "synthetic_tiny.yaml"
QUICKSTART = REPO / "configs" / "quickstart.yaml"

GENERIC_ROWS = ["FedAvg", "FedProx", "SCAFFOLD", "FedDyn", "local-only", "Fed-RoD (linear)", "Fed-RoD (hyper)",
                "Fed-RoD (hyper) + FedDyn", "Fed-RoD (Meta-BSM)"]
# The paper's personalized-FL block, in its order.
PFL_ROWS = ["MTL", "LG-FedAvg", "FedPer", "Per-FedAvg", "pFedMe", "Ditto", "FedFOMO", "FedRep"]
# The methods built for new clients (FEDROD.md, "Methods that personalize new clients").
NEWCOMER_ROWS = ["FedBABU", "pFedHN", "PeFLL"]
LEADER_ROWS = ["GPFL", "FedCP", "FedALA", "FedDBE"]  # today's strongest personalized-FL methods (issue 62)
MAIN_ROWS = GENERIC_ROWS + PFL_ROWS + NEWCOMER_ROWS + LEADER_ROWS


# --- the tables: every row a valid config -----------------------------------------------------------


def test_the_tables_have_the_papers_rows():
    assert list(TABLES["main"]) == MAIN_ROWS
    assert list(TABLES["ablation"]) == ["FedAvg", "FedAvg (BRM)", "FedAvg (BRM, FT)", "Fed-RoD (linear)",
                                        "Fed-RoD (hyper)"]
    assert list(TABLES["losses"]) == ["CE", "IR", "LDAM", "CDT", "BSM"]
    assert list(TABLES["new-clients"]) == ["FedAvg", "FedDyn", "Fed-RoD (linear)", "Fed-RoD (hyper)", *NEWCOMER_ROWS]
    assert list(TABLES["imbalanced"]) == [f"{r}, IM {im}" for im in (10, 100) for r in GENERIC_ROWS]
    assert list(TABLES["privacy"]) == [f"{m}, ε = {e}" for e in ("∞", 8, 4, 1) for m in ("FedAvg", "Fed-RoD (hyper)")]


def test_the_privacy_tables_rows_are_the_methods_with_and_without_client_level_dp():
    rows, main = TABLES["privacy"], TABLES["main"]
    for method in ("FedAvg", "Fed-RoD (hyper)"):
        assert rows[f"{method}, ε = ∞"] == main[method]  # without DP: the main table's row
        for eps in DP_EPSILONS:
            row = rows[f"{method}, ε = {eps}"]
            assert row == {**main[method], "privacy.enabled": True, "privacy.target_epsilon": eps, "privacy.delta": 1e-5,
                           "privacy.clip_norm": DP_CLIP_NORM, "privacy.sampling": "poisson"}


@pytest.mark.parametrize("base", [TINY, QUICKSTART], ids=lambda p: p.name)
@pytest.mark.parametrize("table", list(TABLES))
def test_every_row_of_every_table_is_a_valid_config(table, base):
    spec = build_spec(table, base, seeds=[0, 3], rounds=2)
    assert list(spec.rows) == list(TABLES[table])
    for label, overrides in TABLES[table].items():
        for seed in (0, 3):
            cfg = spec.row_config(label, seed)
            flat = {"seed": cfg.seed, "train.rounds": cfg.train.rounds, "eval.eval_every": cfg.eval.eval_every,
                    **{f"{s}.{k}": v for s in ("data", "train", "eval", "privacy")
                       for k, v in vars(getattr(cfg, s)).items()}}
            assert (flat["seed"], flat["train.rounds"], flat["eval.eval_every"]) == (seed, 2, 1)
            assert cfg.runtime.mode == "ray"
            for key, value in overrides.items():
                if key not in ("train.rule_params", "train.head_params"):  # {}: defaults, filled in by validation
                    assert flat[key] == value, (label, key)


def test_the_rows_say_what_the_contract_says():
    main, ablation, losses = TABLES["main"], TABLES["ablation"], TABLES["losses"]
    assert main["FedAvg"] == {"train.head": "none", "train.balanced_loss": "ce", "train.generic_rule": "fedavg",
                              "train.rule_params": {}, "train.head_params": {}}
    # The personalized-FL baselines: each its method, with cross-entropy, no generic rule, and plain steps
    # where its updates are its own formulas.
    methods = {"MTL": "mtl", "LG-FedAvg": "lg_fedavg", "FedPer": "fedper", "Per-FedAvg": "perfedavg",
               "pFedMe": "pfedme", "Ditto": "ditto", "FedFOMO": "fedfomo", "FedRep": "fedrep"}
    for label, head in methods.items():
        row = main[label]
        assert (row["train.head"], row["train.balanced_loss"], row["train.generic_rule"]) == (head, "ce", "fedavg")
        plain = head in ("pfedme", "perfedavg")
        assert (row.get("train.momentum"), row.get("train.weight_decay")) == ((0, 0) if plain else (None, None))
    # FedBABU: cross-entropy, its fine-tuning epochs as its sweep chose, and in the new-clients table the same
    # method fine-tuned for the protocol's epochs.
    assert main["FedBABU"] == {"train.head": "fedbabu", "train.balanced_loss": "ce", "train.generic_rule": "fedavg",
                               "train.rule_params": {}, "train.head_params": {"finetune_epochs": 2}}
    assert TABLES["new-clients"]["FedBABU"] == {**main["FedBABU"], "eval.finetune_epochs": FINETUNE_EPOCHS}
    assert main["local-only"]["train.generic_rule"] == "local" and main["local-only"]["train.head"] == "none"
    # pFedHN and PeFLL: their server learning rate and embedding size as their sweeps chose; PeFLL's
    # descriptors standardized, as its sweep ran.
    for label, head, params in (("pFedHN", "pfedhn", {"server_lr": 1e-3, "embed_dim": 13}),
                                ("PeFLL", "pefll", {"server_lr": 5e-4, "embed_dim": 26, "descriptor_scaling": "standardize"})):
        assert (main[label]["train.head"], main[label]["train.balanced_loss"]) == (head, "ce")
        assert main[label]["train.head_params"] == params
        assert TABLES["new-clients"][label] == {**main[label], "eval.finetune_epochs": FINETUNE_EPOCHS}
    # GPFL and FedCP: cross-entropy, their official scripts' values.
    assert main["GPFL"]["train.head_params"] == {"lam": 0.01, "mu": 0.1} and main["GPFL"]["train.head"] == "gpfl"
    assert main["FedCP"]["train.head_params"] == {"lam": 5.0} and main["FedCP"]["train.head"] == "fedcp"
    # FedALA and FedDBE: cross-entropy, the official defaults (p = 1: our head) and the DBE FMNIST script's.
    assert main["FedALA"]["train.head_params"] == {"eta": 1.0, "rand_percent": 80.0, "layer_idx": 1}
    assert main["FedDBE"]["train.head_params"] == {"momentum": 1.0, "kl_weight": 50.0}
    assert main["FedALA"]["train.head"] == "fedala" and main["FedDBE"]["train.head"] == "feddbe"
    assert main["Fed-RoD (hyper) + FedDyn"]["train.generic_rule"] == "feddyn"
    assert (main["Fed-RoD (Meta-BSM)"]["train.head"], main["Fed-RoD (Meta-BSM)"]["train.balanced_loss"]) == (
        "linear", "meta_bsm")
    ft = ablation["FedAvg (BRM, FT)"]
    assert ft["eval.finetune_train"] is True and ft["eval.finetune_epochs"] == FINETUNE_EPOCHS
    assert ft["train.balanced_loss"] == "bsm" and ft["train.head"] == "none"
    assert [r["train.balanced_loss"] for r in losses.values()] == ["ce", "reweight", "ldam", "cdt", "bsm"]
    assert all(r["train.head"] == "linear" for r in losses.values())
    assert all(r["eval.finetune_epochs"] == FINETUNE_EPOCHS for r in TABLES["new-clients"].values())
    assert TABLES["imbalanced"]["FedAvg, IM 100"] == {**main["FedAvg"], "data.imbalance_ratio": 100}


# --- checks before any trial ------------------------------------------------------------------------


def test_seeds_are_a_count_or_a_list():
    assert parse_seeds("3") == [0, 1, 2]
    assert parse_seeds("0,5,7") == [0, 5, 7]
    assert parse_seeds("7,") == [7]
    for bad in ("0", "x", "1,1", "-1,", ""):
        with pytest.raises(ConfigError, match="--seeds"):
            parse_seeds(bad)


@pytest.mark.parametrize("table, sets, kwargs, message", [
    ("main", ["train.head=linear"], {},
     r"--set train\.head: conflicts with row 'FedAvg' of table main, which sets train\.head='none'"),
    ("main", ["train.rule_params.mu=0.1"], {}, r"--set train\.rule_params\.mu: conflicts with row 'FedAvg'"),
    ("imbalanced", ["data.imbalance_ratio=5"], {}, r"--set data\.imbalance_ratio: conflicts with row 'FedAvg, IM 10'"),
    ("ablation", ["eval.finetune_train=true"], {"rows": ["FedAvg (BRM, FT)"]},
     r"--set eval\.finetune_train: conflicts with row 'FedAvg \(BRM, FT\)'"),
    ("main", ["seed=3"], {}, r"--set seed: the seeds come from --seeds"),
    ("main", ["runtime.client_resources={num_cpus: 2}"], {}, r"--set runtime\.client_resources: has no effect"),
    ("main", ["runtime.mode=local"], {}, r"--set runtime\.mode: has no effect"),
    ("main", ["runtime.checkpoint_every=5"], {},
     r"--set runtime\.checkpoint_every: has no effect: every trial sets runtime\.checkpoint_every itself"),
    ("main", ["train.rounds=3"], {"rounds": 2}, r"--set train\.rounds: given twice"),
    ("main", ["train.gama=1"], {}, r"--set: unknown config key train\.gama \(did you mean train\.gamma\?\)"),
    ("main", ["train.lr=fast"], {}, r"--set: train\.lr: expected a number"),
    ("main", ["train.gamma=0.5"], {}, r"row 'FedAvg' of table main: train\.gamma: has no effect"),
    ("main", ["train.lr=-1"], {}, r"row 'FedAvg' of table main: train\.lr: must be > 0"),
    ("new-clients", ["data.new_clients=0"], {}, r"data\.new_clients: the new-clients table needs held-out clients"),
    ("mian", [], {}, r"--table: 'mian' is not one of \['main'"),
    ("main", [], {"rows": ["FedAvg", "FedAVG"]}, r"--row: 'FedAVG' is not a row of table main"),
    ("main", [], {"finetune_epochs": 2}, r"--finetune-epochs: has no effect"),
    ("ablation", [], {"finetune_epochs": 0}, r"--finetune-epochs: must be an integer >= 1"),
    ("main", [], {"resources": {"slots": 2}}, r"--resources: slots is not one of"),
    ("main", [], {"resources": {"client": {"num_cpus": 0.5}}}, r"--resources: client\.num_cpus: a CPU training"),
])
def test_a_bad_reproduction_fails_before_any_trial_naming_it(table, sets, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        build_spec(table, TINY, [0], overrides=parse_sets(sets), **kwargs)


def test_set_rows_finetune_epochs_and_resources_reach_the_trials():
    spec = build_spec("ablation", TINY, [0, 1], rounds=4, overrides=parse_sets(["data.alpha=0.5"]),
                      rows=["Fed-RoD (linear)", "FedAvg (BRM, FT)"], finetune_epochs=2,
                      resources={"client_slots": 2, "client": {"num_cpus": 1}})
    assert list(spec.rows) == ["FedAvg (BRM, FT)", "Fed-RoD (linear)"]  # the table's order
    assert spec.search == {"row": {"grid": list(spec.rows)}, "seed": {"grid": [0, 1]}}
    ft = spec.row_config("FedAvg (BRM, FT)", 1)
    assert (ft.data.alpha, ft.train.rounds, ft.eval.finetune_epochs, ft.eval.finetune_train, ft.seed) == (
        0.5, 4, 2, True, 1)
    assert spec.bundles() == [{"memory": 512 * 2**20}, {"CPU": 1.0}, {"CPU": 1.0}]


def test_mean_std_by_hand():
    # mean 0.85; sample std sqrt((0.05**2 + 0.05**2) / 1) = 0.070711
    assert mean_std([0.9, 0.8]) == "85.00 ± 7.07"
    # mean 0.5; sample std sqrt((0.1**2 + 0 + 0.1**2) / 2) = 0.1
    assert mean_std([0.4, 0.5, 0.6]) == "50.00 ± 10.00"
    assert mean_std([0.123456]) == "12.35"  # one seed: no spread to speak of
    assert mean_std([0.9, math.nan, 0.8]) == "85.00 ± 7.07"  # a seed without the metric is left out
    assert mean_std([]) == "-" and mean_std([math.nan]) == "-"


def record(row: str, seed: int, status: str = "finished", **metrics) -> dict:
    base = {k: math.nan for k in ("gfl_gm", "pfl_gm", "pfl_pm", "pfl_pm_global", "pfl_gm_new", "pfl_new_before",
                                  "pfl_new_after", "pfl_ft", "wall_s")}
    return {"row": row, "seed": seed, "rounds": 2, "eval_round": 2, "status": status, **base, **metrics}


def test_the_table_by_hand():
    spec = build_spec("ablation", TINY, [0, 1], rounds=2, rows=["FedAvg", "FedAvg (BRM, FT)", "Fed-RoD (linear)"])
    records = [
        record("FedAvg", 0, gfl_gm=0.5, pfl_gm=0.4, pfl_pm=0.9, pfl_pm_global=0.4, wall_s=3600.0),
        record("FedAvg", 1, gfl_gm=0.7, pfl_gm=0.6, pfl_pm=0.7, pfl_pm_global=0.6, wall_s=7200.0),
        record("FedAvg (BRM, FT)", 0, gfl_gm=0.6, pfl_gm=0.6, pfl_pm=0.1, pfl_pm_global=0.6, pfl_ft=0.8),
        record("FedAvg (BRM, FT)", 1, gfl_gm=0.6, pfl_gm=0.6, pfl_pm=0.1, pfl_pm_global=0.6, pfl_ft=0.9),
        record("Fed-RoD (linear)", 0, gfl_gm=0.25, pfl_gm=0.5, pfl_pm=0.75, wall_s=900.0),
        record("Fed-RoD (linear)", 1, "error"),
    ]
    lines = format_table(spec, records).splitlines()
    assert lines[0].startswith("Table ablation: base synthetic_tiny.yaml, 2 rounds, seeds 0, 1; mean ± std")
    assert lines[2] == "| method | G-FL (GM) | P-FL (GM) | P-FL (PM) | P-FL (PM, global) | wall (h) |"
    assert lines[4] == "| FedAvg | 60.00 ± 14.14 | 50.00 ± 14.14 | 80.00 ± 14.14 | 50.00 ± 14.14 | 1.50 |"
    # The FT row's P-FL (PM) is pfl_ft, marked, with a footnote.
    assert lines[5] == "| FedAvg (BRM, FT) | 60.00 ± 0.00 | 60.00 ± 0.00 | 85.00 ± 7.07 † | 60.00 ± 0.00 | - |"
    # An errored seed is left out and said so; a metric no seed has is "-".
    assert lines[6] == "| Fed-RoD (linear) (1 of 2 seeds) | 25.00 | 50.00 | 75.00 | - | 0.25 |"
    assert lines[8].startswith(f"† FedAvg (BRM, FT): P-FL (PM) is `pfl_ft`, the global model fine-tuned for "
                               f"{FINETUNE_EPOCHS} epochs")

    new = build_spec("new-clients", TINY, [0], rounds=2, rows=["Fed-RoD (hyper)"], finetune_epochs=3)
    lines = format_table(new, [record("Fed-RoD (hyper)", 0, gfl_gm=0.5, pfl_new_before=0.6, pfl_new_after=0.8)])
    lines = lines.splitlines()
    assert lines[2] == "| method | G-FL (GM) | new clients, before | new clients, after | wall (h) |"
    assert lines[4] == "| Fed-RoD (hyper) | 50.00 | 60.00 | 80.00 | - |"
    assert "fine-tuning it on their own data for 3 epochs" in lines[6]


@pytest.mark.parametrize("seeds", [[0], [0, 1]])
def test_the_curves_legend_sits_beside_the_plots_and_the_titles_count_the_seeds(tmp_path, monkeypatch, seeds):
    """The legend of curves.png covers no curve: it lies outside every plot; one seed is named, not "mean ±
    std over 1 seed(s)"."""
    from fedrod_ray_tune import report

    rows = ["FedAvg", "FedAvg (BRM)", "Fed-RoD (linear)"]
    spec = build_spec("ablation", TINY, seeds, rounds=2, rows=rows)
    curves = {(row, seed): {"round": [1.0, 2.0], "gfl_gm": [0.5 + i / 10, 0.6], "pfl_pm": [0.7, 0.8 - i / 10]}
              for i, row in enumerate(rows) for seed in seeds}
    drawn = []

    def keep(fig, dpi=None):  # the figure, laid out as saved
        drawn.append(fig)
        return png_bytes(fig, dpi)

    monkeypatch.setattr(report, "png", keep)
    report.plot_curves(spec, curves, tmp_path / "curves.png")
    (fig,) = drawn
    legend = fig.axes[-1].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == rows
    box = legend.get_window_extent()
    assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == (["G-FL (GM): seed 0", "P-FL (PM): seed 0"] if len(seeds) == 1 else
                      ["G-FL (GM): mean ± std over 2 seeds", "P-FL (PM): mean ± std over 2 seeds"])
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")


def test_the_personalized_fl_rows_are_read_as_the_paper_reads_them():
    spec = build_spec("main", TINY, [0], rounds=2, rows=["FedAvg", "FedPer", "Per-FedAvg", "Ditto"])
    records = [record(row, 0, gfl_gm=0.5, pfl_gm=0.6, pfl_pm=0.8) for row in spec.rows]
    lines = format_table(spec, records).splitlines()
    assert lines[4] == "| FedAvg | 50.00 | 60.00 | 80.00 | - | - |"
    # No global model: the GM is the mean of the personalized models (the paper's star).
    assert lines[5] == "| FedPer | 50.00 ⋆ | 60.00 ⋆ | 80.00 | - | - |"
    # Per-FedAvg's GM is made to be adapted: no P-FL (GM), as in the paper.
    assert lines[6] == "| Per-FedAvg | 50.00 | - | 80.00 | - | - |"
    assert lines[7] == "| Ditto | 50.00 | 60.00 | 80.00 | - | - |"
    assert lines[9].startswith("⋆ no global model: the GM is the mean of the clients' final personalized models")


def test_an_unfinished_row_says_how_far_it_got():
    spec = build_spec("main", TINY, [0, 1], rounds=100, rows=["FedAvg", "FedProx", "SCAFFOLD", "FedDyn"])
    records = [
        {**record("FedAvg", 0, "incomplete", gfl_gm=0.5, pfl_pm=0.7), "rounds": 37, "eval_round": 20},
        {**record("FedAvg", 1, "incomplete", gfl_gm=0.7, pfl_pm=0.9), "rounds": 25, "eval_round": 20},
        {**record("FedProx", 0, "incomplete"), "rounds": 12, "eval_round": 0},
        {**record("FedProx", 1, "not started"), "rounds": 0, "eval_round": 0},
        {**record("SCAFFOLD", 0, "not started"), "rounds": 0, "eval_round": 0},
        {**record("SCAFFOLD", 1, "not started"), "rounds": 0, "eval_round": 0},
        record("FedDyn", 0, gfl_gm=0.25), {**record("FedDyn", 1, "incomplete", gfl_gm=0.5), "eval_round": 1},
    ]
    lines = format_table(spec, records).splitlines()
    # Never a blank or an extrapolation: the values of the last evaluation, at the round they were measured.
    assert lines[4] == "| FedAvg (not finished: round 37 of 100; values at round 20) | 60.00 ± 14.14 | - | 80.00 ± 14.14 | - | - |"
    assert lines[5] == "| FedProx (not finished: round 12 of 100; not yet evaluated) | - | - | - | - | - |"
    assert lines[6] == "| SCAFFOLD (not started) | - | - | - | - | - |"
    assert lines[7] == "| FedDyn (1 of 2 seeds) | 25.00 | - | - | - | - |"  # finished seeds only, once one has


def test_status_reads_a_running_reproduction_from_its_files(tmp_path, capsys):
    """--status writes the table of a reproduction as far as it got, from each trial's folder, without Ray:
    its searched values (trial.json; Tune's params.json in a folder of an earlier version) and its run's
    rounds (metrics.jsonl, a last line cut short by a kill left out); a row whose clients' updates failed
    says how many, from which round; a trial Tune is still creating is not there yet."""
    out = tmp_path / "repro"
    spec = build_spec("ablation", TINY, [0], rounds=4, rows=["FedAvg", "Fed-RoD (linear)"])
    start_dir(out, SPEC_FILE, spec.to_dict(), "a reproduction", "--out")
    records = {"FedAvg": [{"round": 1, "clients": 4, "clients_failed": 0, "seconds": 1800.0},
                          {"round": 2, "gfl_gm": 0.3, "pfl_pm": 0.4, "personal_loss": None, "clients": 4,
                           "clients_failed": 2, "seconds": 1800.0},
                          {"round": 3, "clients": 4, "clients_failed": 1, "seconds": 1800.0}],
               "Fed-RoD (linear)": []}
    for i, (row, lines) in enumerate(records.items()):
        folder = out / "trials" / f"trial_{i}"
        folder.mkdir(parents=True)
        # Tune's copy, cut short by a kill, beside the trial's own; the earlier version's: Tune's only.
        (folder / "params.json").write_text("" if i == 0 else json.dumps({"row": row, "seed": 0}))
        if i == 0:
            (folder / "trial.json").write_text(json.dumps({"row": row, "seed": 0}))
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"round": 4, "cli')
    # A trial Tune is creating: its params.json is there, still empty.
    (out / "trials" / "trial_2").mkdir()
    (out / "trials" / "trial_2" / "params.json").touch()
    assert main(["reproduce", "--status", str(out)]) == 0
    console = capsys.readouterr().out
    assert "0 of 2 trials finished" in console
    with open(out / "results.csv") as f:
        results = list(csv.DictReader(f))
    assert [(r["row"], r["rounds"], r["eval_round"], r["status"], r["gfl_gm"], r["wall_s"]) for r in results] == [
        ("FedAvg", "3", "2", "incomplete", "0.3", "5400.0"), ("Fed-RoD (linear)", "0", "0", "incomplete", "", "")]
    assert [(r["updates"], r["failed_updates"], r["first_failed_round"]) for r in results] == [
        ("12", "3", "2"), ("0", "0", "0")]
    assert "| FedAvg (not finished: round 3 of 4; values at round 2) ‡ | 30.00 | - | 40.00 | - | 1.50 |" in console
    assert ("‡ FedAvg: sampled clients' local updates failed and were left out of their rounds' averages (seed 0: "
            "3 of 12, the first in round 2)") in console
    assert "| Fed-RoD (linear) (not started) |" in console
    assert (out / "curves.png").read_bytes().startswith(b"\x89PNG")
    # Round by round; a key no round recorded has no column (personal_loss: None where recorded).
    assert (out / "rounds.csv").read_text().splitlines() == [
        "row,seed,round,clients,clients_failed,gfl_gm,pfl_pm,seconds", "FedAvg,0,1,4,0,,,1800.0",
        "FedAvg,0,2,4,2,0.3,0.4,1800.0", "FedAvg,0,3,4,1,,,1800.0"]
    assert main(["reproduce", "--status", str(out), "--seeds", "2"]) == 2
    assert "--status takes the reproduction saved in OUT_DIR; drop --seeds" in capsys.readouterr().err
    assert "no command is running on it" in console

    # A command holding the directory (outputs/lock.py): --status names it; a second command stops at once,
    # before Ray, naming it, and changes nothing.
    with exclusive(out):
        assert main(["reproduce", "--status", str(out)]) == 0
        assert f"running now: pid {os.getpid()} on " in capsys.readouterr().out
        files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
        assert main(["reproduce", "--resume", str(out)]) == 1
        assert f"fedrod-ray: {out.resolve()} is in use by pid {os.getpid()} on " in capsys.readouterr().err
        assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files


def test_a_reproduction_of_an_earlier_version_still_loads(tmp_path):
    """reproduce.yaml keeps the base config with every setting as the version that started it had them: up to
    b37490f, train.meta_bsm at meta_lr 1.0 (since 0.001). --status and --resume still read it: the rows whose
    loss is not meta_bsm never used the section, and the Meta-BSM row runs on with what it started with."""
    out = tmp_path / "repro"
    spec = build_spec("main", TINY, [0], rounds=2, rows=["FedAvg", "Fed-RoD (Meta-BSM)"])
    doc = spec.to_dict()
    doc["base_config"]["train"]["meta_bsm"] = {"meta_lr": 1.0, "meta_per_class": 10, "hidden": 7}
    start_dir(out, SPEC_FILE, doc, "a reproduction", "--out")
    (out / "trials").mkdir()
    loaded = load_spec(out)
    assert loaded.row_config("FedAvg", 0).train.meta_bsm == spec.row_config("FedAvg", 0).train.meta_bsm
    meta = loaded.row_config("Fed-RoD (Meta-BSM)", 0).train.meta_bsm
    assert (meta.meta_lr, meta.hidden) == (1.0, 7)
    # A new reproduction is a user's: the same setting is refused where a row does not use it.
    with pytest.raises(ConfigError, match=r"row 'FedAvg' of table main: train\.meta_bsm\.meta_lr: has no effect"):
        build_spec("main", TINY, [0], rows=["FedAvg", "Fed-RoD (Meta-BSM)"],
                   overrides=parse_sets(["train.meta_bsm.meta_lr=1.0"]))


def test_cli_errors_exit_2_naming_the_problem(tmp_path, capsys):
    args = ["reproduce", "--config", str(TINY), "--seeds", "2", "--out", str(tmp_path / "r")]
    assert main([*args, "--table", "mian"]) == 2
    assert "--table: 'mian' is not one of" in capsys.readouterr().err
    assert main([*args, "--table", "main", "--set", "train.gama=1"]) == 2
    assert "train.gama (did you mean train.gamma?)" in capsys.readouterr().err
    assert main([*args, "--table", "main", "--set", "train.head=linear"]) == 2
    assert "conflicts with row 'FedAvg'" in capsys.readouterr().err
    assert main(["reproduce", "--table", "main", "--config", str(TINY)]) == 2
    assert "reproduce needs --table, --config and --seeds" in capsys.readouterr().err
    assert main(["reproduce", "--resume", str(tmp_path), "--seeds", "3"]) == 2
    assert "drop --seeds" in capsys.readouterr().err
    assert main(["reproduce", "--resume", str(tmp_path)]) == 2
    assert "holds no reproduction" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_seed_whose_split_leaves_a_client_empty_fails_before_any_trial(tmp_path, capsys):
    # Tiny's split at Dir(0.1) leaves client 5 without examples at seed 5 alone of seeds 0-5.
    out = tmp_path / "r"
    assert main(["reproduce", "--table", "main", "--config", str(TINY), "--seeds", "6", "--set", "data.alpha=0.1",
                 "--out", str(out)]) == 2
    assert ("--seeds: seed 5 cannot run row 'FedAvg' of table main: data.min_per_client: this split leaves "
            "client(s) [5] with no examples") in capsys.readouterr().err
    assert not out.exists()
    assert check_splits(build_spec("main", TINY, [0, 1, 2, 3, 4], overrides={"data.alpha": 0.1}))


def test_fmnist_seed_2_at_dir_0_1_is_refused_before_any_trial(shared_data_dir, tmp_path, capsys):
    # The paper's FMNIST split at Dir(0.1), seed 2: client 58 gets no examples (found 6 h into a reproduction).
    out = tmp_path / "r"
    assert main(["reproduce", "--table", "main", "--config", str(REPO / "configs" / "fmnist_paper.yaml"),
                 "--seeds", "0,2", "--row", "FedAvg", "--set", f"data.data_dir={shared_data_dir}",
                 "--out", str(out)]) == 2
    assert "--seeds: seed 2 cannot run row 'FedAvg' of table main: data.min_per_client: this split leaves client(s) " \
           "[58] with no examples" in capsys.readouterr().err
    assert not out.exists()


def test_without_the_data_here_the_splits_are_left_to_the_trials(tmp_path):
    # A driver without the data (a cluster's head node) checks nothing and downloads nothing.
    spec = build_spec("main", REPO / "configs" / "fmnist_paper.yaml", [0], overrides={"data.data_dir": str(tmp_path)})
    assert not check_splits(spec)
    assert list(tmp_path.iterdir()) == []


# --- a real reproduction on the session's Ray -------------------------------------------------------


def trial_rounds(out: Path) -> dict[str, list[int]]:
    return {p.parent.name: [json.loads(line)["round"] for line in p.read_text().splitlines()]
            for p in (out / "trials").glob("*/result.json")}


@pytest.mark.slow
def test_a_tiny_reproduction_writes_its_table_results_and_curves_and_resumes(ray_session, tmp_path, capsys):
    out = tmp_path / "repro"
    rows = ["FedAvg (BRM, FT)", "Fed-RoD (linear)"]
    # Evaluated as the config says: round 2 (the last) only.
    assert main(["reproduce", "--table", "ablation", "--config", str(TINY), "--seeds", "2", "--rounds", "2",
                 "--set", "eval.eval_every=2", "--finetune-epochs", "1", "--row", rows[0], "--row", rows[1],
                 "--out", str(out)]) == 0
    console = capsys.readouterr().out
    # A line per finished trial, counted.
    assert sum(f"/4] {r}, seed {s}: finished, round 2/2: G-FL " in console for r in rows for s in (0, 1)) == 4

    with open(out / "results.csv") as f:
        results = list(csv.DictReader(f))
    assert [(r["row"], r["seed"], r["rounds"], r["status"]) for r in results] == [
        (row, str(seed), "2", "finished") for row in rows for seed in (0, 1)]
    for r in results:
        for key in ("gfl_gm", "pfl_gm", "pfl_pm", "pfl_pm_global", "pfl_gm_new", "pfl_new_before"):
            assert 0 <= float(r[key]) <= 1, (r["row"], key)
        # Fine-tuned (training clients: pfl_ft; new clients: pfl_new_after) only where the row asks.
        finetuned = r["row"] == rows[0]
        assert (r["pfl_ft"] != "") == finetuned and (r["pfl_new_after"] != "") == finetuned
        # Fed-RoD's generic model is FedAvg (BRM)'s: the personalized loss never reaches theta, psi.
        twin = next(t for t in results if t["seed"] == r["seed"] and t["row"] != r["row"])
        assert r["gfl_gm"] == twin["gfl_gm"]

    table = (out / "table.md").read_text()
    assert table in console  # printed at the end too
    lines = table.splitlines()
    for line, row in zip(lines[4:6], rows):
        cells = [c.strip() for c in line.strip("|").split("|")]
        mine = [r for r in results if r["row"] == row]
        pm = "pfl_ft" if row == rows[0] else "pfl_pm"
        expected = [mean_std([float(r[k]) for r in mine]) for k in ("gfl_gm", "pfl_gm", pm, "pfl_pm_global")]
        expected[2] += " †" if row == rows[0] else ""
        wall = f"{statistics.fmean(float(r['wall_s']) for r in mine) / 3600:.2f}"
        assert all(float(r["wall_s"]) > 0 for r in mine)
        assert cells == [row, *expected, wall]
    assert "fine-tuned for 1 epoch (ERM)" in table

    with open(out / "rounds.csv") as f:
        by_round = list(csv.DictReader(f))
    assert [(r["row"], r["seed"], r["round"]) for r in by_round] == [
        (row, str(seed), str(n)) for row in rows for seed in (0, 1) for n in (1, 2)]
    for r in by_round:  # every round's training figures; the accuracies where evaluated, the table's at round 2
        assert float(r["train_loss"]) > 0 and float(r["seconds"]) >= float(r["train_seconds"]) > 0
        assert (r["gfl_gm"] != "") == (r["round"] == "2")
        if r["round"] == "2":
            assert r["gfl_gm"] == next(t["gfl_gm"] for t in results if (t["row"], t["seed"]) == (r["row"], r["seed"]))
    png = (out / "curves.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    saved = yaml.safe_load((out / "reproduce.yaml").read_text())
    assert saved["table"] == "ablation" and list(saved["rows"]) == rows and saved["seeds"] == [0, 1]
    assert saved["rows"][rows[0]]["eval.finetune_epochs"] == 1

    # The directory holds a reproduction: a second run is refused; --resume finds everything finished,
    # reruns nothing and writes the same table.
    with pytest.raises(ConfigError, match="already holds a reproduction; continue it with --resume"):
        reproduce(load_spec(out), out)
    before = trial_rounds(out)
    assert sorted(before.values()) == [[1, 2]] * 4
    for report in (out / "trials").glob("*/result.json"):
        evaluated = [json.loads(line)["round"] for line in report.read_text().splitlines()
                     if "gfl_gm" in json.loads(line)]
        assert evaluated == [2], report
    (out / "table.md").unlink()
    assert main(["reproduce", "--resume", str(out)]) == 0
    assert trial_rounds(out) == before
    assert (out / "table.md").read_text() == table
