"""pFedHN (fedrod_ray.personalization.pfedhn): the hypernetwork's vector-Jacobian products against an explicit
Jacobian and by hand, the server's SGD step and clipping by hand, the round's server step (each client's
Delta from the model it was sent, one client after another in increasing id), the client's local update,
its PM and GM, its config, and the whole method trained, checkpointed and resumed bitwise in process."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from fedrod_ray_tune.space import load_sweep
from hypernets import assert_config_error_names, assert_pms_and_gm, assert_trains_and_resumes_bitwise
from test_federation import _same, make_federation
from test_personalization_updates import CID, ROUND, close, plain_sgd

from fedrod_ray.client_update.local import LocalResult, RoundInput
from fedrod_ray.clients.client import ClientState
from fedrod_ray.personalization import build_method, mean_state
from fedrod_ray.personalization.pfedhn import (
    CLIP_NORM,
    EMBEDDINGS,
    FIT_TAG,
    MEAN_EMBEDDING,
    MOMENTUM,
    MOMENTUM_BUFFER,
    NET,
    WEIGHT_DECAY,
    HyperNetwork,
    client_delta,
    clip_total_norm,
    embed_dim,
    generate,
    hyper_grads,
    init_state,
    server_step,
    sgd_momentum_step,
)
from fedrod_ray.personalization.sgd import client_batches
from fedrod_ray.round_loop.evaluation import _mean, _pfl

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PFEDHN = ("train.head=pfedhn", "train.balanced_loss=ce")
SHAPES = {"a": torch.Size([2, 3]), "b": torch.Size([2])}  # a tiny target model: two weight tensors


def tiny(num_clients: int = 3, embed: int = 2, hidden: int = 4, seed: int = 0):
    method = build_method("pfedhn", {"embed_dim": embed, "hidden": hidden})
    net, state = init_state(method.params, num_clients, SHAPES, seed)
    return method, net, state


def explicit_jacobian(f, x: torch.Tensor) -> torch.Tensor:
    """d f(x) / d x, (outputs, inputs), one input coordinate at a time by central differences in float64."""
    x = x.detach().double()
    cols = []
    for i in range(x.numel()):
        e = torch.zeros_like(x).view(-1)
        e[i] = 1e-6
        e = e.view_as(x)
        cols.append((f(x + e) - f(x - e)) / 2e-6)
    return torch.stack(cols, 1)


# --- the math, by hand -------------------------------------------------------------------------------------


def test_the_hypernetwork_has_one_linear_head_per_weight_tensor_after_a_four_layer_mlp():
    net = HyperNetwork(2, 4, SHAPES)
    assert [type(m).__name__ for m in net.mlp] == ["Linear", "ReLU", "Linear", "ReLU", "Linear", "ReLU", "Linear"]
    assert [h.out_features for h in net.heads] == [6, 2]
    w = net(torch.zeros(2))
    assert {k: v.shape for k, v in w.items()} == SHAPES


def test_the_embedding_size_is_the_papers_one_plus_a_quarter_of_the_clients_unless_set():
    assert embed_dim(build_method("pfedhn").params, 100) == 26
    assert embed_dim(build_method("pfedhn").params, 50) == 13
    assert embed_dim(build_method("pfedhn", {"embed_dim": 5}).params, 100) == 5


def test_the_vjp_with_delta_is_the_explicit_jacobians_transpose_times_delta():
    """(dw_m/dv_m)^T Delta_m and (dw_m/dphi)^T Delta_m against the Jacobian itself (finite differences in float64,
    the hypernetwork's own function) and torch.autograd.functional.vjp, for every tensor of phi."""
    _, net, state = tiny()
    net = net.double()
    state = {k: v.double() for k, v in state.items()}
    g = torch.Generator().manual_seed(1)
    delta = {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in SHAPES.items()}
    flat_delta = torch.cat([delta[k].reshape(-1) for k in SHAPES])
    m = 1
    grads = hyper_grads(net, state, m, delta)

    def flat(s):
        return torch.cat([t.reshape(-1) for t in generate(net, s, s[EMBEDDINGS][m]).values()])

    v = state[EMBEDDINGS][m]
    jac_v = explicit_jacobian(lambda x: flat({**state, EMBEDDINGS: state[EMBEDDINGS].index_put((torch.tensor(m),), x)}), v)
    expected_v = torch.zeros_like(state[EMBEDDINGS])
    expected_v[m] = jac_v.T @ flat_delta
    assert torch.allclose(grads[EMBEDDINGS], expected_v, atol=1e-6)
    for key in ("hnet/mlp.0.weight", "hnet/mlp.6.bias", "hnet/heads.0.weight", "hnet/heads.1.bias"):
        jac = explicit_jacobian(lambda x, key=key: flat({**state, key: x}), state[key])
        assert torch.allclose(grads[key].reshape(-1), jac.T @ flat_delta, atol=1e-6), key
    # torch.autograd.functional.vjp of the same map agrees exactly in form (every tensor of phi at once).
    keys = [k for k in state if k.startswith(NET)]
    _, vjp = torch.autograd.functional.vjp(lambda *ts: flat({**state, **dict(zip(keys, ts))}),
                                           tuple(state[k] for k in keys), flat_delta)
    for k, g in zip(keys, vjp):
        assert torch.allclose(grads[k], g, atol=1e-12), k


def test_a_heads_vjp_is_delta_times_the_features_by_hand():
    """w_k = W_k f + b_k: (dw_k/dW_k)^T Delta_k = Delta_k f^T and (dw_k/db_k)^T Delta_k = Delta_k; with the
    MLP's last layer zeroed and its bias c, f = c."""
    _, net, state = tiny()
    state = dict(state)
    state["hnet/mlp.6.weight"] = torch.zeros(4, 4)
    state["hnet/mlp.6.bias"] = torch.tensor([1.0, 0.0, 2.0, -1.0])
    delta = {"a": torch.arange(6.0).view(2, 3), "b": torch.tensor([0.5, -1.0])}
    grads = hyper_grads(net, state, 0, delta)
    f = torch.tensor([1.0, 0.0, 2.0, -1.0])
    assert torch.equal(grads["hnet/heads.0.weight"], torch.outer(torch.arange(6.0), f))
    assert torch.equal(grads["hnet/heads.1.weight"], torch.outer(torch.tensor([0.5, -1.0]), f))
    assert torch.equal(grads["hnet/heads.1.bias"], delta["b"])
    # dw/dc = sum_k W_k^T Delta_k, and nothing reaches the embeddings through the zeroed layer.
    expected_c = state["hnet/heads.0.weight"].T @ delta["a"].reshape(-1) + state["hnet/heads.1.weight"].T @ delta["b"]
    assert torch.allclose(grads["hnet/mlp.6.bias"], expected_c)
    assert not grads[EMBEDDINGS].any()


def test_the_server_sgd_step_and_clipping_by_hand_and_as_torch_does_them():
    # p = 1, g = 2, buf = 0.5, wd 0.1, momentum 0.9: d = 2.1, buf = 0.45 + 2.1 = 2.55, p = 1 - 0.1 * 2.55.
    p, buf = sgd_momentum_step(torch.tensor([1.0]), torch.tensor([2.0]), torch.tensor([0.5]), 0.1, 0.9, 0.1)
    assert torch.allclose(p, torch.tensor([0.745])) and torch.allclose(buf, torch.tensor([2.55]))
    # Two steps from a zero buffer are torch.optim.SGD's (whose first step copies d into the buffer).
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = torch.optim.SGD([param], lr=0.1, momentum=0.9, weight_decay=0.01)
    mine, b = torch.tensor([1.0, -2.0]), torch.zeros(2)
    for grad in (torch.tensor([0.3, 0.1]), torch.tensor([-0.2, 0.4])):
        param.grad = grad.clone()
        opt.step()
        mine, b = sgd_momentum_step(mine, grad, b, 0.1, 0.9, 0.01)
    assert torch.equal(mine, param.detach())
    # ||(3, 4), (12)|| = 13: clipped to 6.5 halves them; under the bound they stay.
    grads = {"x": torch.tensor([3.0, 4.0]), "y": torch.tensor([12.0])}
    half = clip_total_norm(grads, 6.5)
    assert torch.allclose(half["x"], torch.tensor([1.5, 2.0])) and torch.allclose(half["y"], torch.tensor([6.0]))
    assert torch.equal(clip_total_norm(grads, 20.0)["x"], grads["x"])


def test_one_clients_server_step_moves_phi_and_its_embedding_along_the_clipped_vjp():
    _, net, state = tiny()
    delta = {"a": torch.full((2, 3), 0.1), "b": torch.tensor([0.2, -0.1])}
    new = server_step(net, state, 2, delta, 0.05)
    grads = clip_total_norm(hyper_grads(net, state, 2, delta), CLIP_NORM)
    for k, g in grads.items():
        d = g + WEIGHT_DECAY * state[k]  # zero buffers: the first step's buffer is d
        assert torch.allclose(new[MOMENTUM_BUFFER + k], d) and torch.allclose(new[k], state[k] - 0.05 * d), k
    # Only v_2's row moves by its gradient; the others only by weight decay (the whole table is one tensor).
    assert torch.allclose(new[EMBEDDINGS][:2], state[EMBEDDINGS][:2] * (1 - 0.05 * WEIGHT_DECAY))
    assert not torch.allclose(new[EMBEDDINGS][2], state[EMBEDDINGS][2] * (1 - 0.05 * WEIGHT_DECAY))
    assert MOMENTUM == 0.9 and set(new) == set(state)


def test_the_server_steps_each_returned_client_in_increasing_id_from_the_model_it_was_sent():
    method, net, state = tiny()
    method._net = net
    sent = method.messages(state, [2, 0], {}, 0, 0, None)
    assert set(sent) == {0, 2} and all(torch.equal(sent[c][k], generate(net, state, state[EMBEDDINGS][c])[k])
                                       for c in sent for k in SHAPES)
    trained = {c: {k: v - 0.1 * (c + 1) for k, v in sent[c].items()} for c in sent}
    results = {c: LocalResult(trained[c], 5, 0.0, None, 1, 0.0) for c in (2, 0)}  # returned out of order
    gm, new = method.server_update({k: torch.zeros(s) for k, s in SHAPES.items()}, results, {}, state,
                                   {}, 3, None)
    expected = state
    for c in (0, 2):
        expected = server_step(net, expected, c, client_delta(sent[c], trained[c]), method.params.server_lr)
    assert all(torch.equal(new[k], expected[k]) for k in state)
    # The other order gives other weights: the steps are sequential.
    other = server_step(net, server_step(net, state, 2, client_delta(sent[2], trained[2]), 0.01), 0,
                        client_delta(sent[0], trained[0]), 0.01)
    assert not torch.equal(other[NET + "mlp.0.weight"], new[NET + "mlp.0.weight"])
    # The new global weights: the mean of the three clients' PMs under the new phi.
    pms = [generate(net, new, new[EMBEDDINGS][m]) for m in range(3)]
    assert all(torch.equal(gm[k], mean_state(pms)[k]) for k in SHAPES)


def test_client_delta_is_the_sent_model_less_the_returned_one():
    assert torch.equal(client_delta({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.5, 3.0])})["w"],
                       torch.tensor([0.5, -1.0]))


