"""deploy/reproduce_local.py's choices between its runs: which sweep trial's values the table runs take, and how
they are set in a run's config (the runs themselves are ``fedrod-ray train``'s)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("reproduce_local", ROOT / "deploy" / "reproduce_local.py")
reproduce_local = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reproduce_local)


def _run(folder: Path, records: list[dict], finished: bool) -> None:
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if finished:
        (folder / "final").mkdir()


def test_each_sweep_takes_its_best_finished_trial_by_its_metric_at_the_last_evaluated_round(tmp_path):
    sweeps = [{"sweep": "pfl_a", "metric": "pfl_pm", "name": f"a{i}", "params": {"train.head_params.lam": i}}
              for i in range(3)] + [{"sweep": "pfl_b", "metric": "pfl_pm", "name": "b0", "params": {"x": 1}}]
    # a0: finished, best at round 5 but lower at its last evaluation; a1: finished, best last; a2: the
    # highest, but stopped before its last round; b0: stopped, so sweep b keeps the table's values.
    _run(tmp_path / "a0", [{"round": 5, "gfl_gm": 0.5, "pfl_pm": 0.9}, {"round": 10, "gfl_gm": 0.5, "pfl_pm": 0.6},
                           {"round": 11, "train_loss": 0.1}], True)
    _run(tmp_path / "a1", [{"round": 10, "gfl_gm": 0.5, "pfl_pm": 0.7}], True)
    _run(tmp_path / "a2", [{"round": 7, "gfl_gm": 0.5, "pfl_pm": 0.99}], False)
    _run(tmp_path / "b0", [{"round": 3, "gfl_gm": 0.5, "pfl_pm": 0.8}], False)
    assert reproduce_local.last_record(tmp_path / "a0")["pfl_pm"] == 0.6
    assert reproduce_local.last_record(tmp_path / "missing") == {}
    assert reproduce_local.best_values(sweeps, tmp_path) == {"pfl_a": {"train.head_params.lam": 1}}


def test_chosen_values_are_set_at_their_dotted_keys_in_a_copy_of_the_config():
    config = {"train": {"head": "pfedhn", "head_params": {"hidden": 100, "server_lr": 0.001}}, "seed": 0}
    out = reproduce_local.with_values(config, {"train.head_params.server_lr": 0.01, "train.head_params.embed_dim": 13,
                                               "eval.finetune_epochs": 2})
    assert out == {"train": {"head": "pfedhn", "head_params": {"hidden": 100, "server_lr": 0.01, "embed_dim": 13}},
                   "seed": 0, "eval": {"finetune_epochs": 2}}
    assert config["train"]["head_params"] == {"hidden": 100, "server_lr": 0.001}


def test_the_new_client_jobs_give_the_hypernetworks_their_official_steps_at_fedavgs_compute():
    """pFedHN steps once a returned client, PeFLL once a round: both at the official 5,000 steps, every job at
    FedAvg's client-epochs, its learning rate decayed over the run as FedAvg's over 100 rounds."""
    from fedrod_ray.server_math.server import clients_per_round

    budget = {}
    for head in ("fedavg", "hyper", "fedbabu", "pfedhn", "pefll"):
        cfg = reproduce_local.job_spec(f"{head}_new_clients", [0]).row_config(reproduce_local.ROW_OF[head], 0)
        per_round = clients_per_round(cfg.data.num_clients, cfg.train.client_fraction)
        budget[head] = (cfg.train.rounds, per_round, cfg.train.rounds * per_round * cfg.train.local_epochs,
                        cfg.train.lr * cfg.train.lr_decay ** cfg.train.rounds)
        assert (cfg.data.num_clients, cfg.data.new_clients, cfg.train.head) == (50, 50, head if head != "fedavg"
                                                                               else "none")
    assert budget["pfedhn"][0] * budget["pfedhn"][1] == 5000 and budget["pefll"][0] == 5000
    assert {b[2] for b in budget.values()} == {10_000}
    assert all(abs(b[3] / budget["fedavg"][3] - 1) < 1e-3 for b in budget.values())
    assert [reproduce_local.sweep_of(j) for j in ("pefll_new_clients", "pefll_a0.3")] == ["new_pefll", "pfl_pefll"]


def test_a_sweeps_choice_goes_into_the_rows_mapping_where_the_row_sets_it_whole():
    row = {"train.head": "pefll", "train.head_params": {"server_lr": 5e-4, "embed_dim": 26}}
    out = reproduce_local.unflattened_row(row, {"train.head_params.server_lr": 1e-3, "train.lr": 0.02})
    assert out == {"train.head": "pefll", "train.head_params": {"server_lr": 1e-3, "embed_dim": 26}, "train.lr": 0.02}
    assert row["train.head_params"]["server_lr"] == 5e-4
