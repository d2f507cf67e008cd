"""local_update: the stop-gradients of docs/method.md, "One round", step 2, determinism, returned state, failures."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import MEAN, SHAPE, STD, N, make_data, model_and_global

from fedrod_ray.algorithms import build_rule
from fedrod_ray.client_update.local import (
    TRAIN_TAG,
    ClientData,
    ClientStart,
    LocalTrainingError,
    RoundInput,
    UpdateContext,
    derived_seed,
    local_update,
)
from fedrod_ray.client_update.losses import balanced_softmax
from fedrod_ray.config import TrainConfig
from fedrod_ray.data.transforms import normalize
from fedrod_ray.models import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cfg(**kw) -> TrainConfig:
    base = {"local_epochs": 1, "batch_size": N, "lr": 0.1, "lr_decay": 1.0, "momentum": 0.0,
            "weight_decay": 0.0}
    base.update(kw)
    return TrainConfig(**base)


def random_personal(seed=4):
    g = torch.Generator().manual_seed(seed)
    return {"personal_head.weight": torch.randn(10, 50, generator=g) * 0.3}


def run(model, shared, data, c, round_idx=0, client_id=5, personal=None, rule_state=None, std=STD, augment=False,
        momentum_buffers=None):
    return local_update(model, RoundInput(shared), data,
                        UpdateContext(c, build_rule(c.generic_rule, c.rule_params), round_idx, 11, client_id, MEAN,
                                      std, augment),
                        ClientStart(personal=personal, rule_state=rule_state, momentum=momentum_buffers))


def reference_step(variant, shared, personal, data, lr, client_id=5, round_idx=0, leaky=False):
    """One SGD step on the full shard, computed here with separate autograd calls per loss.

    ``leaky=True`` is the wrong objective (no detach), to show the comparison can tell them apart.
    """
    model = build_model("mnist_cnn", 10, SHAPE, variant)
    model.load_partial(shared)
    if personal is not None:
        model.load_partial(personal)
    gen = torch.Generator().manual_seed(derived_seed(11, round_idx, client_id, TRAIN_TAG))
    order = torch.randperm(len(data), generator=gen)
    x = normalize(data.x, MEAN, STD)[order]
    y = data.y[order]
    params = dict(model.named_parameters())
    generic = {k: p for k, p in params.items() if k.startswith(("body.", "generic_head."))}
    own = {k: p for k, p in params.items() if k not in generic}

    z = model.features(x)
    g = model.generic_head(z)
    loss_g = balanced_softmax(g, y, data.counts, 1.0)
    grads_g = dict(zip(generic, torch.autograd.grad(loss_g, list(generic.values()), retain_graph=True),
                       strict=True))
    if leaky:
        logits_p = model.personal_logits(z, g, data.class_dist)
    else:
        logits_p = model.personal_logits(z.detach(), g.detach(), data.class_dist)
    loss_p = F.cross_entropy(logits_p, y)
    all_p = list(generic.values()) + list(own.values())
    grads_p = dict(zip(list(generic) + list(own),
                       torch.autograd.grad(loss_p, all_p, allow_unused=True), strict=True))
    out = {}
    with torch.no_grad():
        for k, p in params.items():
            grad = torch.zeros_like(p)
            if k in grads_g:
                grad += grads_g[k]
            if grads_p.get(k) is not None:
                grad += grads_p[k]
            out[k] = p - lr * grad
    return out


@pytest.mark.parametrize("variant", ["linear", "hyper"])
def test_personalized_loss_alone_has_no_gradient_on_theta_psi(variant):
    """The exact expression local.py uses: CE(h_G(z).detach() + h_P(z.detach()))."""
    model, _ = model_and_global(variant)
    if variant == "linear":
        model.load_partial(random_personal())
    data = make_data()
    x = normalize(data.x, MEAN, STD)
    z = model.features(x)
    g = model.generic_head(z)
    loss_p = F.cross_entropy(model.personal_logits(z.detach(), g.detach(), data.class_dist), data.y)
    names, params = zip(*model.named_parameters(), strict=True)
    grads = dict(zip(names, torch.autograd.grad(loss_p, params, allow_unused=True), strict=True))
    own = "personal_head." if variant == "linear" else "hypernet."
    for k, v in grads.items():
        if k.startswith(("body.", "generic_head.")):
            assert v is None or torch.count_nonzero(v) == 0, k
        else:
            assert k.startswith(own)
    assert any(v is not None and torch.count_nonzero(v) > 0 for k, v in grads.items() if k.startswith(own))
    if variant == "hyper":
        # both hypernet layers get gradient through the generated head
        assert torch.count_nonzero(grads["hypernet.net.0.weight"]) > 0
        assert torch.count_nonzero(grads["hypernet.net.2.weight"]) > 0

    # ... and the balanced loss puts no gradient on the personal part
    loss_g = balanced_softmax(model.generic_head(model.features(x)), data.y, data.counts, 1.0)
    grads = dict(zip(names, torch.autograd.grad(loss_g, params, allow_unused=True), strict=True))
    for k, v in grads.items():
        if k.startswith(own):
            assert v is None or torch.count_nonzero(v) == 0, k
        else:
            assert v is not None and torch.count_nonzero(v) > 0, k


@pytest.mark.parametrize("variant", ["linear", "hyper"])
def test_one_local_step_matches_separate_gradients(variant):
    """One SGD step of local_update equals theta,psi -= lr*grad(l_BR) and phi/nu -= lr*grad(l_P) only."""
    data = make_data()
    model, shared = model_and_global(variant)
    personal = random_personal() if variant == "linear" else None
    c = cfg(lr=0.5)
    result, new_personal, _ = run(model, shared, data, c, personal=personal)
    assert result.steps == 1
    got = dict(result.shared)
    if variant == "linear":
        got.update(new_personal)

    expected = reference_step(variant, shared, personal, data, 0.5)
    leaky = reference_step(variant, shared, personal, data, 0.5, leaky=True)
    assert set(got) == set(expected)
    for k in expected:
        assert torch.allclose(got[k], expected[k], rtol=1e-4, atol=1e-6), k
    # the test is sensitive: letting the personalized loss reach theta/psi changes their update visibly
    diff = max((leaky[k] - expected[k]).abs().max().item() for k in expected
               if k.startswith(("body.", "generic_head.")))
    assert diff > 1e-3
    # and the generic weights did move
    assert not torch.equal(got["generic_head.weight"], shared["generic_head.weight"])


def test_deterministic_per_seed_round_client():
    data = make_data()
    c = cfg(local_epochs=2, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-5)
    model, shared = model_and_global("linear")
    r1, p1, _ = run(model, shared, data, c, round_idx=3)
    # the same model object again: nothing may leak from the previous call
    r2, p2, _ = run(model, shared, data, c, round_idx=3)
    fresh, _ = model_and_global("linear")
    r3, _, _ = run(fresh, shared, data, c, round_idx=3)
    for k in r1.shared:
        assert torch.equal(r1.shared[k], r2.shared[k]), k
        assert torch.equal(r1.shared[k], r3.shared[k]), k
    assert torch.equal(p1["personal_head.weight"], p2["personal_head.weight"])
    assert r1.loss == r2.loss and r1.personal_loss == r2.personal_loss
    assert r1.steps == 6

    r4, _, _ = run(model, shared, data, c, round_idx=4)
    assert any(not torch.equal(r1.shared[k], r4.shared[k]) for k in r1.shared)
    r5, _, _ = run(model, shared, data, c, round_idx=3, client_id=6)
    assert any(not torch.equal(r1.shared[k], r5.shared[k]) for k in r1.shared)


def test_global_weights_are_not_modified():
    data = make_data()
    model, shared = model_and_global("hyper")
    before = {k: v.clone() for k, v in shared.items()}
    run(model, shared, data, cfg(local_epochs=2, batch_size=8, generic_rule="fedprox", rule_params={"mu": 0.1}))
    assert all(torch.equal(before[k], shared[k]) for k in before)


def test_linear_variant_returns_personal_head_not_in_shared():
    data = make_data()
    model, shared = model_and_global("linear")
    result, personal, dyn = run(model, shared, data, cfg(local_epochs=2, batch_size=8))
    assert set(personal) == {"personal_head.weight"}
    assert "personal_head.weight" not in result.shared
    assert set(result.shared) == set(model.shared_keys())
    # fresh P-head starts at zero and is trained by the personalized loss
    assert torch.count_nonzero(personal["personal_head.weight"]) > 0
    assert result.num_samples == N
    assert result.personal_loss is not None and result.personal_loss > 0
    assert dyn == {}
    # the stored head is carried into the next round: a different head gives a different result
    r2, p2, _ = run(model, shared, data, cfg(local_epochs=2, batch_size=8), personal=random_personal())
    assert not torch.equal(p2["personal_head.weight"], personal["personal_head.weight"])
    # ... but the generic part does not depend on phi (stop-gradient): theta, psi are identical
    for k in result.shared:
        assert torch.equal(result.shared[k], r2.shared[k]), k


def test_hyper_variant_returns_hypernet_in_shared_and_no_personal():
    data = make_data()
    model, shared = model_and_global("hyper")
    result, personal, _ = run(model, shared, data, cfg(local_epochs=1, batch_size=8))
    assert personal is None
    assert {"hypernet.net.0.weight", "hypernet.net.2.weight"} <= set(result.shared)
    assert not torch.equal(result.shared["hypernet.net.2.weight"], shared["hypernet.net.2.weight"])


def test_head_none_has_no_personal_head():
    data = make_data()
    model, shared = model_and_global(None)
    result, personal, dyn = run(model, shared, data, cfg(local_epochs=1, batch_size=8, head="none"))
    assert personal is None and dyn == {}
    assert result.personal_loss is None
    assert set(result.shared) == set(model.generic_keys())


def test_nan_input_raises_local_training_error():
    data = make_data()
    model, shared = model_and_global("linear")
    with pytest.raises(LocalTrainingError):
        run(model, shared, data, cfg(), std=(0.0,))  # x / 0: +-inf inputs


def test_divergent_lr_raises_local_training_error():
    data = make_data()
    model, shared = model_and_global(None)
    with pytest.raises(LocalTrainingError):
        run(model, shared, data, cfg(lr=1e30, local_epochs=3, batch_size=8, head="none"))


def test_empty_shard_raises_local_training_error():
    data = make_data()
    empty = ClientData(x=data.x[:0], y=data.y[:0], counts=torch.zeros(10, dtype=torch.long))
    model, shared = model_and_global("linear")
    with pytest.raises(LocalTrainingError, match="no training examples"):
        run(model, shared, empty, cfg())


def test_one_head_model_trains_with_the_configured_balanced_loss():
    """FedAvg with BRM: the one-head model's update follows train.balanced_loss (it used to be CE
    whatever was configured). One full-batch SGD step from the same weights: the generic head moves by
    -lr * grad of that loss."""
    data = make_data()
    model, shared = model_and_global(None)
    z = model.features(normalize(data.x, MEAN, STD)).detach()  # before run() leaves its local model in `model`
    grads = {}
    for loss_name, fn in (("bsm", lambda g: balanced_softmax(g, data.y, data.counts, 1.0)),
                          ("ce", lambda g: F.cross_entropy(g, data.y))):
        head = shared["generic_head.weight"].clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(fn(F.linear(z, head)), [head])
        grads[loss_name] = grad
        result, _, _ = run(model, shared, data, cfg(head="none", balanced_loss=loss_name, lr=0.5))
        expected = shared["generic_head.weight"] - 0.5 * grad
        assert torch.allclose(result.shared["generic_head.weight"], expected, atol=1e-6), loss_name
        assert result.seconds > 0
    assert (grads["bsm"] - grads["ce"]).abs().max() > 1e-3  # the two losses really differ here


def _distance(a, b, keys):
    return sum(((a[k] - b[k]).double() ** 2).sum().item() for k in keys) ** 0.5


def test_fedprox_stays_closer_to_global_than_fedavg():
    data = make_data()
    model, shared = model_and_global("linear")
    keys = model.generic_keys()
    base = {"local_epochs": 3, "batch_size": 8, "lr": 0.05}
    avg, _, _ = run(model, shared, data, cfg(**base))
    prox, _, _ = run(model, shared, data, cfg(generic_rule="fedprox", rule_params={"mu": 5.0}, **base))
    d_avg = _distance(avg.shared, shared, keys)
    d_prox = _distance(prox.shared, shared, keys)
    assert 0 < d_prox < 0.95 * d_avg


def test_fedprox_with_zero_mu_equals_fedavg():
    data = make_data()
    model, shared = model_and_global("linear")
    base = {"local_epochs": 2, "batch_size": 8, "lr": 0.05}
    avg, _, _ = run(model, shared, data, cfg(**base))
    prox, _, _ = run(model, shared, data, cfg(generic_rule="fedprox", rule_params={"mu": 0.0}, **base))
    for k in avg.shared:
        assert torch.equal(avg.shared[k], prox.shared[k]), k


def test_feddyn_returns_dyn_grad_state():
    data = make_data()
    model, shared = model_and_global("hyper")
    alpha = 0.1
    c = cfg(generic_rule="feddyn", rule_params={"alpha": alpha}, local_epochs=2, batch_size=8, lr=0.05)
    result, personal, dyn = run(model, shared, data, c)
    assert personal is None
    assert dyn is not None
    assert set(dyn) == set(model.generic_keys())
    # starting from zero state: g_m = 0 - alpha * (theta_m - theta_global)
    for k in dyn:
        expected = -alpha * (result.shared[k] - shared[k])
        assert torch.allclose(dyn[k], expected, atol=1e-9), k
    assert any(torch.count_nonzero(v) > 0 for v in dyn.values())
    # the state is used in the next round: a non-zero one changes the update
    r2, _, dyn2 = run(model, shared, data, c, rule_state=dyn)
    assert any(not torch.equal(result.shared[k], r2.shared[k]) for k in dyn)
    for k in dyn2:
        assert torch.allclose(dyn2[k], dyn[k] - alpha * (r2.shared[k] - shared[k]), atol=1e-9), k


def test_client_data_class_dist():
    data = make_data()
    assert torch.allclose(data.class_dist, data.counts.float() / N)
    assert len(data) == N


def test_augmentation_pads_with_black():
    """All-black images are unchanged by pad-with-black + crop + flip, so augment=True must then give
    exactly the augment=False update (one epoch, one batch: the shuffle is drawn before the augmentation)."""
    data = make_data()
    data.x.zero_()
    model, shared = model_and_global("linear")
    c = cfg(lr=0.5)
    plain, _, _ = run(model, shared, data, c)
    augmented, _, _ = run(model, shared, data, c, augment=True)
    for k in plain.shared:
        assert torch.equal(plain.shared[k], augmented.shared[k]), k


@pytest.mark.parametrize("variant", ["linear", "hyper"])
def test_kept_momentum_buffers_carry_into_the_clients_next_round(variant):
    """Two rounds of one client, one full-batch step each (momentum beta = 0.9, lr = 0.1). Round 1 starts
    from zero buffers, so its buffer is its gradient g1 and w1 = w0 - lr g1. Round 2 starts from new global
    weights w0' (the server's average) with the same batch, gradient g2: reset gives w0' - lr g2; keep
    continues the buffer, b2 = beta g1 + g2, so its weights end lr beta g1 below reset's."""
    data = make_data()
    model, shared = model_and_global(variant)
    keep, reset = cfg(momentum=0.9, momentum_buffers="keep"), cfg(momentum=0.9)
    personal = random_personal() if variant == "linear" else None
    r1, p1, _ = run(model, shared, data, keep, personal=personal)
    start1 = {**shared, **(personal or {})}
    trained1 = {**r1.shared, **(p1 or {})}
    assert r1.steps == 1 and set(r1.momentum) == set(dict(model.named_parameters())) == set(trained1)
    for k, g1 in r1.momentum.items():
        torch.testing.assert_close(g1, (start1[k] - trained1[k]) / 0.1, rtol=1e-3, atol=1e-5, msg=k)
    assert all(g.abs().max() > 1e-4 for g in r1.momentum.values())

    noise = torch.Generator().manual_seed(9)
    shared2 = {k: v + 0.01 * torch.randn(v.shape, generator=noise) for k, v in r1.shared.items()}
    kept = {k: v.clone() for k, v in r1.momentum.items()}
    r2r, p2r, _ = run(model, shared2, data, reset, round_idx=1, personal=p1)
    r2k, p2k, _ = run(model, shared2, data, keep, round_idx=1, personal=p1, momentum_buffers=r1.momentum)
    assert r2r.momentum == {}  # reset: nothing to keep
    # The kept buffers are the client's committed state: read, never written into.
    assert all(torch.equal(kept[k], r1.momentum[k]) for k in kept)
    start2 = {**shared2, **(p1 or {})}
    w_reset, w_keep = {**r2r.shared, **(p2r or {})}, {**r2k.shared, **(p2k or {})}
    for k, g1 in kept.items():
        g2 = (start2[k] - w_reset[k]) / 0.1
        torch.testing.assert_close(w_keep[k] - w_reset[k], -0.1 * 0.9 * g1, rtol=1e-3, atol=1e-6, msg=k)
        torch.testing.assert_close(r2k.momentum[k], 0.9 * g1 + g2, rtol=1e-3, atol=1e-5, msg=k)


