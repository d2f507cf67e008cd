"""The personalization methods (fedrod_ray.personalization): each method's local update and server step
checked by hand on tiny tensors, its config constraints, and each one end to end in process: trained, its
GM and PM read, checkpointed and resumed bitwise, and its ``final/`` served."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from fedrod_ray_tune.space import load_sweep
from test_federation import _same, make_federation
from torch import nn

from fedrod_ray.client_update.local import LocalResult
from fedrod_ray.clients.client import ClientState
from fedrod_ray.config import ConfigError, ExperimentConfig, config_from_dict
from fedrod_ray.federation_state.checkpoint import load_checkpoint, save_checkpoint
from fedrod_ray.federation_state.final import write_final
from fedrod_ray.models import build_model
from fedrod_ray.models.export import _version_id, load_final
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.personalization import METHODS, ServerContext, build_method, generic_weights, mean_state
from fedrod_ray.personalization.fedfomo import (
    AFFINITY,
    choose,
    fomo_mix,
    fomo_weights,
    l1_distance,
    train_val_split,
)
from fedrod_ray.personalization.fedrep import split_epochs
from fedrod_ray.personalization.lg_fedavg import lower_layer_keys
from fedrod_ray.personalization.perfedavg import pairs, perfedavg_step
from fedrod_ray.personalization.pfedme import pfedme_batch
from fedrod_ray.personalization.sgd import frozen, prox_grad_

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASELINES = ("fedper", "fedrep", "lg_fedavg", "ditto", "pfedme", "perfedavg", "fedfomo", "mtl", "fedbabu", "gpfl",
             "fedcp", "fedala", "feddbe")
PLAIN = ("train.momentum=0", "train.weight_decay=0")  # pFedMe's and Per-FedAvg's steps are their own formulas
# FedDBE's mean regularisation at kappa 50 (its default) drives the tiny synthetic model's features past float
# range within a few steps at lr 0.01: these tests take kappa 1.
DBE_TINY = ("train.head_params={kl_weight: 1}",)


def overrides(name: str) -> tuple[str, ...]:
    """A baseline's config: cross-entropy, and plain steps where the method's formulas say so."""
    return (f"train.head={name}", "train.balanced_loss=ce", *(PLAIN if name in ("pfedme", "perfedavg") else ()),
            *(DBE_TINY if name == "feddbe" else ()))


def tiny_linear() -> nn.Linear:
    """W x with W = 0 (2 classes, 2 inputs): every gradient below is worked out by hand from it."""
    model = nn.Linear(2, 2, bias=False)
    nn.init.zeros_(model.weight)
    return model


def batch(x, y):
    return torch.tensor([x], dtype=torch.float32), torch.tensor([y])


# --- the math, by hand --------------------------------------------------------------------------------------


def test_the_proximal_term_adds_lambda_times_the_distance_to_the_anchor():
    # Ditto's personal update and MTL: grad + lam (w - anchor) = 0.1 + 0.5 * ([1, 2] - [0, 1]) = [0.6, 0.6].
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    w.grad = torch.tensor([0.1, 0.1])
    prox_grad_({"w": w}, {"w": torch.tensor([0.0, 1.0])}, 0.5)
    assert torch.allclose(w.grad, torch.tensor([0.6, 0.6]))


def test_frozen_turns_gradients_off_for_the_block_and_back_on_after_it_even_on_error():
    a, b, c = (nn.Parameter(torch.zeros(1)) for _ in range(3))
    c.requires_grad_(False)  # frozen before: stays so
    with pytest.raises(RuntimeError), frozen([a, c]):
        assert not a.requires_grad and b.requires_grad
        raise RuntimeError
    assert a.requires_grad and b.requires_grad and not c.requires_grad


def test_pfedme_one_inner_step_and_the_outer_step_by_hand():
    # theta~ = W = 0, w = [[.1, 0], [0, 0]], x = [1, 0], y = 0: logits 0, p = [.5, .5],
    # dL/dW = (p - e_0) x^T = [[-.5, 0], [.5, 0]]; lam = 2: g + lam (theta~ - w) = [[-.7, 0], [.5, 0]],
    # theta~ <- theta~ - 0.1 (that) = [[.07, 0], [-.05, 0]];
    # w <- w - lr lam (w - theta~) = w - 0.1 * 2 * [[.03, 0], [.05, 0]] = [[.094, 0], [-.01, 0]].
    model = tiny_linear()
    params = dict(model.named_parameters())
    w = {"weight": torch.tensor([[0.1, 0.0], [0.0, 0.0]])}
    pfedme_batch(model, params, w, *batch([1.0, 0.0], 0), lam=2.0, personal_lr=0.1, inner_steps=1, lr=0.1)
    assert torch.allclose(model.weight.detach(), torch.tensor([[0.07, 0.0], [-0.05, 0.0]]))
    assert torch.allclose(w["weight"], torch.tensor([[0.094, 0.0], [-0.01, 0.0]]))


def test_pfedme_inner_steps_continue_from_theta_and_pull_towards_w():
    # Second inner step from theta~_1 = [[.05, 0], [-.05, 0]]: logits [.05, -.05], p_0 = 1 / (1 + e^-0.1),
    # g_00 = p_0 - 1; theta~_2[0, 0] = .05 - 0.1 (g_00 + 1 * (.05 - 0)); w = 0.5 * theta~_2.
    model = tiny_linear()
    params = dict(model.named_parameters())
    w = {"weight": torch.zeros(2, 2)}
    pfedme_batch(model, params, w, *batch([1.0, 0.0], 0), lam=1.0, personal_lr=0.1, inner_steps=2, lr=0.5)
    p0 = 1 / (1 + math.exp(-0.1))
    theta = 0.05 - 0.1 * ((p0 - 1) + 0.05)
    expected = torch.tensor([[theta, 0.0], [-theta, 0.0]])
    assert torch.allclose(model.weight.detach(), expected)
    assert torch.allclose(w["weight"], 0.5 * expected)


def test_perfedavg_first_order_step_by_hand():
    # w = 0; b = ([1, 0], 0): g1 = [[-.5, 0], [.5, 0]], w~ = w - 0.1 g1 = [[.05, 0], [-.05, 0]];
    # b' = ([1, 0], 1): logits at w~ are [.05, -.05], p_0 = 1 / (1 + e^-0.1), p - e_1 = [p_0, -p_0],
    # g2 = [[p_0, 0], [-p_0, 0]] (at w it would be [[.5, 0], [-.5, 0]]);
    # w <- w - 0.5 g2 (the gradient at w~, applied to w, not to w~).
    model = tiny_linear()
    loss = perfedavg_step(model, dict(model.named_parameters()), batch([1.0, 0.0], 0), batch([1.0, 0.0], 1),
                          alpha=0.1, beta=0.5)
    p0 = 1 / (1 + math.exp(-0.1))
    assert torch.allclose(model.weight.detach(), torch.tensor([[-0.5 * p0, 0.0], [0.5 * p0, 0.0]]))
    assert math.isclose(float(loss), -math.log(1 - p0), rel_tol=1e-6)  # the loss at w~ on b'


def test_perfedavg_takes_its_batches_in_pairs():
    assert pairs(["a", "b", "c", "d", "e"]) == [("a", "b"), ("c", "d")]
    assert pairs(["a"]) == [("a", "a")]


def test_fedfomo_weights_and_mix_by_hand():
    # u_n = (L(w_m) - L(w_n)) / ||w_n - w_m||_1: (1 - .5) / 2, (1 - 1.5) / 1, and 0 for an identical model.
    assert fomo_weights(1.0, [0.5, 1.5, 0.8], [2.0, 1.0, 0.0]) == [0.25, -0.5, 0.0]
    own = {"w": torch.tensor([0.0, 0.0]), "steps": torch.tensor(3)}
    models = [{"w": torch.tensor([4.0, 0.0]), "steps": torch.tensor(1)},
              {"w": torch.tensor([0.0, 4.0]), "steps": torch.tensor(1)},
              {"w": torch.tensor([8.0, 8.0]), "steps": torch.tensor(1)}]
    # w_m + (.25 [4, 0] + .75 [0, 4]) / (.25 + .75) = [1, 3]; a negative u_n counts as 0; integers stay.
    mixed = fomo_mix(own, models, [0.25, 0.75, -1.0])
    assert torch.equal(mixed["w"], torch.tensor([1.0, 3.0])) and int(mixed["steps"]) == 3
    assert fomo_mix(own, models, [-0.1, 0.0, -2.0]) is own
    assert l1_distance(models[0], models[1]) == 8.0


def test_fedfomo_choice_is_epsilon_greedy_on_the_affinities():
    affinity = torch.tensor([0.0, 0.5, 0.1, 0.5, -1.0], dtype=torch.float64)
    rng = np.random.default_rng(0)
    # Greedy: the highest affinities, the lower id first among equals; never more than there are.
    assert choose(affinity, [1, 2, 3, 4], 3, 0.0, rng) == [1, 3, 2]
    assert choose(affinity, [4, 2], 4, 0.0, rng) == [2, 4]
    # Random: distinct picks, and different draws choose differently.
    picks = {tuple(choose(affinity, [1, 2, 3, 4], 2, 1.0, np.random.default_rng(s))) for s in range(20)}
    assert len(picks) > 3 and all(len(set(p)) == 2 for p in picks)


def test_fedfomo_split_is_fixed_per_client_and_leaves_training_examples():
    train, val = train_val_split(10, 0.2, 0, 3)
    assert len(val) == 2 and sorted(torch.cat([train, val]).tolist()) == list(range(10))
    assert all(torch.equal(a, b) for a, b in zip((train, val), train_val_split(10, 0.2, 0, 3)))
    assert not torch.equal(val, train_val_split(10, 0.2, 0, 4)[1])
    assert len(train_val_split(1, 0.2, 0, 3)[1]) == 0 and len(train_val_split(2, 0.9, 0, 3)[1]) == 0


def result_with(upload):
    return LocalResult(shared={}, num_samples=1, loss=0.0, personal_loss=None, steps=1, seconds=0.0,
                       method_upload=upload)


def test_fedfomo_server_adds_the_uploaded_weights_to_the_affinities_and_averages_every_model():
    method = build_method("fedfomo")
    state = method.init_server_state(ServerContext(3, {}, 0, (1, 28, 28), 10))
    state[AFFINITY][0, 1] = 0.5
    uploads = {0: {"w": torch.tensor([2.0])}, 1: None, 2: {"w": torch.tensor([4.0])}}
    results = {0: result_with({"ids": torch.tensor([1, 2]), "u": torch.tensor([0.25, -1.0], dtype=torch.float64)}),
               2: result_with({})}
    weights, new = method.server_update({"w": torch.tensor([9.0])}, results, uploads, state, {"w": torch.tensor([0.0])},
                                        3, None)
    assert new[AFFINITY][0].tolist() == [0.0, 0.75, -1.0] and not new[AFFINITY][1:].any()
    assert state[AFFINITY][0, 1] == 0.5  # the previous state is not written into
    # The plain mean of every client's model, a client that never trained with the initial weights.
    assert torch.equal(weights["w"], torch.tensor([2.0]))


def test_fedfomo_messages_carry_the_chosen_models_of_clients_the_server_has():
    method = build_method("fedfomo", {"models": 2, "epsilon": 0.0})
    state = method.init_server_state(ServerContext(4, {}, 0, (1, 28, 28), 10))
    state[AFFINITY][0] = torch.tensor([0.0, 0.1, 0.3, 0.2], dtype=torch.float64)
    uploads = {0: {"w": torch.tensor([0.0])}, 1: {"w": torch.tensor([1.0])}, 2: None, 3: {"w": torch.tensor([3.0])}}
    msgs = method.messages(state, [0, 2], uploads, 0, 0, None)
    assert msgs[0]["ids"].tolist() == [3, 1] and msgs[0]["3/w"].item() == 3.0 and msgs[0]["1/w"].item() == 1.0
    assert sorted(msgs[2]["ids"].tolist()) == [0, 1]  # client 2 has none of its own, and never gets itself
    assert method.messages(state, [0], {c: None for c in range(4)}, 0, 0, None)[0]["ids"].numel() == 0


def test_mtl_server_step_is_the_plain_mean_of_all_clients_models():
    method = build_method("mtl")
    uploads = {0: {"w": torch.tensor([1.0])}, 1: {"w": torch.tensor([5.0])}, 2: None}
    weights, _ = method.server_update({"w": torch.tensor([9.0])}, {}, uploads, {}, {"w": torch.tensor([0.0])}, 3, None)
    assert torch.equal(weights["w"], torch.tensor([2.0]))


def test_fedbabu_server_step_averages_the_body_and_keeps_the_head_at_its_initial_weights():
    """theta_bar = the clients' average; h = h_init whatever the average (e.g. a privacy noise) made of it."""
    method = build_method("fedbabu")
    averaged = {"body.0.weight": torch.tensor([2.0, 3.0]), "generic_head.weight": torch.tensor([[5.0]])}
    initial = {"body.0.weight": torch.tensor([0.0, 0.0]), "generic_head.weight": torch.tensor([[1.0]])}
    new, state = method.server_update(averaged, {}, {}, {}, initial, 2, None)
    assert state == {}
    assert torch.equal(new["body.0.weight"], torch.tensor([2.0, 3.0]))
    assert torch.equal(new["generic_head.weight"], torch.tensor([[1.0]]))


