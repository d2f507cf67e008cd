"""The generic-FL rules (docs/method.md, "Generic-FL rules": FedProx, FedDyn, SCAFFOLD) on tiny problems.

Hand-made cases use 2-element tensors whose expected values are written as literals, worked out by
hand in the comments; the real-model cases check local_update and Federation.step against the
formulas of the spec, with unequal shard sizes wherever a weighting could hide.
"""

from __future__ import annotations

import pytest
import torch
from tiny import MEAN, SHAPE, STD, N, make_data, model_and_global

from fedrod_ray.algorithms import RULES, build_rule
from fedrod_ray.client_update.local import (
    TRAIN_TAG,
    ClientStart,
    RoundInput,
    UpdateContext,
    derived_seed,
    effective_step_sum,
    local_update,
)
from fedrod_ray.client_update.losses import balanced_softmax
from fedrod_ray.clients.client import ClientFailure
from fedrod_ray.config import ConfigError, TrainConfig, config_from_dict
from fedrod_ray.data.transforms import normalize
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.models import build_model
from fedrod_ray.round_loop.federation import Federation
from fedrod_ray.server_math.aggregate import OrderedAverager
from fedrod_ray.server_math.server import sample_clients

pytestmark = pytest.mark.usefixtures("one_torch_thread")


SEED = 11
CLIENT = 5


# --- helpers ------------------------------------------------------------------------------------------


def tcfg(**kw) -> TrainConfig:
    """Plain SGD (no momentum, no weight decay, no lr decay), one full-batch step by default."""
    base = {"head": "none", "local_epochs": 1, "batch_size": N, "lr": 0.1, "lr_decay": 1.0, "momentum": 0.0,
            "weight_decay": 0.0}
    base.update(kw)
    return TrainConfig(**base)


def run(model, shared, data, c, rule, broadcast=None, personal=None, rule_state=None, round_idx=0):
    return local_update(model, RoundInput(shared, broadcast or {}), data,
                        UpdateContext(c, rule, round_idx, SEED, CLIENT, MEAN, STD, False),
                        ClientStart(personal=personal, rule_state=rule_state))


def random_like(state, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * scale for k, v in state.items()}


def generic_of(model, state):
    keys = set(model.generic_keys())
    return {k: v for k, v in state.items() if k in keys}


def distance(a, b, keys):
    return torch.sqrt(sum(((a[k].double() - b[k].double()) ** 2).sum() for k in keys)).item()


def with_grad(values, grad):
    """A parameter-like tensor holding ``values`` whose .grad is ``grad``."""
    p = torch.tensor(values, requires_grad=True)
    p.grad = torch.tensor(grad)
    return p


def t(*values):
    return torch.tensor(values)


def assert_close(actual, expected, atol=1e-6, rtol=1e-5):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# --- 1. registry and parameters -------------------------------------------------------------------------


def test_registry_holds_the_five_rules_with_their_params():
    """Each name builds its own class; parameters reach Params; defaults apply when none are given."""
    assert set(RULES) == {"fedavg", "fedprox", "feddyn", "scaffold", "local"}
    for name in RULES:
        rule = build_rule(name, {})
        assert type(rule) is RULES[name] and rule.name == name
    assert build_rule("fedprox", {"mu": 0.25}).params.mu == 0.25
    assert build_rule("feddyn", {"alpha": 0.5}).params.alpha == 0.5
    assert build_rule("fedprox", None).params.mu == 0.01  # the documented default


@pytest.mark.parametrize("name, params, field", [
    ("nope", {}, "train.generic_rule"),
    ("fedavg", {"mu": 1.0}, "train.rule_params.mu"),  # fedavg takes no parameter at all
    ("scaffold", {"alpha": 1.0}, "train.rule_params.alpha"),
    ("feddyn", {"alpha": 0.0}, "train.rule_params.alpha"),  # the server step divides by alpha
    ("feddyn", {"alpha": -1.0}, "train.rule_params.alpha"),
    ("fedprox", {"mu": -1.0}, "train.rule_params.mu"),
    ("fedprox", {"mu": "big"}, "train.rule_params.mu"),
    ("fedprox", {"alpha": 0.1}, "train.rule_params.alpha"),  # another rule's parameter
])
def test_build_rule_errors_name_the_field(name, params, field):
    """A bad rule name or parameter is a ConfigError that names the offending config field."""
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build_rule(name, params)