# --- the client, the PM, the GM, the config ---------------------------------------------------------------------


def test_the_client_trains_from_the_model_the_server_generated_for_it():
    fed = make_federation(*PFEDHN)
    host = fed.executor.host
    sent = fed.method.messages(fed.method_state, [CID], {}, ROUND, fed.cfg.seed, None)
    message = RoundInput(fed.global_shared, per_client=sent)
    res, personal, _ = host.method.train(host.model, message, host.data(CID), None, None, {}, {}, {},
                                         host.context_of(CID, ROUND))
    expected = plain_sgd(host, sent[CID], client_batches(host.data(CID), host.context_of(CID, ROUND)))
    assert personal is None and close(res.shared, expected)
    assert not close(res.shared, fed.global_shared)  # not from the global weights


def test_the_pm_is_the_hypernetworks_model_of_the_client_and_the_gm_the_mean_of_the_pms():
    fed = make_federation(*PFEDHN)
    fed.step(0)
    # One that trained or not: its PM is H(v_m; phi) with the current phi.
    assert_pms_and_gm(fed, [fed.method.model_of(fed.method_state, c) for c in range(fed.setup.num_clients)])


@pytest.mark.parametrize("extra, field", [
    (("train.head=pfedhn",), "train.balanced_loss"),
    ((*PFEDHN, "model.arch=resnet20"), "model.arch"),
    ((*PFEDHN, "train.head_params={server_lr: 0}"), "train.head_params.server_lr"),
    ((*PFEDHN, "train.head_params={embed_dim: 0}"), "train.head_params.embed_dim"),
    ((*PFEDHN, "eval.finetune_epochs=1", "eval.finetune_train=true"), "eval.finetune_train"),
    ((*PFEDHN, "privacy.enabled=true", "privacy.noise_multiplier=1"), "train.head"),
])
def test_a_pfedhn_setting_that_makes_no_sense_names_the_field(extra, field):
    assert_config_error_names(extra, field)