def test_mean_state_is_the_unweighted_mean():
    out = mean_state([{"a": torch.tensor([1.0, 2.0])}, {"a": torch.tensor([3.0, 6.0])}])
    assert torch.equal(out["a"], torch.tensor([2.0, 4.0]))
    # Read once, one state at a time (a generator over the client store), to the same bits as from a list.
    states = [{"a": torch.randn(5, generator=torch.Generator().manual_seed(i))} for i in range(7)]
    read = []
    streamed = mean_state(read.append(i) or states[i] for i in range(7))
    assert read == list(range(7)) and torch.equal(streamed["a"], mean_state(states)["a"])


def test_fedrep_splits_its_epochs_into_head_then_body():
    head, body = split_epochs(iter([["e1"], ["e2"], ["e3"]]), 2)
    assert head == [["e1"], ["e2"]] and body == [["e3"]]
    assert split_epochs(iter([["e1"]]), 0) == ([], [["e1"]])


# --- which parameters each method keeps --------------------------------------------------------------------


def split(name):
    model = build_model("mnist_cnn", 10, (1, 28, 28), build_method(name).variant, seed=0)
    model.keep(build_method(name).personal_keys(model))
    return model.shared_keys(), model.personal_keys()


def test_each_method_keeps_its_part_of_the_model():
    shared, personal = split("fedper")
    assert personal == ["generic_head.weight"] and "generic_head.weight" not in shared
    assert split("fedrep") == split("fedper")
    # LG-FedAvg: the convolutions personal, the fully connected layers (body.7, the head) shared.
    shared, personal = split("lg_fedavg")
    assert personal == ["body.0.weight", "body.0.bias", "body.3.weight", "body.3.bias"]
    assert shared == ["body.7.weight", "body.7.bias", "generic_head.weight"]
    for name in ("ditto", "pfedme", "perfedavg", "fedfomo", "mtl", "none"):
        assert split(name)[1] == []
    assert split("linear")[1] == ["personal_head.weight"]


