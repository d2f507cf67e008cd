"""The paper's baselines as configurations of the method seam: local-only training, fine-tuning (FT) at
evaluation, held-out clients before and after fine-tuning, and the config checks around them."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
import torch

from fedrod_ray.algorithms import build_rule
from fedrod_ray.client_update.local import RoundInput, UpdateContext, derived_seed, local_update
from fedrod_ray.clients.client import ClientState
from fedrod_ray.config import ConfigError, config_from_dict
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.models.metrics import personal_class_correct, pfl_accuracy
from fedrod_ray.personalization.fedrod import OneHead
from fedrod_ray.personalization.finetune import FINETUNE_TAG
from fedrod_ray.round_loop.federation import Federation

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = {
    "seed": 5,
    "data": {"dataset": "synthetic", "num_clients": 4, "new_clients": 2, "alpha": 0.3,
             "synthetic_train_per_class": 24, "synthetic_test_per_class": 10, "min_per_client": 4},
    "train": {"rounds": 2, "client_fraction": 1.0, "local_epochs": 1, "batch_size": 16},
}


def federation(*overrides: str) -> Federation:
    setup = prepare(config_from_dict(BASE, list(overrides)))
    return Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_local_only_never_communicates_and_continues_from_each_clients_own_model():
    fed = federation("train.head=none", "train.balanced_loss=ce", "train.generic_rule=local")
    initial = dict(fed.global_shared)
    fed.step(0)
    after_one = dict(fed.clients)
    fed.step(1)
    # The server kept the initial weights: nothing any client learned reached it.
    assert same(fed.global_shared, initial)
    # Round 2 of a client is a plain local update whose starting point is the client's own round-1 model.
    ref = federation("train.head=none", "train.balanced_loss=ce")  # FedAvg's host: starts from the message
    for cid in range(fed.setup.num_clients):
        first, _ = ref.executor.host.train(cid, ClientState(), RoundInput(initial), 0)
        assert same(first.shared, after_one[cid].local_model), cid
        second, _ = ref.executor.host.train(cid, ClientState(), RoundInput(after_one[cid].local_model), 1)
        assert same(second.shared, fed.clients[cid].local_model), cid
        assert fed.clients[cid].rounds_trained == 2


def test_local_only_gm_is_the_initial_model_and_its_pms_are_the_clients_own():
    fed = federation("train.head=none", "train.balanced_loss=ce", "train.generic_rule=local")
    untrained = fed.evaluate()
    fed.step(0)
    trained = fed.evaluate()
    assert trained["gfl_gm"] == untrained["gfl_gm"] and trained["pfl_gm"] == untrained["pfl_gm"]
    assert trained["pfl_pm"] != trained["pfl_gm"]


@pytest.mark.parametrize("overrides, message", [
    (("eval.finetune_train=true",), "eval.finetune_train: has no effect with eval.finetune_epochs=0"),
    (("data.new_clients=0", "eval.finetune_epochs=2"), "eval.finetune_epochs: has no effect without held-out"),
    (("train.generic_rule=local", "train.head=hyper"), "train.generic_rule: local .* train.head=hyper"),
    (("eval.finetune_epochs=-1",), "eval.finetune_epochs: must be >= 0"),
])
def test_baseline_settings_that_would_do_nothing_are_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(BASE, list(overrides))


def test_ft_is_an_erm_update_of_the_global_model_on_the_clients_data():
    """FedAvg (BRM, FT): trained with the balanced loss, fine-tuned with cross-entropy (ERM) for k epochs at
    the last round's learning rate, from the global weights, whatever the client's own state."""
    fed = federation("train.head=none", "train.balanced_loss=bsm", "eval.finetune_epochs=2",
                     "eval.finetune_train=true", "train.lr_decay=0.5")
    fed.step(0)
    record = fed.step(1)  # the last round: its evaluation fine-tunes
    host = fed.executor.host
    jobs = [(cid, fed.clients[cid]) for cid in fed.setup.all_client_ids]
    tuned = host.finetune(jobs, RoundInput(fed.global_shared), 2, 1)
    assert not tuned.failed
    erm = dataclasses.replace(fed.cfg.train, balanced_loss="ce", local_epochs=2)
    for cid, _ in jobs:
        model = fed.setup.build_model()
        data = host.data(cid)
        local_update(model, RoundInput(fed.global_shared), data,
                     UpdateContext(erm, build_rule("fedavg"), 1, derived_seed(fed.cfg.seed, FINETUNE_TAG), cid,
                                   host.mean, host.std, False))
        correct, total = personal_class_correct(model, fed.setup.test, data.class_dist, 100, False)
        assert torch.equal(tuned.correct[cid], correct) and torch.equal(tuned.total[cid], total), cid
    # The federation fine-tuned at the last round (round index 1, half the first round's lr): its pfl_ft is
    # the P-FL of exactly these counts over the training clients ...
    dists = fed.setup.class_dists
    pfl = [float(pfl_accuracy(tuned.correct[c], tuned.total[c], dists[c:c + 1])[0])
           for c in range(fed.setup.num_clients)]
    assert record["pfl_ft"] == pytest.approx(statistics.fmean(pfl), rel=1e-12)
    # ... and the round matters: at the first round's learning rate some client ends elsewhere.
    first = host.finetune(jobs, RoundInput(fed.global_shared), 2, 0)
    assert any(not torch.equal(first.correct[cid], tuned.correct[cid]) for cid, _ in jobs)


@pytest.mark.parametrize("head", ["none", "linear", "hyper"])
def test_fine_tuning_starts_from_the_global_model_with_the_zero_shot_head(head):
    """At a vanishing learning rate fine-tuning moves nothing, so 'after' is exactly 'before': the global
    model (hyper: with H(a; nu_bar)) is where it starts."""
    loss = ["train.balanced_loss=ce"] if head == "none" else []
    fed = federation(f"train.head={head}", *loss, "eval.finetune_epochs=1", "train.lr=1e-30", "train.rounds=1")
    record = fed.step(0)
    assert record["pfl_new_after"] == record["pfl_new_before"]
    assert record["finetune_failed"] == 0 and "pfl_ft" not in record


class ExecutorZeroShot(OneHead):
    """FedAvg whose new clients' zero-shot model the executor makes (the default: the global weights)."""

    zero_shot_is_reading = False