# --- 2. FedAvg -------------------------------------------------------------------------------------------


def test_fedavg_is_the_sample_weighted_average_and_nothing_else():
    """Weights are the sample counts; server_update hands back the averaged w and the state untouched."""
    rule = build_rule("fedavg")
    assert rule.aggregation_weight(30) == 30.0 and rule.aggregation_weight(10) == 10.0
    assert rule.init_server_state({"w": t(1.0, 2.0)}) == {}
    assert rule.broadcast({}) == {}
    assert rule.start_local({"w": t(1.0, 2.0)}, {}, {}) is None  # plain SGD

    # w1 = [3, 2] (10 samples), w2 = [1, 6] (30 samples), folded as Federation.step folds them:
    # [(10*3 + 30*1)/40, (10*2 + 30*6)/40] = [60/40, 200/40] = [1.5, 5].
    avg = OrderedAverager(2)
    avg.add(0, {"w": t(3.0, 2.0)}, rule.aggregation_weight(10))
    avg.add(1, {"w": t(1.0, 6.0)}, rule.aggregation_weight(30))
    averaged = avg.result()
    assert_close(averaged["w"], t(1.5, 5.0))
    new, state = rule.server_update({"w": t(1.0, 2.0)}, averaged, {}, 2, 4, {})
    assert torch.equal(new["w"], t(1.5, 5.0)) and state == {}


# --- 3. FedProx ------------------------------------------------------------------------------------------


def test_fedprox_apply_adds_mu_times_the_distance_to_the_anchor():
    """grad + mu (w - w_bar), by hand; w and w_bar themselves are left alone; finish keeps no state."""
    rule = build_rule("fedprox", {"mu": 0.5})
    anchor = {"w": t(0.0, 4.0)}
    corr = rule.start_local(anchor, {}, {})
    p = with_grad([1.0, 2.0], [0.5, -1.0])
    with torch.no_grad():
        corr.apply({"w": p})
    # [0.5 + 0.5*(1 - 0), -1 + 0.5*(2 - 4)] = [1.0, -2.0]
    assert torch.equal(p.grad, t(1.0, -2.0))
    assert torch.equal(p.detach(), t(1.0, 2.0)) and torch.equal(anchor["w"], t(0.0, 4.0))
    assert corr.finish({"w": t(1.0, 2.0)}, 0.3) == ({}, {})
    # mu = 0 is FedAvg's gradient
    corr0 = build_rule("fedprox", {"mu": 0.0}).start_local(anchor, {}, {})
    q = with_grad([1.0, 2.0], [0.5, -1.0])
    with torch.no_grad():
        corr0.apply({"w": q})
    assert torch.equal(q.grad, t(0.5, -1.0))


def test_fedprox_with_huge_mu_stays_at_the_global_weights_while_fedavg_moves():
    """mu = 1e4 with lr*mu = 1: every step restarts from w_bar - lr*g, so after 16 full-batch steps theta,
    psi sit about one step away from w_bar, while FedAvg's 16 steps carry it ~16 steps away."""
    data = make_data()
    c = tcfg(lr=1e-4, local_epochs=16)
    out = {}
    for name, params in (("fedavg", {}), ("fedprox", {"mu": 1e4})):
        model, shared = model_and_global(None)
        res, _, state = run(model, shared, data, c, build_rule(name, params))
        assert res.steps == 16 and state == {} and res.upload == {}
        out[name] = distance(res.shared, shared, model.generic_keys())
    assert out["fedavg"] > 0
    assert out["fedprox"] < 0.15 * out["fedavg"], out


# --- 4. FedDyn -------------------------------------------------------------------------------------------