def test_lg_fedavg_needs_a_fully_connected_layer_in_the_extractor():
    model = build_model("resnet20", 10, (3, 32, 32), None, seed=0)
    with pytest.raises(ValueError, match="lg_fedavg"):
        lower_layer_keys(model)


def test_the_gm_of_a_method_without_a_global_model_is_the_mean_of_the_pms():
    method = build_method("fedper")
    initial = {"body": torch.tensor([0.0]), "head": torch.tensor([10.0])}
    global_shared = {"body": torch.tensor([1.0])}
    clients = {0: ClientState(personal={"head": torch.tensor([2.0])}, local_model={"body": torch.tensor([3.0])}),
               1: ClientState()}  # never trained: the global body with the initial head
    gm = generic_weights(method, ["head"], global_shared, clients, initial, 2)
    assert gm == {"body": torch.tensor([2.0]), "head": torch.tensor([6.0])}
    assert generic_weights(build_method("ditto"), [], global_shared, clients, initial, 2) is global_shared


# --- config --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, field", [
    (("train.head=ditto",), "train.balanced_loss"),  # the default balanced loss is bsm
    (("train.head=fedper", "train.balanced_loss=ce", "train.generic_rule=feddyn"), "train.generic_rule"),
    (("train.head=pfedme", "train.balanced_loss=ce"), "train.momentum"),
    (("train.head=perfedavg", "train.balanced_loss=ce", "train.momentum=0"), "train.weight_decay"),
    (("train.head=fedper", "train.balanced_loss=ce", "eval.finetune_epochs=1", "eval.finetune_train=true"),
     "eval.finetune_epochs"),
    (("train.head=mtl", "train.balanced_loss=ce", "train.momentum_buffers=keep"), "train.momentum_buffers"),
    (("train.head=ditto", "train.balanced_loss=ce", "runtime.batched_clients=2", "runtime.mode=local"),
     "runtime.batched_clients"),
    (("train.head=ditto", "train.balanced_loss=ce", "train.head_params={mu: 1}"), "train.head_params.mu"),
    (("train.head=ditto", "train.balanced_loss=ce", "train.head_params={lam: -1}"), "train.head_params.lam"),
    (("train.head_params={lam: 1}",), "train.head_params.lam"),  # linear takes none
    (("train.head=fedbabu", "train.balanced_loss=ce", "train.head_params={finetune_epochs: 0}"),
     "train.head_params.finetune_epochs"),
    (("train.head=fedavg",), "train.head"),
])
def test_a_combination_that_makes_no_sense_names_the_field(extra, field):
    with pytest.raises(ConfigError) as e:
        config_from_dict({}, list(extra))
    assert str(e.value).startswith(field) or f"key {field};" in str(e.value), str(e.value)


