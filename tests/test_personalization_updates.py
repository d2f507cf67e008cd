"""Each personalized-FL method's whole local update on a real client of a tiny federation, against the spec's
update written out plainly here (FEDROD.md, "Personalized-FL baselines"): where it starts, which parameters
move in which phase, what it pulls towards, and what it uploads and keeps. The formulas themselves are
checked by hand on tiny tensors in test_personalization.py; these check that ``train`` wires them as the
spec says."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_federation import make_federation
from test_personalization import overrides

from fedrod_ray.client_update.local import ClientData, RoundInput, round_lr
from fedrod_ray.clients.client import ClientState
from fedrod_ray.data.transforms import normalize
from fedrod_ray.personalization import ServerContext
from fedrod_ray.personalization.ditto import PERSONAL_TAG
from fedrod_ray.personalization.fedbabu import head_keys
from fedrod_ray.personalization.fedfomo import AFFINITY, CHOICE_TAG, IDS, choose, train_val_split
from fedrod_ray.personalization.finetune import FINETUNE_TAG
from fedrod_ray.personalization.perfedavg import PM_TAG
from fedrod_ray.personalization.sgd import client_batches

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CID, ROUND = 1, 3  # a client of make_federation's six, in a round past the first (its learning rate decayed)


def host_of(name: str, *extra: str):
    fed = make_federation(*overrides(name), *extra)
    return fed.executor.host


def moved(state: dict, seed: int, scale: float = 0.05) -> dict:
    """``state`` with seeded noise on its floating-point tensors: a model unlike the initial one."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
            for k, v in state.items()}


def plain_sgd(host, start: dict, batches, *, train: set[str] | None = None, penalty=None) -> dict:
    """The spec's local SGD written out: from ``start``, SGD at round ROUND's learning rate with the config's
    momentum and weight decay over ``train`` (default: every parameter), on cross-entropy plus ``penalty``
    (a function of the named parameters); returns the model's state."""
    model = copy.deepcopy(host.model)
    model.load_partial(start)
    model.train()
    named = dict(model.named_parameters())
    cfg = host.cfg.train
    opt = torch.optim.SGD([p for k, p in named.items() if train is None or k in train],
                          lr=cfg.lr * cfg.lr_decay ** ROUND, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    for epoch in batches:
        for xb, yb in epoch:
            loss = F.cross_entropy(model(xb), yb) + (penalty(named) if penalty else 0.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def pull(anchor: dict, lam: float):
    """(lam / 2) ||w - anchor||^2 as a function of the named parameters."""
    return lambda named: lam / 2 * sum(((p - anchor[k]) ** 2).sum() for k, p in named.items())


def gradient_step(params: list[torch.Tensor], loss: torch.Tensor, lr: float) -> None:
    """p <- p - lr grad loss, in place, for each of ``params``."""
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        for p, g in zip(params, grads):
            p -= lr * g


def close(a: dict, b: dict, keys=None) -> bool:
    """Equal up to float rounding (the update's arithmetic in another order); a wrong start, anchor or phase
    moves the weights by orders of magnitude more."""
    return all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-5) for k in (keys if keys is not None else a))


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def differ(a: dict, b: dict) -> bool:
    return any(not torch.allclose(a[k], b[k]) for k in a if a[k].is_floating_point())


def test_ditto_uploads_the_fedavg_update_and_pulls_its_own_v_towards_the_received_model():
    host = host_of("ditto", "train.head_params={lam: 0.5}")
    w_bar, v = moved(host.initial, 1), moved(host.initial, 2)
    res, state = host.train(CID, ClientState(personal=v), RoundInput(w_bar), ROUND)
    ctx, data = host.context_of(CID, ROUND), host.data(CID)
    upload = plain_sgd(host, w_bar, client_batches(data, ctx))
    assert close(res.shared, upload)  # (1): w <- w_bar, E epochs of cross-entropy
    # (2): from its own v_m, E epochs of cross-entropy + (lam / 2) ||v - w_bar||^2, w_bar the received model
    kept = plain_sgd(host, v, client_batches(data, ctx, PERSONAL_TAG), penalty=pull(w_bar, 0.5))
    assert close(state.personal, kept)
    # Pulled towards the received model, not towards its own upload w*_m.
    assert differ(state.personal, plain_sgd(host, v, client_batches(data, ctx, PERSONAL_TAG),
                                            penalty=pull(upload, 0.5)))
    # A client that never trained starts v_m from the initial weights.
    _, first = host.train(CID, ClientState(), RoundInput(w_bar), ROUND)
    assert close(first.personal, plain_sgd(host, host.initial, client_batches(data, ctx, PERSONAL_TAG),
                                           penalty=pull(w_bar, 0.5)))