# --- end to end --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_pfedhn_trains_and_resumes_bitwise_from_its_checkpoint(tmp_path):
    """The checkpoint holds the whole server: the embeddings, the hypernetwork and the momentum buffers of
    both; a federation restored from it trains on to the bits of the uninterrupted one."""
    assert_trains_and_resumes_bitwise(PFEDHN, tmp_path, {EMBEDDINGS, "hnet", "momentum"})


# --- a client that never trained --------------------------------------------------------------------------------


def new_client_call(fed):
    """A new client's id, what it receives (the method's new-client message) and its host's context."""
    host, cid = fed.executor.host, fed.setup.num_clients  # the first held-out client
    message = RoundInput(fed.global_shared,
                         per_client={cid: fed.method.new_client_message(fed.method_state, fed.global_shared)})
    return host, cid, message, host.context_of(cid, 1)


def test_a_new_clients_zero_shot_model_is_h_at_the_mean_embedding_and_it_needs_nothing():
    fed = make_federation(*PFEDHN)
    fed.step(0)
    host, cid, message, ctx = new_client_call(fed)
    assert fed.method.new_client_needs == "none" and not fed.method.zero_shot_is_reading
    received = message.per_client[cid]
    assert set(received) == {k for k in fed.method_state if k.startswith(NET)} | {MEAN_EMBEDDING}
    model = host.method.new_client_model(host.model, message, host.data(cid), ctx)
    expected = generate(fed.method.net, fed.method_state, fed.method_state[EMBEDDINGS].mean(0))
    assert _same({k: v for k, v in model.state_dict().items()}, expected)