def test_feddyn_client_correction_and_state_by_hand():
    """apply: grad + alpha (w - w_bar) - g_m; finish: g_m - alpha (w_m - w_bar), nothing uploaded."""
    rule = build_rule("feddyn", {"alpha": 0.5})
    corr = rule.start_local({"w": t(0.0, 4.0)}, {"w": t(0.25, 1.0)}, {})
    p = with_grad([1.0, 2.0], [0.5, -1.0])
    with torch.no_grad():
        corr.apply({"w": p})
    # [0.5 + 0.5*(1 - 0) - 0.25, -1 + 0.5*(2 - 4) - 1] = [0.75, -3.0]
    assert torch.equal(p.grad, t(0.75, -3.0))
    state, upload = corr.finish({"w": t(1.0, 2.0)}, 0.7)
    # [0.25 - 0.5*(1 - 0), 1 - 0.5*(2 - 4)] = [-0.25, 2.0]
    assert torch.equal(state["w"], t(-0.25, 2.0)) and upload == {}

    # An empty client state is g_m = 0: [0.5 + 0.5*1, -1 + 0.5*(-2)] = [1.0, -2.0]; state = [-0.5, 1.0]
    corr = rule.start_local({"w": t(0.0, 4.0)}, {}, {})
    q = with_grad([1.0, 2.0], [0.5, -1.0])
    with torch.no_grad():
        corr.apply({"w": q})
    assert torch.equal(q.grad, t(1.0, -2.0))
    assert torch.equal(corr.finish({"w": t(1.0, 2.0)}, 0.7)[0]["w"], t(-0.5, 1.0))


def test_feddyn_server_uses_the_plain_mean_over_unequal_shards():
    """Two participants of M = 4 with 10 and 30 samples: the mean is plain, h accumulates over rounds."""
    rule = build_rule("feddyn", {"alpha": 0.5})
    assert rule.aggregation_weight(10) == rule.aggregation_weight(30) == 1.0
    h0 = rule.init_server_state({"w": t(1.0, 2.0)})
    assert torch.equal(h0["w"], t(0.0, 0.0))

    avg = OrderedAverager(2)
    avg.add(0, {"w": t(3.0, 2.0)}, rule.aggregation_weight(10))
    avg.add(1, {"w": t(1.0, 6.0)}, rule.aggregation_weight(30))
    averaged = avg.result()
    # plain mean [2, 4], not the sample-weighted [1.5, 5]
    assert torch.equal(averaged["w"], t(2.0, 4.0))
    new, h = rule.server_update({"w": t(1.0, 2.0)}, averaged, {}, 2, 4, h0)
    # h = 0 - 0.5*(2/4)*([2, 4] - [1, 2]) = [-0.25, -0.5];  w = [2, 4] - h/0.5 = [2.5, 5]
    assert torch.equal(h["w"], t(-0.25, -0.5))
    assert torch.equal(new["w"], t(2.5, 5.0))

    # Next round from w_bar = [2.5, 5], participants' mean [3, 5]:
    # h = [-0.25, -0.5] - 0.5*(2/4)*([0.5, 0]) = [-0.375, -0.5];  w = [3, 5] - h/0.5 = [3.75, 6]
    new, h = rule.server_update({"w": t(2.5, 5.0)}, {"w": t(3.0, 5.0)}, {}, 2, 4, h)
    assert torch.equal(h["w"], t(-0.375, -0.5))
    assert torch.equal(new["w"], t(3.75, 6.0))


def test_feddyn_local_update_leaves_the_dual_state():
    """From zero state, the returned state is -alpha (w_m - w_bar) of the returned w_m; a second update
    that starts from that state trains differently and moves it on by -alpha (w_m' - w_bar')."""
    alpha = 0.5
    rule = build_rule("feddyn", {"alpha": alpha})
    data = make_data()
    c = tcfg(batch_size=8)  # 3 steps
    model, shared = model_and_global(None)
    res, _, g1 = run(model, shared, data, c, rule)
    keys = model.generic_keys()
    assert set(g1) == set(keys) and res.upload == {}
    for k in keys:
        assert_close(g1[k], -alpha * (res.shared[k] - shared[k]), atol=1e-7, rtol=1e-6)
    assert any(torch.count_nonzero(g1[k]) for k in keys)

    # Round 1 from the new global weights, once with the state, once without.
    start = res.shared
    res_with, _, g2 = run(model, start, data, c, rule, rule_state=g1, round_idx=1)
    res_without, _, _ = run(model, start, data, c, rule, rule_state={}, round_idx=1)
    assert distance(res_with.shared, res_without.shared, keys) > 1e-4
    for k in keys:
        assert_close(g2[k], g1[k] - alpha * (res_with.shared[k] - start[k]), atol=1e-7, rtol=1e-6)


