"""The metric schema: docs/runs.md's table is the generated one, a round's record has exactly the schema's
fields, labels in a line, and the trial-line callback (pickled by Tune with the experiment)."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from fedrod_ray_tune.repro_spec import build_spec
from fedrod_ray_tune.reproduce import trial_line
from fedrod_ray_tune.sweep import TrialLines

from fedrod_ray.config import config_from_dict
from fedrod_ray.drivers.runner import run_local
from fedrod_ray.outputs.metric_schema import ACCURACIES, EVALUATED, METRICS, markdown_table, values_line
from fedrod_ray.outputs.storage import RunStorage

REPO = Path(__file__).resolve().parents[1]


def test_the_docs_list_the_metrics_files_columns_as_the_schema_does():
    assert markdown_table() in (REPO / "docs" / "runs.md").read_text(), (
        "docs/runs.md's metrics table differs from fedrod_ray.outputs.metric_schema; paste the output of "
        "python -c 'from fedrod_ray.outputs.metric_schema import markdown_table; print(markdown_table())'")


@pytest.mark.usefixtures("one_torch_thread")
def test_a_round_with_everything_on_has_exactly_the_schemas_fields(tmp_path):
    cfg = config_from_dict({
        "seed": 1, "run_dir": str(tmp_path),
        "data": {"dataset": "synthetic", "num_clients": 4, "new_clients": 2, "synthetic_train_per_class": 12,
                 "synthetic_test_per_class": 5},
        "train": {"head": "linear", "rounds": 1, "client_fraction": 0.5, "batch_size": 16},
        "eval": {"finetune_epochs": 1, "finetune_train": True, "clients": 3},
    })
    (record,) = run_local(cfg, RunStorage(str(tmp_path)), log=lambda line: None)
    assert set(record) == {m.key for m in METRICS}
    assert set(EVALUATED) >= set(ACCURACIES)


def test_values_line_names_each_family_once():
    record = {"gfl_gm": 0.5, "pfl_gm": 0.6, "pfl_pm": 0.7, "pfl_new_before": 0.4, "pfl_new_after": 0.45}
    assert values_line(record, ACCURACIES) == "G-FL 50.00  P-FL GM 60.00  PM 70.00  new before 40.00  after 45.00"
    # A label keeps its first word when the one before it is not printed.
    assert values_line(record, ("gfl_gm", "pfl_pm", "pfl_new_after")) == "G-FL 50.00  P-FL PM 70.00  new after 45.00"


class Trial:
    def __init__(self, config: dict, last: dict, finished: bool):
        self.config, self.last_result, self.finished = config, last, finished

    def is_finished(self) -> bool:
        return self.finished


def test_trial_lines_survive_pickling_and_count_finished_trials(capsys):
    spec = build_spec("ablation", REPO / "configs" / "synthetic_tiny.yaml", [0, 1], rounds=2)
    callback = pickle.loads(pickle.dumps(TrialLines(spec, trial_line, counted=True)))
    done = Trial({"row": "FedAvg", "seed": 0}, {"round": 2, "gfl_gm": 0.5, "pfl_gm": 0.6, "pfl_pm": 0.7,
                                               "pfl_pm_global": 0.65}, True)
    failed = Trial({"row": "FedAvg", "seed": 1}, {}, False)
    callback.on_trial_complete(1, [done, failed], done)
    callback.on_trial_error(2, [done, failed], failed)
    assert capsys.readouterr().out.splitlines() == [
        "[1/2] FedAvg, seed 0: finished, round 2/2: G-FL 50.00  P-FL GM 60.00  PM 70.00  PM global 65.00",
        "[2/2] FedAvg, seed 1: error",
    ]