def test_a_new_client_adapts_by_learning_its_embedding_with_phi_frozen():
    """adapt: E epochs of SGD (the round's learning rate, the config's momentum and weight decay) on v alone,
    from the mean embedding, on the cross-entropy of H(v; phi); written out here with torch.optim.SGD."""
    fed = make_federation(*PFEDHN)
    fed.step(0)
    host, cid, message, ctx = new_client_call(fed)
    data = host.data(cid)
    model = host.method.adapt(host.model, message, data, None, 2, ctx)
    net, state = fed.method.net, fed.method_state
    v = state[EMBEDDINGS].mean(0).clone().requires_grad_()
    cfg = host.cfg.train
    opt = torch.optim.SGD([v], lr=cfg.lr * cfg.lr_decay, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    for epoch in client_batches(data, ctx, FIT_TAG, epochs=2):
        for xb, yb in epoch:
            loss = torch.nn.functional.cross_entropy(
                torch.func.functional_call(host.model, generate(net, state, v), (xb,)), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert close(model.state_dict(), generate(net, state, v.detach()))
    assert not close(model.state_dict(), generate(net, state, state[EMBEDDINGS].mean(0)))  # it moved


def test_pfedhn_scores_new_clients_before_and_after_in_the_evaluation():
    fed = make_federation(*PFEDHN, "eval.finetune_epochs=1", "train.lr=0.1", "train.head_params={server_lr: 0.01}")
    record = [fed.step(r) for r in range(2)][-1]
    assert record["pfl_new_before"] != record["pfl_gm_new"]  # at these learning rates they differ
    assert math.isfinite(record["pfl_new_before"]) and math.isfinite(record["pfl_new_after"])
    assert record["finetune_failed"] == 0 and record["pm_eval_failed"] == 0
    # "Before" is the P-FL of the zero-shot models the hook makes (H at the mean embedding), not the GM's.
    host, m = fed.executor.host, fed.setup.num_clients
    new = fed.setup.all_client_ids[m:]
    message = RoundInput(fed.global_shared, per_client=dict.fromkeys(
        new, fed.method.new_client_message(fed.method_state, fed.global_shared)))
    counts = host.zero_shot([(cid, ClientState()) for cid in new], message, 1)
    assert record["pfl_new_before"] == _mean(list(_pfl(counts, fed.setup.pfl_weights).values()))


@pytest.mark.parametrize("sweep, head, lrs", [("pfl_pfedhn", "pfedhn", [0.0003, 0.001, 0.003]),
                                              ("pfl_pefll", "pefll", [0.0001, 0.0002, 0.0005])])
def test_the_selection_sweeps_of_pfedhn_and_pefll_search_lr_and_embedding_size_on_another_seed(sweep, head, lrs):
    """tune/pfl_pfedhn.yaml, tune/pfl_pefll.yaml: every grid point a valid trial of the method on FMNIST
    Dir(0.3) at a seed that is not the tables' (0), around the defaults."""
    spec = load_sweep(Path(__file__).resolve().parents[1] / "tune" / f"{sweep}.yaml")
    grids = {k: v["grid"] for k, v in spec.search.items()}
    seen = set()
    for values in itertools.product(*grids.values()):
        cfg = spec.trial_config(dict(zip(grids, values)))
        assert cfg.seed != 0 and cfg.data.alpha == 0.3 and cfg.data.dataset == "fmnist"
        assert cfg.train.head == head and cfg.train.balanced_loss == "ce"
        seen.add((cfg.train.head_params["server_lr"], cfg.train.head_params["embed_dim"]))
    assert seen == set(itertools.product(lrs, [13, 26, 52]))