# --- 5. SCAFFOLD -----------------------------------------------------------------------------------------


def test_scaffold_client_and_server_by_hand():
    """apply adds c - c_m; finish (option II) and the server's c update, with K = 4, lr = 0.5, P = 2, M = 5."""
    rule = build_rule("scaffold")
    c = {"w": t(1.0, -2.0)}
    assert rule.broadcast(c) == c
    assert torch.equal(rule.init_server_state({"w": t(3.0, 4.0)})["w"], t(0.0, 0.0))
    corr = rule.start_local({"w": t(1.0, 2.0)}, {"w": t(0.25, 0.5)}, c)
    p = with_grad([9.0, 9.0], [0.5, -1.0])
    with torch.no_grad():
        corr.apply({"w": p})
    # c - c_m = [0.75, -2.5]; grad + that = [1.25, -3.5]
    assert torch.equal(p.grad, t(1.25, -3.5))

    state, upload = corr.finish({"w": t(0.0, 6.0)}, 4 * 0.5)
    # (w_bar - w_m)/(K lr) = ([1, 2] - [0, 6]) / 2 = [0.5, -2]
    # c_m+ = c_m - c + [0.5, -2] = [0.25 - 1 + 0.5, 0.5 + 2 - 2] = [-0.25, 0.5]; upload = c_m+ - c_m = [-0.5, 0]
    assert torch.equal(state["w"], t(-0.25, 0.5))
    assert torch.equal(upload["w"], t(-0.5, 0.0))

    # An empty client state is c_m = 0: the step adds c itself.
    q = with_grad([9.0, 9.0], [0.5, -1.0])
    with torch.no_grad():
        rule.start_local({"w": t(1.0, 2.0)}, {}, c).apply({"w": q})
    assert torch.equal(q.grad, t(1.5, -3.0))

    # Server: uploads [-0.5, 0] and [1.5, 2], averaged unweighted = [0.5, 1];
    # c = [1, -2] + (2/5)*[0.5, 1] = [1.2, -1.6]; w_bar is the averaged w as in FedAvg.
    assert rule.aggregation_weight(30) == 30.0
    ups = OrderedAverager(2)
    ups.add(0, {"w": t(-0.5, 0.0)}, 1.0)
    ups.add(1, {"w": t(1.5, 2.0)}, 1.0)
    new, c_new = rule.server_update({"w": t(1.0, 2.0)}, {"w": t(1.5, 5.0)}, ups.result(), 2, 5, c)
    assert torch.equal(new["w"], t(1.5, 5.0))
    assert_close(c_new["w"], t(1.2, -1.6))


def balanced_grad_at(shared, data, c):
    """The raw balanced-softmax gradient of theta, psi at ``shared`` on the whole shard, in local_update's
    shuffled order (one batch = the whole shard)."""
    model = build_model("mnist_cnn", 10, SHAPE, None, 16, 0)
    model.load_partial(shared)
    gen = torch.Generator().manual_seed(derived_seed(SEED, 0, CLIENT, TRAIN_TAG))
    order = torch.randperm(len(data), generator=gen)
    x = normalize(data.x, MEAN, STD)[order]
    y = data.y[order]
    params = dict(model.named_parameters())
    keys = model.generic_keys()
    loss = balanced_softmax(model(x), y, data.counts, 1.0)
    return dict(zip(keys, torch.autograd.grad(loss, [params[k] for k in keys]), strict=True))