def test_the_methods_params_are_recorded_with_their_defaults():
    cfg = config_from_dict({}, ["train.head=pfedme", "train.balanced_loss=ce", *PLAIN,
                                "train.head_params={lam: 20}"])
    assert cfg.train.head_params == {"lam": 20.0, "personal_lr": 0.01, "inner_steps": 5}
    assert isinstance(cfg, ExperimentConfig) and sorted(METHODS) == sorted(
        ("none", "linear", "hyper", *BASELINES, "pfedhn", "pefll"))


# --- end to end, in process ----------------------------------------------------------------------------------


def untimed(record: dict) -> str:
    return json.dumps({k: v for k, v in record.items() if "seconds" not in k}, sort_keys=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", BASELINES)
def test_each_baseline_trains_and_resumes_bitwise_from_its_checkpoint(name, tmp_path):
    """Two rounds, a checkpoint through its files, two more: the resumed federation trains on to the bits of
    the uninterrupted one (global weights, the method's server state, every client's state, the records)."""
    extra = (*overrides(name), "train.rounds=4")
    a = make_federation(*extra)
    for r in (0, 1):
        record = a.step(r)
    assert record["clients_failed"] == 0 and math.isfinite(record["train_loss"])
    assert 0 <= record["gfl_gm"] <= 1 and 0 <= record["pfl_pm"] <= 1
    has_reading = METHODS[name].global_reading is not None
    assert math.isfinite(record["pfl_pm_global"]) == has_reading
    storage = RunStorage(str(tmp_path))
    save_checkpoint(storage, a.snapshot())
    snap = load_checkpoint(storage)
    b = make_federation(*extra)
    b.restore(snap)
    for r in (2, 3):
        ra, rb = a.step(r), b.step(r)
        assert untimed(ra) == untimed(rb)  # NaN (a reading the method has not) compares equal as JSON
    assert _same(a.global_shared, b.global_shared) and _same(a.method_state, b.method_state)
    for cid, st in a.clients.items():
        assert st.rounds_trained == b.clients[cid].rounds_trained
        assert _same(st.tensors(), b.clients[cid].tensors()), cid


def test_each_methods_client_keeps_what_the_spec_says():
    trained = {}
    for name in BASELINES:
        fed = make_federation(*overrides(name))
        fed.step(0)
        trained[name] = next(st for st in fed.clients.values() if st.rounds_trained)
    full = set(build_model("auto", 10, (1, 28, 28), None).state_dict())
    assert set(trained["fedper"].personal) == {"generic_head.weight"}
    assert set(trained["lg_fedavg"].personal) == {"body.0.weight", "body.0.bias", "body.3.weight", "body.3.bias"}
    assert set(trained["ditto"].personal) == full  # v_m
    assert set(trained["pfedme"].personal) == full  # theta~
    for name in ("perfedavg", "fedfomo", "mtl", "fedbabu"):
        assert trained[name].personal is None and set(trained[name].local_model) == full, name
    # FedALA: W_i of its top tensor (the head) and the start flag beside its last model (theta^loc);
    # FedDBE: its feature bias z^p and the consensus mean it trained against.
    assert set(trained["fedala"].personal) == {"ala_w/generic_head.weight", "ala_start"}
    assert set(trained["fedala"].local_model) == full
    assert set(trained["feddbe"].personal) == {"readout.shift", "consensus"}


def test_fedfomo_keeps_affinities_that_the_clients_sent():
    fed = make_federation(*overrides("fedfomo"), "train.rounds=3")
    for r in range(3):
        fed.step(r)
    assert fed.method_state[AFFINITY].shape == (6, 6) and fed.method_state[AFFINITY].abs().sum() > 0
    assert not fed.method_state[AFFINITY].diagonal().any()


def test_mtl_and_fedfomo_global_weights_are_the_mean_of_all_clients_models():
    for name in ("mtl", "fedfomo"):
        fed = make_federation(*overrides(name))
        fed.step(0)
        models = [st.local_model or fed.initial for cid, st in fed.clients.items() if cid < fed.setup.num_clients]
        expected = mean_state([{k: m[k] for k in fed.global_shared} for m in models])
        assert _same(fed.global_shared, expected), name


def test_perfedavg_pm_is_the_global_model_after_one_step_on_the_clients_data():
    """PM (Per-FedAvg): made from w_bar at evaluation; so P-FL (PM) differs from P-FL (GM), and it is made
    afresh every evaluation (the global model changed) even for a client that did not train since."""
    fed = make_federation(*overrides("perfedavg"), "train.rounds=3")
    records = [fed.step(r) for r in range(3)]
    assert all(r["pfl_pm"] != r["pfl_gm"] for r in records)
    host = fed.executor.host
    cid = 0
    state = fed.evaluation._pm_state(fed.clients, cid, fed.global_shared, 3, fed.method_state)
    assert state.local_model is fed.global_shared and state.rounds_trained == 3
    host.method.load_pm(host.model, state, lambda: host.data(cid), host.context_of(cid, 2))
    moved = [k for k, v in host.model.state_dict().items() if not torch.equal(v, fed.global_shared[k])]
    assert moved  # one step of SGD away from w_bar


@pytest.mark.parametrize("name", ["fedper", "ditto", "mtl"])
def test_final_serves_the_generic_model(name, tmp_path):
    fed = make_federation(*overrides(name))
    fed.step(0)
    storage = RunStorage(str(tmp_path))
    write_final(storage, fed.setup, fed.snapshot(), {"gfl_gm": 0.5})
    served = load_final(str(tmp_path))
    assert served.meta.head == "none" and served.personal_heads == {}
    gm = fed.evaluation.generic_model(fed.global_shared, fed.clients)
    state = served.model.state_dict()
    assert set(state) == set(gm) and all(torch.equal(state[k], gm[k]) for k in gm)


@pytest.mark.parametrize("sweep", ["pfl_lambda", "pfl_perfedavg", "pfl_pfedme", "pfl_fedbabu"])
def test_the_selection_sweeps_search_the_papers_lists_on_another_seed(sweep):
    """tune/pfl_*.yaml: every point of each grid is a valid trial of its method on Dir(0.3), at a seed that is
    not the tables' (0)."""
    spec = load_sweep(Path(__file__).resolve().parents[1] / "tune" / f"{sweep}.yaml")
    grids = {k: v["grid"] for k, v in spec.search.items()}
    lists = {("ditto", "lam"): [0.01, 0.1, 1.0], ("mtl", "lam"): [0.01, 0.1, 1.0],
             ("perfedavg", "beta"): [0.01, 0.001, 0.0001], ("pfedme", "lam"): [15.0, 20.0, 30.0],
             ("fedbabu", "finetune_epochs"): [1, 2, 5, 10]}
    seen = set()
    for values in itertools.product(*grids.values()):
        cfg = spec.trial_config(dict(zip(grids, values)))
        assert cfg.seed != 0 and cfg.data.alpha == 0.3 and cfg.data.dataset == "fmnist"
        (param, value), = [(k, v) for k, v in cfg.train.head_params.items()
                           if k in ("lam", "beta", "finetune_epochs")]
        seen.add((cfg.train.head, param, value))
    assert seen == {(head, param, v) for (head, param), vs in lists.items() for v in vs
                    if any(head == h for h, _, _ in seen)}


def test_final_says_what_a_new_client_gives_for_its_methods_zero_shot_model(tmp_path):
    """meta.json's new_client is the method's ``new_client_needs``: Fed-RoD (hyper) its class counts, FedBABU
    and the other methods nothing (their GM)."""
    for name, args, needs in (("hyper", ("train.head=hyper",), "class_counts"),
                              ("fedbabu", overrides("fedbabu"), "none"), ("fedper", overrides("fedper"), "none")):
        fed = make_federation(*args)
        fed.step(0)
        write_final(RunStorage(str(tmp_path / name)), fed.setup, fed.snapshot(), {})
        assert METHODS[name].new_client_needs == needs
        assert json.loads((tmp_path / name / "final" / "meta.json").read_text())["new_client"] == needs
        assert load_final(str(tmp_path / name)).meta.new_client == needs


def test_final_and_the_service_say_what_the_generic_model_is(tmp_path):
    """meta.json names the method and whether the served GM is its global model or the mean of the PMs;
    a final/ written before those fields loads as a global model of its head."""
    for name, generic in (("fedper", "mean of personalized models"), ("ditto", "global")):
        fed = make_federation(*overrides(name))
        fed.step(0)
        write_final(RunStorage(str(tmp_path / name)), fed.setup, fed.snapshot(), {})
        meta = load_final(str(tmp_path / name)).meta
        assert (meta.method, meta.generic_model) == (name, generic)
    doc = json.loads((tmp_path / "ditto" / "final" / "meta.json").read_text())
    del doc["method"], doc["generic_model"]
    doc["version_id"] = _version_id(doc)
    (tmp_path / "ditto" / "final" / "meta.json").write_text(json.dumps(doc))
    meta = load_final(str(tmp_path / "ditto")).meta
    assert (meta.method, meta.generic_model) == ("none", "global")
