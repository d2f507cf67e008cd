"""Fed-RoD (Meta-BSM): one mini-batch's update against an explicit formula, gamma_m's direction, the
server's meta set, the config, client state through checkpoints, and whole rounds in-process and on Ray."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tiny import MEAN, SHAPE, STD, make_data
from torch import nn

from fedrod_ray.algorithms import build_rule
from fedrod_ray.client_update.local import ClientData, ClientStart, RoundInput, UpdateContext, local_update
from fedrod_ray.client_update.losses import balanced_softmax
from fedrod_ray.clients.client import ClientState
from fedrod_ray.config import ConfigError, DataConfig, TrainConfig, config_from_dict
from fedrod_ray.data import load_dataset
from fedrod_ray.data.partition import make_partition
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation_state.checkpoint import load_checkpoint, save_checkpoint
from fedrod_ray.federation_state.final import final_model
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.federation_state.state import Snapshot
from fedrod_ray.models import FedModel, build_model
from fedrod_ray.models.export import load_final, save_final
from fedrod_ray.objectives import meta_per_class, model_parts
from fedrod_ray.objectives.meta_bsm import MetaWeightNet, meta_bsm_step
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.round_loop.federation import Federation
from fedrod_ray.server_math.aggregate import weighted_average

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LR, META_LR, GAMMA_LR = 0.5, 2.0, 0.7
COUNTS = torch.tensor([7, 2])  # the client's class counts N_m: skewed towards class 0


# --- the per-mini-batch update on a 2-class linear model ------------------------------------------------


def linear_model() -> FedModel:
    """A FedModel whose body is z = B x (3 -> 4), with bias-free 2-class heads and a width-3 MWNet, float64."""
    model = FedModel("mnist_cnn", 2, 1, "linear", parts={"mwn": lambda: MetaWeightNet(3)})
    model.body = nn.Linear(3, 4, bias=False)
    model.generic_head = nn.Linear(4, 2, bias=False)
    model.personal_head = nn.Linear(4, 2, bias=False)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model.double()


def batch():
    g = torch.Generator().manual_seed(1)
    xb = torch.randn(5, 3, generator=g, dtype=torch.float64)
    meta_x = torch.randn(4, 3, generator=g, dtype=torch.float64)
    return xb, torch.tensor([0, 0, 1, 0, 1]), meta_x, torch.tensor([0, 1, 0, 1])


def explicit(B, W, zeta, gamma, xb, yb, meta_x, meta_y, counts=COUNTS, lr=LR, q_gamma=None):
    """Steps 1-3 written out for logits W B x: the hand-derived gradient of the weighted BSM loss,
    sum_i q_i (p_i - e_{y_i}) z_i^T / sum_i q_i for W and W^T (p_i - e_{y_i}) x_i^T for B, the virtual weights
    and the meta loss. The MWNet reads loss values as constants: those under ``q_gamma`` if given (so
    that a finite difference in ``gamma`` leaves them alone), else under ``gamma``.
    Returns (meta loss, virtual B, virtual W, per-example weights, per-example losses)."""
    a1, b1, a2, b2 = zeta
    z = xb @ B.T
    onehot = F.one_hot(yb, 2).double()

    def bsm(g):
        logits = z @ W.T + g * torch.log(counts.double())
        return logits, torch.logsumexp(logits, 1) - (logits * onehot).sum(1)

    logits, losses = bsm(gamma)
    seen = (losses if q_gamma is None else bsm(q_gamma)[1]).detach()
    q = torch.sigmoid(torch.relu(seen[:, None] @ a1.T + b1) @ a2.T + b2).squeeze(1)
    err = (q / q.sum())[:, None] * (torch.softmax(logits, 1) - onehot)  # n x classes
    grad_w = err.T @ z
    grad_b = (err @ W).T @ xb
    vb, vw = B - lr * grad_b, W - lr * grad_w
    meta = F.cross_entropy(meta_x @ vb.T @ vw.T, meta_y)
    return meta, vb, vw, q, losses


def params_of(model: FedModel):
    zeta = [p.detach().clone() for p in model.mwn.parameters()]
    return model.body.weight.detach().clone(), model.generic_head.weight.detach().clone(), zeta


def test_one_step_matches_the_explicit_formula():
    model = linear_model()
    B, W, zeta = params_of(model)
    phi = model.personal_head.weight.detach().clone()
    xb, yb, meta_x, meta_y = batch()
    gamma0 = 0.8

    # Reference: the meta gradient of the explicit formula, by autograd through the hand-written gradient.
    gamma_ref = torch.tensor(gamma0, dtype=torch.float64, requires_grad=True)
    zeta_ref = [p.clone().requires_grad_() for p in zeta]
    meta_ref, *_ = explicit(B, W, zeta_ref, gamma_ref, xb, yb, meta_x, meta_y)
    d_gamma, *d_zeta = torch.autograd.grad(meta_ref, [gamma_ref, *zeta_ref])
    # ... and independently of any autograd, by central differences in gamma.
    eps = 1e-6
    fd = (explicit(B, W, zeta, gamma0 + eps, xb, yb, meta_x, meta_y, q_gamma=gamma0)[0]
          - explicit(B, W, zeta, gamma0 - eps, xb, yb, meta_x, meta_y, q_gamma=gamma0)[0]) / (2 * eps)
    assert float(d_gamma) == pytest.approx(float(fd), rel=1e-6)
    assert abs(float(d_gamma)) > 1e-4 and all(d.abs().sum() > 1e-6 for d in d_zeta)
    new_gamma = max(0.0, gamma0 - GAMMA_LR * float(d_gamma))
    new_zeta = [p - META_LR * d for p, d in zip(zeta, d_zeta)]

    gamma = torch.tensor(gamma0, dtype=torch.float64, requires_grad=True)
    loss_g, loss_p, meta_loss = meta_bsm_step(model, gamma, xb, yb, COUNTS, None, meta_x, meta_y, LR, META_LR,
                                              GAMMA_LR)
    torch.testing.assert_close(meta_loss, meta_ref.detach())
    assert gamma.item() == pytest.approx(new_gamma, rel=1e-12)
    for p, want in zip(model.mwn.parameters(), new_zeta):
        torch.testing.assert_close(p.detach(), want)
    # The step leaves w alone: the virtual weights are never written into the model.
    torch.testing.assert_close(model.body.weight.detach(), B)

    # Step 4: the real step's gradients, of the weighted BSM under the new gamma and weights (constants),
    # and of the personalized CE on detached features (phi only).
    (loss_g + loss_p).backward()
    gamma_t = torch.tensor(new_gamma, dtype=torch.float64)
    _, vb, vw, q, losses = explicit(B, W, new_zeta, gamma_t, xb, yb, meta_x, meta_y)
    torch.testing.assert_close(loss_g.detach(), (q * losses).sum() / q.sum())
    torch.testing.assert_close(model.body.weight.grad, (B - vb) / LR)
    torch.testing.assert_close(model.generic_head.weight.grad, (W - vw) / LR)
    z = xb @ B.T
    err = (torch.softmax(z @ W.T + z @ phi.T, 1) - F.one_hot(yb, 2).double()) / len(yb)
    torch.testing.assert_close(model.personal_head.weight.grad, err.T @ z)
    assert gamma.grad is None and all(p.grad is None for p in model.mwn.parameters())


def meta_slope(model, gamma0, meta_y):
    """d L_meta / d gamma_m of the explicit formula at gamma0, by a forward difference."""
    B, W, zeta = params_of(model)
    xb, yb, meta_x, _ = batch()
    before = explicit(B, W, zeta, gamma0, xb, yb, meta_x, meta_y)[0]
    after = explicit(B, W, zeta, gamma0 + 1e-6, xb, yb, meta_x, meta_y, q_gamma=gamma0)[0]
    return float(after - before) / 1e-6


# Two balanced meta sets, on which the meta loss asks for a smaller and for a larger gamma_m.
META_LABELS = {"down": torch.tensor([0, 1, 0, 1]), "up": torch.tensor([1, 0, 1, 0])}


@pytest.mark.parametrize("way", sorted(META_LABELS))
@pytest.mark.parametrize("gamma0", [0.3, 1.0, 2.0])
def test_gamma_moves_the_way_the_meta_loss_falls(way, gamma0):
    model = linear_model()
    B, W, zeta = params_of(model)
    xb, yb, meta_x, _ = batch()
    meta_y = META_LABELS[way]
    slope = meta_slope(model, gamma0, meta_y)
    assert (slope < 0) == (way == "up")
    gamma = torch.tensor(gamma0, dtype=torch.float64, requires_grad=True)
    meta_bsm_step(model, gamma, xb, yb, COUNTS, None, meta_x, meta_y, LR, 0.1, 0.1)
    assert np.sign(gamma.item() - gamma0) == -np.sign(slope)
    # gamma_m's step alone (zeta and the example weights as they were) lowers the meta loss through the
    # virtual step.
    before = explicit(B, W, zeta, gamma0, xb, yb, meta_x, meta_y)[0]
    assert explicit(B, W, zeta, gamma.item(), xb, yb, meta_x, meta_y, q_gamma=gamma0)[0] < before


def test_gamma_stays_non_negative():
    model = linear_model()
    xb, yb, meta_x, _ = batch()
    assert meta_slope(model, 0.3, META_LABELS["down"]) > 0  # a huge step down overshoots 0
    gamma = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    meta_bsm_step(model, gamma, xb, yb, COUNTS, None, meta_x, META_LABELS["down"], LR, 1.0, 1e6)
    assert gamma.item() == 0.0



def test_the_weights_share_a_step_out_and_do_not_size_it():
    """The collapse of an unnormalised weighted loss: zeta shrinking every weight would shrink the step.
    Normalised, weights all e^40 or e^50 times smaller (sigmoid ~ exp down there) give the same step."""
    grads = {}
    for shift in (40.0, 50.0):
        model = linear_model()
        with torch.no_grad():
            model.mwn.net[2].bias.sub_(shift)
        xb, yb, meta_x, meta_y = batch()
        gamma = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
        loss_g, _, _ = meta_bsm_step(model, gamma, xb, yb, COUNTS, None, meta_x, meta_y, LR, 0.0, 0.0)
        loss_g.backward()
        losses = balanced_softmax(model.generic_head(model.body(xb)), yb, COUNTS, 0.8, reduction="none")
        assert losses.min() <= loss_g <= losses.max()
        grads[shift] = (loss_g.detach(), model.body.weight.grad, model.generic_head.weight.grad)
    for got, want in zip(grads[50.0], grads[40.0], strict=True):
        torch.testing.assert_close(got, want)


def test_balanced_softmax_takes_a_learnable_gamma():
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    labels = torch.tensor([0, 1, 1, 2, 0, 1])
    counts = torch.tensor([5, 3, 1, 0])
    for value in (0.5, 1.0):
        gamma = torch.tensor(value, dtype=torch.float64, requires_grad=True)
        per_example = balanced_softmax(logits, labels, counts, gamma, reduction="none")
        assert per_example.shape == (6,)
        torch.testing.assert_close(per_example.mean(), balanced_softmax(logits, labels, counts, value))
        (grad,) = torch.autograd.grad(per_example.sum(), gamma)
        assert torch.isfinite(grad)
    # At gamma = 0 it is plain cross-entropy, as for a float gamma (the absent class is not masked).
    zero = balanced_softmax(logits, labels, counts, torch.tensor(0.0, dtype=torch.float64), reduction="none")
    torch.testing.assert_close(zero, F.cross_entropy(logits, labels, reduction="none"))


# --- the local update --------------------------------------------------------------------------------


def tiny_meta_set() -> ClientData:
    return make_data(seed=9, n=20)


def model_and_global(mwn_hidden: int):
    """A linear Fed-RoD model with a Meta-Weight-Net, and a copy of its shared weights."""
    # PyTorch's init: under He's, gamma_m reaches its bound 0 within the first update on these random pixels.
    model = build_model("mnist_cnn", 10, SHAPE, "linear", 16, 0, {"mwn": lambda: MetaWeightNet(mwn_hidden)},
                        init="pytorch")
    state = model.state_dict()
    return model, {k: state[k].clone() for k in model.shared_keys()}


def meta_update(c: TrainConfig, state=None, rule="fedavg", rule_params=None, meta_set=None):
    model, shared = model_and_global(c.meta_bsm.hidden)
    result, personal, _ = local_update(
        model, RoundInput(shared), make_data(),
        UpdateContext(c, build_rule(rule, rule_params or {}), 0, 11, 5, MEAN, STD, False,
                      meta_set=meta_set or tiny_meta_set()), ClientStart(objectives=state))
    return result, personal, shared


def meta_cfg(**kw) -> TrainConfig:
    base = {"balanced_loss": "meta_bsm", "local_epochs": 1, "batch_size": 8, "lr": 0.1, "lr_decay": 1.0,
            "momentum": 0.0, "weight_decay": 0.0}
    return TrainConfig(**{**base, **kw})


def test_local_update_trains_and_returns_gamma_and_zeta():
    c = meta_cfg(gamma=0.5)
    result, personal, shared = meta_update(c)
    assert result.steps == 3 and np.isfinite(result.loss) and np.isfinite(result.personal_loss)
    # gamma_m started from train.gamma and moved; it comes back as the client's to keep.
    gamma = result.objectives["meta_bsm"]["gamma"]
    assert gamma.shape == () and gamma.item() != 0.5
    # zeta is shared (the server averages it), phi_m is kept.
    mwn = [k for k in result.shared if k.startswith("mwn.")]
    assert mwn and any(not torch.equal(result.shared[k], shared[k]) for k in mwn)
    assert set(personal) == {"personal_head.weight"}
    # The same call again is bitwise the same; a call from the returned gamma_m starts there.
    again, _, _ = meta_update(c)
    assert torch.equal(again.objectives["meta_bsm"]["gamma"], gamma)
    assert all(torch.equal(again.shared[k], v) for k, v in result.shared.items())
    later, _, _ = meta_update(c, state=result.objectives)
    assert float(later.objectives["meta_bsm"]["gamma"]) != gamma.item()


def test_kept_momentum_buffers_are_those_of_the_sgd_step():
    """train.momentum_buffers=keep: the client keeps the buffers of what the optimiser trains (w, phi_m),
    none of zeta, which only the meta step moves."""
    result, _, _ = meta_update(meta_cfg(momentum=0.9, momentum_buffers="keep"))
    assert {k for k in result.momentum} == {k for k in result.shared if not k.startswith("mwn.")} | {
        "personal_head.weight"}


def test_local_update_applies_the_generic_rules_correction():
    c = meta_cfg()
    plain, _, _ = meta_update(c)
    prox, _, shared = meta_update(c, rule="fedprox", rule_params={"mu": 5.0})
    assert np.isfinite(prox.loss)
    # FedProx pulls w back towards the global weights: the local model moves less far.
    moved = {name: sum(float((r.shared[k] - shared[k]).norm()) for k in shared if k.startswith("body."))
             for name, r in (("plain", plain), ("prox", prox))}
    assert moved["prox"] < moved["plain"]


def test_local_update_needs_the_meta_set():
    model, shared = model_and_global(4)
    with pytest.raises(ValueError, match="meta set"):
        local_update(model, RoundInput(shared), make_data(),
                     UpdateContext(meta_cfg(), build_rule("fedavg"), 0, 1, 0, MEAN, STD, False))



def skewed_fmnist_client(data_dir) -> tuple[ClientData, ClientData, tuple, tuple]:
    """A client of real Fashion-MNIST holding 300, 80 and 20 examples of classes 0-2, and a balanced meta
    set of 10 examples per class that it does not hold."""
    ds = load_dataset(DataConfig(dataset="fmnist", data_dir=str(data_dir)))
    by_class = [torch.nonzero(ds.train_y == c).squeeze(1) for c in range(10)]
    held = torch.cat([by_class[0][:300], by_class[1][:80], by_class[2][:20]])
    meta = torch.cat([idx[1000:1010] for idx in by_class])

    def data(idx):
        return ClientData(x=ds.train_x[idx], y=ds.train_y[idx], counts=torch.bincount(ds.train_y[idx], minlength=10))

    return data(held), data(meta), ds.mean, ds.std


def test_the_default_meta_step_keeps_a_skewed_clients_weights_in_range(shared_data_dir):
    """The paper's CNN, step and batch on a skewed real client, two local epochs (20 mini-batches): under
    the default meta step sizes the Meta-Weight-Net still weighs every loss value within a factor of a few
    of the others, and gamma_m moves a little. With the earlier meta_lr = 1 the MWN's output layer grew
    ~20x and weighed a loss of 0.5 or more at exactly 0 after these 20 mini-batches (the Fashion-MNIST
    collapse, docs/results.md, "Meta-BSM collapsed, and its fix")."""
    data, meta, mean, std = skewed_fmnist_client(shared_data_dir)
    c = TrainConfig(balanced_loss="meta_bsm", local_epochs=2, batch_size=40, lr=0.01, momentum=0.9,
                    weight_decay=1e-5)
    model = build_model("mnist_cnn", 10, SHAPE, "linear", 0, 0, model_parts(c))
    state = model.state_dict()
    shared = {k: state[k].clone() for k in model.shared_keys()}
    result, _, _ = local_update(model, RoundInput(shared), data,
                                UpdateContext(c, build_rule("fedavg"), 0, 1, 0, mean, std, False, meta_set=meta))
    assert result.steps == 20 and 0.1 < result.loss < 3
    zeta = MetaWeightNet(c.meta_bsm.hidden)
    zeta.load_state_dict({k.removeprefix("mwn."): v for k, v in result.shared.items() if k.startswith("mwn.")})
    with torch.no_grad():
        q = zeta(torch.tensor([0.01, 0.1, 0.5, 1.0, 2.0, 5.0]))
    assert q.min() > 0.1 and q.max() / q.min() < 5
    assert 0.9 < float(result.objectives["meta_bsm"]["gamma"]) < 1.5


# --- the server's meta set -----------------------------------------------------------------------------


@pytest.mark.parametrize("imbalance_ratio", [1.0, 10.0])
def test_meta_set_is_balanced_seeded_and_held_by_no_client(imbalance_ratio):
    y = np.random.default_rng(0).integers(0, 10, 3000)
    cfg = DataConfig(num_clients=8, new_clients=2, alpha=0.3, min_per_client=5, imbalance_ratio=imbalance_ratio)
    p = make_partition(cfg, y, 10, seed=4, meta_per_class=7)
    assert np.bincount(y[p.meta_indices], minlength=10).tolist() == [7] * 10
    held = np.concatenate(p.client_indices)
    assert len(np.unique(held)) == len(held) and not np.isin(p.meta_indices, held).any()
    if imbalance_ratio == 1.0:
        assert len(held) + len(p.meta_indices) == len(y)
    again = make_partition(cfg, y, 10, seed=4, meta_per_class=7)
    assert np.array_equal(again.meta_indices, p.meta_indices)
    assert not np.array_equal(make_partition(cfg, y, 10, seed=5, meta_per_class=7).meta_indices, p.meta_indices)
    assert len(make_partition(cfg, y, 10, seed=4).meta_indices) == 0


def test_meta_set_needs_enough_examples_of_every_class():
    y = np.repeat(np.arange(3), [20, 20, 4])
    with pytest.raises(ValueError, match=r"train.meta_bsm.meta_per_class=5: class 2 has only 4"):
        make_partition(DataConfig(num_clients=2, min_per_client=0), y, 3, seed=0, meta_per_class=5)


# --- config ----------------------------------------------------------------------------------------------


def test_config_defaults_and_gamma():
    t = config_from_dict({}, ["train.balanced_loss=meta_bsm"]).train
    m = t.meta_bsm
    assert (m.meta_lr, m.gamma_lr, m.meta_per_class, m.hidden) == (0.001, 0.1, 10, 100)
    assert meta_per_class(t) == 10 and list(model_parts(t)) == ["mwn"]
    # train.gamma is gamma_m's initial value.
    assert config_from_dict({}, ["train.balanced_loss=meta_bsm", "train.gamma=0.5"]).train.gamma == 0.5
    other = config_from_dict({}).train
    assert meta_per_class(other) == 0 and model_parts(other) == {}


@pytest.mark.parametrize("overrides, message", [
    (["train.meta_bsm.meta_lr=0"], "train.meta_bsm.meta_lr: must be > 0"),
    (["train.meta_bsm.gamma_lr=-1"], "train.meta_bsm.gamma_lr: must be > 0"),
    (["train.meta_bsm.meta_per_class=0"], "train.meta_bsm.meta_per_class: must be > 0"),
    (["train.meta_bsm.hidden=-2"], "train.meta_bsm.hidden: must be > 0"),
    (["train.meta_bsm.hidden=1.5"], "train.meta_bsm.hidden: expected an integer"),
    (["train.meta_bsm.lr=0.1"], "unknown config key train.meta_bsm.lr"),
    (["train.meta_bsm.gamma=2"], "unknown config key train.meta_bsm.gamma"),
])
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({}, ["train.balanced_loss=meta_bsm", *overrides])


@pytest.mark.parametrize("loss", ["bsm", "ce"])
def test_meta_bsm_settings_without_meta_bsm_are_an_error(loss):
    with pytest.raises(ConfigError, match=f"train.meta_bsm.meta_per_class: has no effect with "
                                          f"train.balanced_loss={loss}"):
        config_from_dict({}, [f"train.balanced_loss={loss}", "train.meta_bsm.meta_per_class=5"])


# --- client state, rounds, checkpoints ---------------------------------------------------------------------

BASE = {
    "seed": 3,
    "data": {"dataset": "synthetic", "num_clients": 6, "new_clients": 1, "alpha": 0.3,
             "synthetic_train_per_class": 24, "synthetic_test_per_class": 10, "min_per_client": 4},
    "train": {"rounds": 2, "client_fraction": 0.5, "local_epochs": 1, "batch_size": 16,
              "balanced_loss": "meta_bsm", "meta_bsm": {"meta_per_class": 5, "hidden": 8}},
    "runtime": {"torch_threads": 1},
}


def test_a_federation_round_end_to_end(tmp_path):
    setup = prepare(config_from_dict(BASE))
    meta = setup.partition.meta_indices
    assert len(meta) == 50 and setup.partition.sizes.sum() + 50 == 240
    fed = Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)
    start = dict(fed.global_shared)
    assert any(k.startswith("mwn.") for k in start)
    record = fed.step(0)
    assert record["clients_done"] == record["clients"] == 3
    for key in ("train_loss", "personal_loss", "gfl_gm", "pfl_gm", "pfl_pm"):
        assert np.isfinite(record[key]), key
    trained = {cid: st for cid, st in fed.clients.items() if st.rounds_trained}
    assert len(trained) == 3 and all(st.objectives["meta_bsm"]["gamma"].shape == () for st in trained.values())
    assert all(not st.objectives for cid, st in fed.clients.items() if cid not in trained)
    # zeta is averaged by sample count, like nu; gamma_m stays with its client.
    sizes = setup.partition.sizes
    mwn = [k for k in start if k.startswith("mwn.")]
    want = weighted_average([{k: trained[c].local_model[k] for k in mwn} for c in trained],
                            [float(sizes[c]) for c in trained])
    for k in mwn:
        torch.testing.assert_close(fed.global_shared[k], want[k])
        assert not torch.equal(fed.global_shared[k], start[k])

    # The whole state, gamma_m included, comes back from a checkpoint.
    storage = RunStorage(str(tmp_path / "run"))
    save_checkpoint(storage, fed.snapshot())
    loaded = load_checkpoint(storage)
    for cid, st in fed.clients.items():
        got = loaded.clients[cid]
        assert got.tensors().keys() == st.tensors().keys()
        assert all(torch.equal(v, got.tensors()[k]) for k, v in st.tensors().items())
    assert all(torch.equal(loaded.global_shared[k], v) for k, v in fed.global_shared.items())
    fed.restore(loaded)
    assert np.isfinite(fed.step(1)["gfl_gm"])

    # The served model has no Meta-Weight-Net: final/ loads as any linear Fed-RoD model's.
    meta_model, weights, heads = final_model(fed.setup, fed.snapshot(), record)
    assert not any(k.startswith("mwn.") for k in weights)
    save_final(RunStorage(str(tmp_path / "run")), meta_model, weights, heads)
    assert load_final(str(tmp_path / "run")).meta.balanced_loss == "meta_bsm"


def test_client_state_round_trips_gamma(tmp_path):
    cfg = config_from_dict(BASE)
    state = ClientState(personal={"personal_head.weight": torch.ones(10, 50)}, rounds_trained=2,
                        objectives={"meta_bsm": {"gamma": torch.tensor(0.75)}})
    storage = RunStorage(str(tmp_path / "run"))
    save_checkpoint(storage, Snapshot(2, cfg, {"generic_head.weight": torch.zeros(10, 50)}, {},
                                      {0: state, 1: ClientState()}))
    loaded = load_checkpoint(storage).clients
    assert loaded[0].objectives["meta_bsm"].keys() == {"gamma"} and torch.equal(loaded[0].objectives["meta_bsm"]["gamma"], torch.tensor(0.75))
    assert loaded[0].rounds_trained == 2 and loaded[1].objectives == {}


def test_ray_round_equals_in_process(ray_session):
    from fedrod_ray.executors.ray import RayExecutor, plan_layout

    cfg = config_from_dict(BASE, ["train.rounds=1"])
    setup = prepare(cfg)
    local = Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)
    want = local.step(0)
    executor = RayExecutor(setup, plan_layout(cfg.runtime, len(setup.all_client_ids), ray_session.cluster_resources()))
    try:
        fed = Federation(setup, executor, log=lambda s: None)
        got = fed.step(0)
    finally:
        executor.close()
    assert {k: v for k, v in got.items() if "seconds" not in k} == {k: v for k, v in want.items()
                                                                     if "seconds" not in k}
    assert all(torch.equal(fed.global_shared[k], v) for k, v in local.global_shared.items())
    for cid, st in local.clients.items():
        assert all(torch.equal(fed.clients[cid].tensors()[k], v) for k, v in st.tensors().items())