def test_scaffold_one_local_step_matches_the_corrected_sgd_step():
    """One plain SGD step: w_m = w_bar - lr (g + c - c_m) with g the balanced-loss gradient, computed by a
    separate autograd call; the new c_m+ = c_m - c + (w_bar - w_m)/lr, which is g itself."""
    lr = 0.5
    rule = build_rule("scaffold")
    data = make_data()
    model, shared = model_and_global(None)
    keys = model.generic_keys()
    c = random_like(generic_of(model, shared), 0.05, seed=7)
    c_m = random_like(generic_of(model, shared), 0.05, seed=8)
    res, _, new_cm = run(model, shared, data, tcfg(lr=lr), rule, broadcast=c, rule_state=c_m)
    assert res.steps == 1 and set(new_cm) == set(keys) == set(res.upload)

    g = balanced_grad_at(shared, data, tcfg())
    for k in keys:
        assert_close(res.shared[k], shared[k] - lr * (g[k] + c[k] - c_m[k]))
        # c_m - c + (w_bar - w_m)/(K lr) with K = 1 = c_m - c + (g + c - c_m) = g
        assert_close(new_cm[k], g[k], atol=2e-5, rtol=1e-4)
        assert_close(res.upload[k], new_cm[k] - c_m[k], atol=1e-7, rtol=1e-6)
    # The correction mattered: without it the step is plain SGD, measurably elsewhere.
    plain, _, _ = run(model, shared, data, tcfg(lr=lr), build_rule("fedavg"))
    assert distance(plain.shared, res.shared, keys) > 1e-2


def test_scaffold_counts_every_local_step_of_every_epoch():
    """K in (w_bar - w_m)/(K lr) is the total number of local steps: 2 epochs x 2 batches = 4."""
    lr = 0.1
    data = make_data()
    model, shared = model_and_global(None)
    c = random_like(generic_of(model, shared), 0.05, seed=7)
    c_m = random_like(generic_of(model, shared), 0.05, seed=8)
    res, _, new_cm = run(model, shared, data, tcfg(lr=lr, local_epochs=2, batch_size=N // 2),
                         build_rule("scaffold"), broadcast=c, rule_state=c_m)
    assert res.steps == 4
    for k in model.generic_keys():
        # K lr = 4 * 0.1 = 0.4
        assert_close(new_cm[k], c_m[k] - c[k] + (shared[k] - res.shared[k]) / 0.4, atol=1e-6, rtol=1e-5)


def test_effective_step_sum_by_hand():
    """K steps of heavy-ball SGD move w by lr * sum_{s<K} (1 - beta^(K-s)) / (1 - beta) along a constant
    gradient: K without momentum; K=3, beta=0.5: 1.75 + 1.5 + 1 = 4.25."""
    assert effective_step_sum(4, 0.0) == 4.0
    assert effective_step_sum(3, 0.5) == 4.25
    # ... which is exactly what torch's SGD does with a constant gradient g = 1 from a zero buffer.
    w = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.5)
    for _ in range(3):
        opt.zero_grad()
        (-w).sum().backward()  # d/dw of -w = -1: w moves by +lr * 1 each unit
        opt.step()
    assert_close(w.detach(), torch.tensor([0.1 * 4.25]), atol=1e-7, rtol=0)