def test_mtl_trains_its_own_model_pulled_towards_the_mean_the_server_sent():
    host = host_of("mtl", "train.head_params={lam: 0.5}")
    w_all, own = moved(host.initial, 1), moved(host.initial, 2)
    res, state = host.train(CID, ClientState(local_model=own), RoundInput(w_all), ROUND)
    ctx, data = host.context_of(CID, ROUND), host.data(CID)
    expected = plain_sgd(host, own, client_batches(data, ctx), penalty=pull(w_all, 0.5))
    assert close(res.shared, expected) and state.personal is None and state.local_model is res.shared
    _, first = host.train(CID, ClientState(), RoundInput(w_all), ROUND)  # never trained: the initial weights
    assert close(first.local_model, plain_sgd(host, host.initial, client_batches(data, ctx), penalty=pull(w_all, 0.5)))


def test_fedrep_trains_its_head_alone_then_the_body_alone():
    host = host_of("fedrep", "train.local_epochs=3")
    head_keys = set(host.method.personal_keys(host.model))
    w_bar, h = moved(host.initial, 1), moved(host.initial, 2)
    theta_bar = {k: v for k, v in w_bar.items() if k not in head_keys}
    own = {k: h[k] for k in head_keys}
    res, state = host.train(CID, ClientState(personal=own), RoundInput(theta_bar), ROUND)
    epochs = list(client_batches(host.data(CID), host.context_of(CID, ROUND)))
    body_keys = set(theta_bar) & {k for k, _ in host.model.named_parameters()}
    after_head = plain_sgd(host, {**theta_bar, **own}, epochs[:2], train=head_keys)  # E - 1 epochs, theta frozen
    assert close(after_head, {**theta_bar, **own}, body_keys)
    after_body = plain_sgd(host, after_head, epochs[2:], train=body_keys)  # 1 epoch, h frozen
    assert close(after_body, after_head, head_keys)
    # Bit for bit: the frozen part's gradients are off rather than computed and unused, the same arithmetic.
    assert set(res.shared) == set(theta_bar) and same(res.shared, after_body)  # returns theta*_m
    assert set(state.personal) == head_keys and same(state.personal, after_body)  # keeps h*_m
    assert all(p.requires_grad for p in host.model.parameters())  # and back on for the next update


def test_pfedme_uploads_w_and_keeps_theta_after_k_inner_steps_per_batch():
    lam, personal_lr, k = 15.0, 0.01, 5
    host = host_of("pfedme", f"train.head_params={{lam: {lam}}}")
    w_bar = moved(host.initial, 1)
    stale = moved(host.initial, 2)  # theta~ kept from an earlier round: this round starts afresh from w_bar
    res, state = host.train(CID, ClientState(personal=stale), RoundInput(w_bar), ROUND)
    model = copy.deepcopy(host.model)
    model.load_partial(w_bar)
    model.train()
    theta = dict(model.named_parameters())
    w = {key: p.detach().clone() for key, p in theta.items()}
    lr = round_lr(host.cfg.train, ROUND)
    for epoch in client_batches(host.data(CID), host.context_of(CID, ROUND)):
        for xb, yb in epoch:
            for _ in range(k):  # theta~ from its last value, pulled towards this batch's w
                gradient_step(list(theta.values()), F.cross_entropy(model(xb), yb) + pull(w, lam)(theta), personal_lr)
            with torch.no_grad():
                for key, p in theta.items():
                    w[key] -= lr * lam * (w[key] - p)
    assert close(res.shared, w, list(w))  # uploads w_m
    assert close(state.personal, {key: p.detach() for key, p in theta.items()}, list(theta))  # keeps theta~
    assert differ(res.shared, {key: state.personal[key] for key in res.shared})


def test_perfedavg_steps_on_pairs_of_batches_and_its_pm_is_one_step_from_the_global_model():
    beta = 0.01
    host = host_of("perfedavg", f"train.head_params={{beta: {beta}}}", "train.local_epochs=2")
    w_bar = moved(host.initial, 1)
    res, state = host.train(CID, ClientState(), RoundInput(w_bar), ROUND)
    ctx, data = host.context_of(CID, ROUND), host.data(CID)
    alpha = round_lr(host.cfg.train, ROUND)
    model = copy.deepcopy(host.model)
    model.load_partial(w_bar)
    model.train()
    params = list(model.parameters())
    batches = [b for epoch in client_batches(data, ctx) for b in epoch]
    assert len(batches) >= 2
    for (x1, y1), (x2, y2) in zip(batches[0::2], batches[1::2]):
        w = [p.detach().clone() for p in params]
        gradient_step(params, F.cross_entropy(model(x1), y1), alpha)  # w~
        grads = torch.autograd.grad(F.cross_entropy(model(x2), y2), params)  # at w~
        with torch.no_grad():
            for p, w0, g in zip(params, w, grads):
                p.copy_(w0 - beta * g)  # applied to w
    assert close(res.shared, model.state_dict(), list(res.shared)) and state.personal is None
    # PM: w_bar after one SGD step at alpha on one mini-batch of the client's own training data (nothing kept).
    pm_model = copy.deepcopy(host.model)
    host.method.load_pm(pm_model, ClientState(local_model=w_bar, rounds_trained=ROUND + 1), lambda: data, ctx)
    model.load_partial(w_bar)
    xb, yb = next(client_batches(data, ctx, PM_TAG, epochs=1))[0]
    gradient_step(params, F.cross_entropy(model(xb), yb), alpha)
    assert close(pm_model.state_dict(), model.state_dict(), [k for k, _ in model.named_parameters()])