def test_a_kept_momentum_buffer_that_fits_no_parameter_is_an_error():
    data = make_data()
    model, shared = model_and_global("linear")
    keep = cfg(momentum=0.9, momentum_buffers="keep")
    with pytest.raises(ValueError, match=r"momentum buffer generic_head.weight: shape \(3,\) does not match the "
                                         r"parameter's \(10, 50\)"):
        run(model, shared, data, keep, momentum_buffers={"generic_head.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"momentum buffer hypernet.net.0.weight: the model has no such parameter"):
        run(model, shared, data, keep, momentum_buffers={"hypernet.net.0.weight": torch.zeros(16, 10)})


def test_a_kept_buffer_stored_contiguous_continues_to_the_same_bits():
    """A checkpoint stores a buffer contiguous, whatever the layout its channels_last conv weight gave it:
    the next update from it is the same bits as from the buffer as it was kept."""
    data = make_data()
    model, shared = model_and_global("linear")
    keep = cfg(momentum=0.9, momentum_buffers="keep", local_epochs=2, batch_size=8)
    r1, p1, _ = run(model, shared, data, keep)
    # The second conv's (the first has one input channel, for which both layouts are the same).
    assert any(v.dim() == 4 and not v.is_contiguous() for v in r1.momentum.values())
    contiguous = {k: v.contiguous() for k, v in r1.momentum.items()}
    a, _, _ = run(model, r1.shared, data, keep, round_idx=1, personal=p1, momentum_buffers=r1.momentum)
    b, _, _ = run(model, r1.shared, data, keep, round_idx=1, personal=p1, momentum_buffers=contiguous)
    for part_a, part_b in ((a.shared, b.shared), (a.momentum, b.momentum)):
        assert part_a.keys() == part_b.keys()
        assert all(torch.equal(part_a[k], part_b[k]) for k in part_a)