class ZeroModelForNewClients(ExecutorZeroShot):
    """Sends new clients an all-zero model, which they load as their zero-shot model and "adapt" to
    (untouched): every prediction is class 0."""

    def new_client_message(self, server_state, global_shared):
        return {k: torch.zeros_like(v) for k, v in global_shared.items()}

    def new_client_model(self, model, message, data, ctx):
        model.load_partial(message.per_client[ctx.client_id])
        return model

    def adapt(self, model, message, data, personal, epochs, ctx):
        return self.new_client_model(model, message, data, ctx)


def with_method(fed: Federation, method) -> Federation:
    """``fed`` evaluated with ``method`` on the server and its host."""
    fed.evaluation.method = fed.executor.host.method = method
    return fed


def test_a_zero_shot_model_made_by_the_executor_is_the_global_reading_when_it_is_the_same_model():
    args = ("train.head=none", "train.balanced_loss=ce", "eval.finetune_epochs=1", "train.lr=0.05")
    reading = federation(*args)
    executor = with_method(federation(*args), ExecutorZeroShot())
    for r in range(2):
        ours, theirs = executor.step(r), reading.step(r)
        assert "pfl_new_before" in ours and ("pfl_new_after" in ours) == (r == 1)
        untimed = [json.dumps({k: v for k, v in rec.items() if k not in ("seconds", "train_seconds")})
                   for rec in (ours, theirs)]
        assert untimed[0] == untimed[1]  # as JSON: NaN == NaN


def test_new_clients_zero_shot_and_adaptation_read_the_methods_new_client_message():
    fed = with_method(federation("train.head=none", "train.balanced_loss=ce", "eval.finetune_epochs=1"),
                      ZeroModelForNewClients())
    fed.step(0)
    record = fed.step(1)
    # A model of zeros predicts class 0 everywhere: a new client's P-FL is its share of class 0 (every class
    # has as many test examples).
    m = fed.setup.num_clients
    share = statistics.fmean(float(fed.setup.class_dists[c][0]) for c in fed.setup.all_client_ids[m:])
    assert record["pfl_new_before"] == pytest.approx(share, rel=1e-12)
    assert record["pfl_new_after"] == pytest.approx(share, rel=1e-12)
    assert record["pm_eval_failed"] == 0 and record["finetune_failed"] == 0
    # The GM and the training clients' PMs are untouched by the new clients' message.
    assert record["pfl_gm_new"] != pytest.approx(share)


def test_fine_tuning_at_the_last_evaluation_changes_nothing_that_is_kept():
    fed = federation("train.head=hyper", "eval.finetune_epochs=3", "eval.finetune_train=true", "train.lr=0.05")
    first = fed.step(0)
    assert "pfl_new_after" not in first and "pfl_ft" not in first  # only at the last round
    clients, weights = dict(fed.clients), dict(fed.global_shared)
    final = fed.evaluate(final=True)
    assert fed.clients == clients and same(fed.global_shared, weights)
    assert final["pfl_new_after"] != final["pfl_new_before"]  # it did train
    assert 0 <= final["pfl_ft"] <= 1
    again = fed.evaluate(final=True)
    assert again == final  # and deterministically