def test_fedbabu_trains_the_body_under_the_frozen_initial_head_and_its_pm_fine_tunes_all_of_the_gm():
    epochs = 2
    host = host_of("fedbabu", f"train.head_params={{finetune_epochs: {epochs}}}")
    head = head_keys(host.initial)  # the one-head model's classifier h
    assert head == ["generic_head.weight"]
    w_bar = {**moved(host.initial, 1), **{k: host.initial[k] for k in head}}  # {theta_bar, h_init}
    res, state = host.train(CID, ClientState(), RoundInput(w_bar), ROUND)
    ctx, data = host.context_of(CID, ROUND), host.data(CID)
    body = {k for k, _ in host.model.named_parameters()} - set(head)
    expected = plain_sgd(host, w_bar, client_batches(data, ctx), train=body)
    assert close(res.shared, expected) and state.personal is None
    assert all(torch.equal(res.shared[k], host.initial[k]) for k in head)  # h never moved
    assert any(not torch.equal(res.shared[k], w_bar[k]) for k in body)
    # PM: the GM fine-tuned, body and head, for finetune_epochs epochs on the client's own training data.
    pm_model = copy.deepcopy(host.model)
    host.method.load_pm(pm_model, ClientState(local_model=w_bar, rounds_trained=ROUND + 1), lambda: data, ctx)
    tuned = plain_sgd(host, w_bar, client_batches(data, ctx, FINETUNE_TAG, epochs=epochs))
    assert close(pm_model.state_dict(), tuned)
    assert all(not torch.equal(pm_model.state_dict()[k], host.initial[k]) for k in head)  # now h moved


def test_fedfomo_weighs_the_received_models_on_its_validation_split_then_trains_on_the_rest():
    host = host_of("fedfomo")
    ctx, data = host.context_of(CID, ROUND), host.data(CID)
    own = moved(host.initial, 1, scale=0.5)  # a poor model: the received ones below do better on its data
    received = {4: moved(host.initial, 2), 0: moved(host.initial, 3, scale=1.0)}
    inbox = {IDS: torch.tensor(list(received))}
    inbox.update({f"{n}/{k}": v for n, m in received.items() for k, v in m.items()})
    res, state = host.train(CID, ClientState(local_model=own), RoundInput(host.initial, per_client={CID: inbox}),
                            ROUND)
    train_rows, val_rows = train_val_split(len(data), host.method.params.val_fraction, host.cfg.seed, CID)
    x, y = normalize(data.x[val_rows], ctx.mean, ctx.std), data.y[val_rows]
    model = copy.deepcopy(host.model).eval()

    def val_loss(state: dict) -> float:
        model.load_partial(state)
        with torch.no_grad():
            return F.cross_entropy(model(x), y).item()

    def l1(a: dict, b: dict) -> float:
        return sum((a[k].double() - b[k].double()).abs().sum().item() for k in a if a[k].is_floating_point())

    u = [(val_loss(own) - val_loss(m)) / l1(m, own) for m in received.values()]
    assert res.method_upload[IDS].tolist() == [4, 0]
    assert np.allclose(res.method_upload["u"].numpy(), u, rtol=1e-5) and max(u) > 0
    pos = [max(x, 0.0) for x in u]
    mixed = {k: v + sum(p * (m[k] - v) for p, m in zip(pos, received.values())) / sum(pos)
             if v.is_floating_point() else v for k, v in own.items()}
    train = ClientData(data.x[train_rows], data.y[train_rows], data.counts)
    assert close(res.shared, plain_sgd(host, mixed, client_batches(train, ctx)), list(res.shared))
    assert res.num_samples == len(train_rows) < len(data) and state.local_model is res.shared


def test_fedfomo_epsilon_decays_by_its_step_each_round_to_zero():
    """Round r's picks are epsilon-greedy with epsilon = max(0, 0.3 - 0.05 r), each client's draws its own."""
    method = host_of("fedfomo").method
    state = method.init_server_state(ServerContext(12, {}, 0, (1, 28, 28), 10))
    state[AFFINITY] = torch.arange(144, dtype=torch.float64).reshape(12, 12).remainder(7)
    uploads = {c: {"w": torch.tensor([float(c)])} for c in range(12)}
    told = []
    for r in range(9):
        msgs = method.messages(state, list(range(12)), uploads, r, 5, None)
        for cid, msg in msgs.items():
            have = [c for c in range(12) if c != cid]
            draws = np.random.default_rng([5, r, cid, CHOICE_TAG])
            assert msg[IDS].tolist() == choose(state[AFFINITY][cid], have, 4, max(0.0, 0.3 - 0.05 * r), draws)
            undecayed = choose(state[AFFINITY][cid], have, 4, 0.3, np.random.default_rng([5, r, cid, CHOICE_TAG]))
            told.append(msg[IDS].tolist() != undecayed)
    assert any(told)  # the rounds' epsilons tell apart from an undecayed 0.3
