"""Published results prove what ran (tune/provenance.py): a folder's runs' own config.yaml agree with its
reproduce.yaml and its results.csv, checked on a tiny folder by hand and on every folder under bench/results;
the folders published before that record are listed in bench/results/unproven.yaml, a list that may only
shrink."""

from __future__ import annotations

import csv
from pathlib import Path

import yaml
from fedrod_ray_tune.provenance import PROVENANCE_FILE, problems, record, run_file
from fedrod_ray_tune.repro_spec import SPEC_FILE, build_spec

from fedrod_ray.config import dump_config

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
UNPROVEN = RESULTS / "unproven.yaml"
# bench/results/unproven.yaml's folders when it was written (issue 61): it may only shrink.
UNPROVEN_AT_START = 47


def _published(folder: Path, tmp_path: Path, rounds_reached: int = 2) -> Path:
    """A published one-row reproduction (FedAvg, seed 0, 2 rounds) whose run wrote its own config.yaml."""
    spec = build_spec("main", REPO / "configs" / "synthetic_tiny.yaml", [0], rounds=2, rows=["FedAvg"])
    folder.mkdir()
    (folder / SPEC_FILE).write_text(yaml.safe_dump(spec.to_dict(), sort_keys=False))
    run = tmp_path / "run"
    run.mkdir()
    config = spec.row_config("FedAvg", 0)
    config.run_dir = str(run)  # where it ran: may differ
    (run / "config.yaml").write_text(dump_config(config))
    (run / "metrics.jsonl").write_text("".join(f'{{"round": {r}}}\n' for r in range(1, rounds_reached + 1)))
    (folder / "results.csv").write_text("row,seed,rounds,status\nFedAvg,0,2,finished\n")
    record(folder, [({"row": "FedAvg", "seed": 0}, run)], "abc1234", "fedrod-ray reproduce ...")
    return folder


def test_a_folder_whose_runs_configs_match_its_spec_proves_its_rows(tmp_path):
    folder = _published(tmp_path / "job", tmp_path)
    assert problems(folder) == []
    doc = yaml.safe_load((folder / PROVENANCE_FILE).read_text())
    assert doc["commit"] == "abc1234"
    assert doc["runs"] == [{"row": "FedAvg", "seed": 0, "round": 2, "config": f"runs/{run_file('FedAvg', 0)}"}]
    assert (folder / doc["runs"][0]["config"]).read_bytes() == (tmp_path / "run" / "config.yaml").read_bytes()


def test_a_run_config_that_differs_from_the_spec_is_named(tmp_path):
    folder = _published(tmp_path / "job", tmp_path)
    ran = folder / "runs" / run_file("FedAvg", 0)
    config = yaml.safe_load(ran.read_text())
    config["train"]["lr"] = 0.5
    ran.write_text(yaml.safe_dump(config))
    assert problems(folder) == ["FedAvg, seed 0: train.lr: reproduce.yaml 0.01, the run 0.5"]


def test_a_round_or_a_run_that_results_csv_does_not_match_is_named(tmp_path):
    folder = _published(tmp_path / "job", tmp_path, rounds_reached=1)
    assert problems(folder) == ["FedAvg, seed 0: results.csv says round 2, provenance.yaml round 1"]
    with open(folder / "results.csv", "a") as f:
        f.write("FedAvg,1,2,finished\n")
    assert "FedAvg, seed 1: has metrics but no run config in provenance.yaml" in problems(folder)
    (folder / PROVENANCE_FILE).unlink()
    assert problems(folder) == ["no provenance.yaml: its rows' configs were never recorded"]


def test_a_sweeps_choice_the_run_did_not_take_is_named(tmp_path):
    folder = _published(tmp_path / "job", tmp_path)
    doc = yaml.safe_load((folder / PROVENANCE_FILE).read_text())
    doc["sweeps"] = {"FedAvg": {"sweep": "s", "trials": "s.csv", "chosen": {"train.lr": 0.05}}}
    (folder / PROVENANCE_FILE).write_text(yaml.safe_dump(doc))
    assert problems(folder) == ["FedAvg, seed 0: train.lr: the sweep chose 0.05, the run has 0.01"]


def _rows(folder: Path) -> list[str]:
    with open(folder / "results.csv", newline="") as f:
        return [f"{r['row']}, seed {r['seed']}" for r in csv.DictReader(f) if r["status"] != "not started"]


def test_every_published_row_proves_its_config_or_is_listed_as_unproven():
    unproven = yaml.safe_load(UNPROVEN.read_text())
    assert len(unproven) <= UNPROVEN_AT_START, "bench/results/unproven.yaml may only shrink"
    folders = [f for f in sorted(RESULTS.glob("*/*")) if (f / SPEC_FILE).is_file() and (f / "results.csv").is_file()]
    assert set(unproven) <= {str(f.relative_to(RESULTS)) for f in folders}
    for folder in folders:
        name, found = str(folder.relative_to(RESULTS)), problems(folder)
        if name in unproven:
            assert found, f"{name}: proves its rows now; remove it from bench/results/unproven.yaml"
            assert unproven[name]["rows"] == _rows(folder), f"{name}: unproven.yaml must name exactly its rows"
        else:
            assert found == [], f"{name}: " + "; ".join(found)
