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