def test_scaffold_under_momentum_divides_by_the_effective_step_sum():
    """With momentum 0.5 and 4 steps, option II's K lr becomes lr * (1.875 + 1.75 + 1.5 + 1) = 0.6125."""
    data = make_data()
    model, shared = model_and_global(None)
    c = random_like(generic_of(model, shared), 0.05, seed=7)
    c_m = random_like(generic_of(model, shared), 0.05, seed=8)
    res, _, new_cm = run(model, shared, data, tcfg(lr=0.1, momentum=0.5, local_epochs=2, batch_size=N // 2),
                         build_rule("scaffold"), broadcast=c, rule_state=c_m)
    assert res.steps == 4
    for k in model.generic_keys():
        assert_close(new_cm[k], c_m[k] - c[k] + (shared[k] - res.shared[k]) / 0.6125, atol=1e-6, rtol=1e-5)


# --- 6. the personalized part is the rule's business nowhere ---------------------------------------------

# phi_m's update at step k sees the features of theta after step k-1, so a rule's change to theta
# reaches phi one step later. Each case stops at the first step where the rule acts on theta, psi:
# phi must then be bitwise FedAvg's, while theta, psi are not.
PERSONAL_CASES = [
    # name, params, batch size (N/2: two steps, N: one), client state / broadcast (seeds of random ones)
    ("fedprox", {"mu": 5.0}, N // 2, None, None),  # step 1 at w = w_bar: no term; step 2 has one
    ("feddyn", {"alpha": 0.5}, N // 2, None, None),  # likewise from g_m = 0
    ("feddyn", {"alpha": 0.5}, N, 21, None),  # one step with g_m != 0
    ("scaffold", {}, N, 21, 22),  # one step with c - c_m != 0
]


@pytest.mark.parametrize("name, params, batch, state_seed, bcast_seed", PERSONAL_CASES)
def test_rules_leave_the_linear_personal_head_alone(name, params, batch, state_seed, bcast_seed):
    """The returned phi_m under each rule equals FedAvg's bitwise (same data, seed, stored phi_m); the
    rule state covers exactly theta, psi."""
    data = make_data()
    c = tcfg(head="linear", batch_size=batch, lr=0.2)
    g = torch.Generator().manual_seed(4)
    personal = {"personal_head.weight": torch.randn(10, 50, generator=g) * 0.3}
    ref_model, shared = model_and_global("linear")
    ref, ref_personal, _ = run(ref_model, shared, data, c, build_rule("fedavg"), personal=personal)

    model, _ = model_and_global("linear")
    generic = generic_of(model, shared)
    state = random_like(generic, 0.05, state_seed) if state_seed is not None else None
    bcast = random_like(generic, 0.05, bcast_seed) if bcast_seed is not None else None
    res, new_personal, new_state = run(model, shared, data, c, build_rule(name, params), broadcast=bcast,
                                       personal=personal, rule_state=state)
    assert set(new_personal) == {"personal_head.weight"}
    assert torch.equal(new_personal["personal_head.weight"], ref_personal["personal_head.weight"])
    assert not torch.equal(new_personal["personal_head.weight"], personal["personal_head.weight"])
    assert distance(res.shared, ref.shared, model.generic_keys()) > 1e-5  # the rule did act on theta, psi
    assert set(new_state) == (set() if name == "fedprox" else set(model.generic_keys()))


def test_fedprox_does_not_pull_nu_back():
    """Hyper head: a huge mu pins theta, psi to w_bar, but nu (trained by the personalized loss, outside
    the rule) moves about as far as under FedAvg. A proximal term on nu would pin it just the same."""
    data = make_data()
    c = tcfg(head="hyper", lr=1e-4, local_epochs=16)
    moved = {}
    for name, params in (("fedavg", {}), ("fedprox", {"mu": 1e4})):
        model, shared = model_and_global("hyper")
        res, new_personal, state = run(model, shared, data, c, build_rule(name, params))
        assert new_personal is None and state == {}
        nu = [k for k in model.shared_keys() if k.startswith("hypernet.")]
        assert nu and not set(nu) & set(model.generic_keys())
        moved[name] = (distance(res.shared, shared, model.generic_keys()), distance(res.shared, shared, nu))
    (w_avg, nu_avg), (w_prox, nu_prox) = moved["fedavg"], moved["fedprox"]
    assert nu_avg > 0 and w_avg > 0
    assert w_prox < 0.15 * w_avg, moved
    assert nu_prox > 0.5 * nu_avg, moved


# --- 7. every rule x head x balanced loss ----------------------------------------------------------------


@pytest.mark.parametrize("loss", ["bsm", "ce"])
@pytest.mark.parametrize("head", ["none", "linear", "hyper"])
@pytest.mark.parametrize("name", ["fedavg", "fedprox", "feddyn", "scaffold"])
def test_every_rule_head_and_loss_runs(name, head, loss):
    """Two local steps from non-zero rule state: finite losses, weights, state and upload of the right keys."""
    variant = None if head == "none" else head
    data = make_data(n=16)
    c = tcfg(head=head, balanced_loss=loss, batch_size=8, lr=0.05, momentum=0.9, weight_decay=1e-4)
    rule = build_rule(name, {"fedprox": {"mu": 0.1}, "feddyn": {"alpha": 0.1}}.get(name, {}))
    model, shared = model_and_global(variant)
    generic = generic_of(model, shared)
    res, personal, state = run(model, shared, data, c, rule, broadcast=rule.broadcast(random_like(generic, 0.01, 1)),
                               rule_state=random_like(generic, 0.01, 2))
    assert res.steps == 2 and res.num_samples == 16
    assert torch.isfinite(torch.tensor(res.loss))
    assert (res.personal_loss is None) == (variant is None)
    if variant is not None:
        assert torch.isfinite(torch.tensor(res.personal_loss))
    assert set(res.shared) == set(model.shared_keys())
    assert (personal is not None) == (variant == "linear")
    stateful = name in ("feddyn", "scaffold")
    assert set(state) == (set(generic) if stateful else set())
    assert set(res.upload) == (set(generic) if name == "scaffold" else set())
    for part in (res.shared, personal or {}, state, res.upload):
        for k, v in part.items():
            assert torch.isfinite(v).all(), k
    assert distance(res.shared, shared, generic) > 0


# --- Federation.step with unequal shards -------------------------------------------------------------


def fed_config(rule, params, head):
    return config_from_dict({
        "seed": 3,
        "data": {"dataset": "synthetic", "num_clients": 4, "new_clients": 0, "alpha": 0.3,
                 "synthetic_train_per_class": 24, "synthetic_test_per_class": 10, "min_per_client": 4},
        "train": {"rounds": 3, "client_fraction": 0.5, "local_epochs": 1, "batch_size": 16, "head": head,
                  "generic_rule": rule, "rule_params": params},
        "eval": {"eval_every": 100},
    })


def two_federations(rule, params, head="linear"):
    """The federation under test and a reference one whose host reproduces the client updates."""
    setup = prepare(fed_config(rule, params, head))
    fed = Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)
    ref = Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)
    return setup, fed, ref


def sampled_unequal(setup, r):
    ids = sample_clients(setup.cfg.seed, r, setup.num_clients, setup.cfg.train.client_fraction)
    sizes = [len(setup.partition.client_indices[cid]) for cid in ids]
    assert len(ids) == 2 and sizes[0] != sizes[1], (ids, sizes)  # the case where a weighting shows
    return ids, sizes


def reproduce(ref, ids, weights, broadcast, r):
    """The clients' updates, done by hand from the reference federation's client states (kept up to date)."""
    outs = [ref.executor.host.train(cid, ref.clients[cid], RoundInput(weights, broadcast), r) for cid in ids]
    for out in outs:
        assert not isinstance(out, ClientFailure), out
    ref.clients.update({cid: state for cid, (_, state) in zip(ids, outs, strict=True)})
    return [res for res, _ in outs]


def mean64(states, weights, keys):
    total = float(sum(weights))
    return {k: sum(w * s[k].double() for s, w in zip(states, weights, strict=True)) / total for k in keys}


@pytest.mark.parametrize("head", ["linear", "hyper"])
def test_feddyn_round_is_the_plain_mean_minus_h_over_alpha(head):
    """theta, psi <- plain mean of the participants' w_m - h/alpha, h = -alpha (|P|/M) (mean - w_bar); (hyper)
    nu is still averaged by sample count; and the sample-weighted mean would have given other weights."""
    alpha = 0.5
    setup, fed, ref = two_federations("feddyn", {"alpha": alpha}, head)
    ids, sizes = sampled_unequal(setup, 0)
    start = {k: v.clone() for k, v in fed.global_shared.items()}
    results = reproduce(ref, ids, start, ref.rule.broadcast(ref.server_state), 0)
    fed.step(0)

    generic = sorted(fed.generic_keys)
    rest = [k for k in fed.shared_keys if k not in fed.generic_keys]
    assert bool(rest) == (head == "hyper")
    shared = [res.shared for res in results]
    m, p = setup.num_clients, len(ids)
    for weights, must_match in (([1.0, 1.0], True), (sizes, False)):
        mean = mean64(shared, weights, generic)
        h = {k: 0.0 - alpha * (p / m) * (mean[k] - start[k].double()) for k in generic}
        expected = {k: mean[k] - h[k] / alpha for k in generic}
        gap = max((fed.global_shared[k].double() - expected[k]).abs().max().item() for k in generic)
        if must_match:
            assert gap < 1e-6
            for k in generic:
                assert_close(fed.server_state[k].double(), h[k], atol=1e-7, rtol=1e-5)
        else:
            assert gap > 1e-4  # the weighting is visible at this scale
    if rest:
        nu = mean64(shared, sizes, rest)
        for k in rest:
            assert_close(fed.global_shared[k].double(), nu[k], atol=1e-7, rtol=1e-5)
        plain = mean64(shared, [1.0, 1.0], rest)
        assert max((plain[k] - nu[k]).abs().max().item() for k in rest) > 1e-6
    # Each participant keeps g_m = -alpha (w_m - w_bar); the others keep nothing.
    for cid, res in zip(ids, results, strict=True):
        state = fed.clients[cid].rule_state
        for k in generic:
            assert torch.equal(state[k], ref.clients[cid].rule_state[k])
            assert_close(state[k], -alpha * (res.shared[k] - start[k]), atol=1e-7, rtol=1e-5)
    for cid in set(setup.all_client_ids) - set(ids):
        assert fed.clients[cid].rule_state == {}


def test_scaffold_server_control_variate_over_two_rounds():
    """c <- c + (|P|/M) * (unweighted mean of the uploads), w_bar <- the sample-weighted mean, over two
    rounds whose participant sets overlap (client state and the broadcast c carry over)."""
    setup, fed, ref = two_federations("scaffold", {})
    m = setup.num_clients
    weights = {k: v.clone() for k, v in fed.global_shared.items()}
    c = {k: torch.zeros_like(weights[k]) for k in fed.generic_keys}
    seen = set()
    for r in range(2):
        ids, sizes = sampled_unequal(setup, r)
        seen.update(ids)
        assert fed.rule.broadcast(fed.server_state).keys() == c.keys()
        for k, v in c.items():
            assert_close(fed.server_state[k], v, atol=1e-7, rtol=1e-5)
        before = {cid: dict(ref.clients[cid].rule_state) for cid in ids}
        results = reproduce(ref, ids, weights, c, r)
        fed.step(r)

        uploads = [res.upload for res in results]
        mean_up = mean64(uploads, [1.0, 1.0], c)
        c_new = {k: c[k].double() + (len(ids) / m) * mean_up[k] for k in c}
        weighted_up = mean64(uploads, sizes, c)
        for k in c:
            # c is kept in float32: the mean of uploads that nearly cancel leaves a few 1e-8 of rounding
            # (3e-8 seen on an AVX2 CPU), far below the 1e-4 a wrong weighting makes (the gap below).
            assert_close(fed.server_state[k].double(), c_new[k], atol=1e-7, rtol=1e-5)
        gap = max((c[k].double() + (len(ids) / m) * weighted_up[k] - c_new[k]).abs().max().item() for k in c)
        assert gap > 1e-4  # an upload weighted by sample count would be visible
        # upload = c_m+ - c_m, and the participants keep c_m+
        for cid, res in zip(ids, results, strict=True):
            kept = fed.clients[cid].rule_state
            old = before[cid]
            for k in c:
                assert torch.equal(kept[k], ref.clients[cid].rule_state[k])
                assert_close(res.upload[k], kept[k] - old.get(k, torch.zeros_like(kept[k])), atol=1e-7, rtol=1e-5)
        expected_w = mean64([res.shared for res in results], sizes, fed.shared_keys)
        for k in fed.shared_keys:
            assert_close(fed.global_shared[k].double(), expected_w[k], atol=1e-7, rtol=1e-5)
        weights = {k: v.clone() for k, v in fed.global_shared.items()}
        c = {k: v.clone() for k, v in fed.server_state.items()}
    assert len(seen) == 3  # one client trained in both rounds: its c_m carried over
