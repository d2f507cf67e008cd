"""FedALA and FedDBE (docs/method.md, "Today's strongest P-FL methods"): each one's client step and server
step by hand on tiny tensors (the spec's "Check" examples), and their state across rounds in process."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from fedrod_ray_tune.space import load_sweep
from fedrod_ray_tune.tables import MAIN
from test_federation import make_federation

from fedrod_ray.config import ConfigError, config_from_dict
from fedrod_ray.models.readouts import DBEReadout
from fedrod_ray.personalization import ServerContext, build_method
from fedrod_ray.personalization.fedala import START, WEIGHTS, ala_step, blend, learn_weights
from fedrod_ray.personalization.feddbe import (
    CONSENSUS,
    INITIAL,
    READY,
    RUNNING,
    SAMPLES,
    SHIFT,
    DBELoss,
    consensus_mean,
    mean_regularizer,
    running_mean,
)
from fedrod_ray.specs.methods import FedALAParams, FedDBEParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FEDALA = ("train.head=fedala", "train.balanced_loss=ce")

# --- FedALA ----------------------------------------------------------------------------------------------------

LOCAL, GLOBAL, TARGET = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 0.0]), torch.tensor([2.8, -0.4])


def half_square(top, xb, yb):
    """1/2 ||theta^ - a||^2 with a = (2.8, -0.4): its gradient at theta^ is theta^ - a."""
    return 0.5 * ((top["t"] - TARGET) ** 2).sum()


def test_fedala_one_batch_of_weight_learning_by_hand():
    # theta^ = 1 + 2 * 1, 2 - 2 * 1 = (3, 0); G = (0.2, 0.4); G * (Theta - theta^loc) = (0.4, -0.8);
    # W = clip(1 - 0.4, 1 + 0.8) = (0.6, 1.0); theta^ = (1 + 2 * 0.6, 2 - 2 * 1) = (2.2, 0.0).
    w = {"t": torch.ones(2)}
    assert torch.equal(blend({"t": LOCAL}, {"t": GLOBAL}, w)["t"], torch.tensor([3.0, 0.0]))
    w, top = ala_step({"t": torch.tensor([0.2, 0.4])}, {"t": LOCAL}, {"t": GLOBAL}, w, 1.0)
    assert torch.allclose(w["t"], torch.tensor([0.6, 1.0])) and torch.allclose(top["t"], torch.tensor([2.2, 0.0]))
    # The same through the weight learning's own gradient: one pass of one batch once started.
    xb = (torch.zeros(1), torch.zeros(1))
    w, top, started = learn_weights(half_square, [xb], {"t": LOCAL}, {"t": GLOBAL}, {"t": torch.ones(2)}, True,
                                    FedALAParams(eta=1.0))
    assert started and torch.allclose(w["t"], torch.tensor([0.6, 1.0]))
    assert torch.allclose(top["t"], torch.tensor([2.2, 0.0]))


def test_fedala_start_phase_runs_passes_until_the_last_k_losses_settle():
    # At eta 0.1 the error of W_0 from its minimiser 0.9 (theta^_0 = 1 + 2 W_0 = 2.8) shrinks by 0.6 a pass, W_1
    # stays clipped at 1: the last-batch losses settle to 1/2 0.4^2 = 0.08, and the phase stops once the last
    # K = 3 have a standard deviation below 1e-4 (with more than K recorded).
    losses = []

    def loss(top, xb, yb):
        losses.append(half_square(top, xb, yb).item())
        return half_square(top, xb, yb)

    params = FedALAParams(eta=0.1, num_pre_loss=3, threshold=1e-4)
    w, top, started = learn_weights(loss, [(None, None)], {"t": LOCAL}, {"t": GLOBAL}, {"t": torch.ones(2)}, False,
                                    params)
    assert started and len(losses) > 3 and abs(losses[0] - 0.1) < 1e-6
    assert torch.std(torch.tensor(losses[-3:]), correction=0) < 1e-4 <= torch.std(torch.tensor(losses[-4:-1]),
                                                                                  correction=0)
    assert abs(w["t"][0] - 0.9) < 0.01 and w["t"][1] == 1.0
    # No slice (a client with too few examples): nothing is learned and the phase is still to come.
    w2, top, started = learn_weights(loss, [], {"t": LOCAL}, {"t": GLOBAL}, {"t": torch.ones(2)}, False, params)
    assert not started and torch.equal(w2["t"], torch.ones(2)) and torch.equal(top["t"], GLOBAL)


def test_fedala_lower_tensors_take_the_global_model_and_the_top_ones_blend():
    # A lower parameter with local value 5 and global 7 becomes 7; the head blends with its W.
    fed = make_federation(*FEDALA, "train.rounds=3", "train.head_params={layer_idx: 1}")
    fed.step(0)
    cid = next(c for c, st in fed.clients.items() if st.rounds_trained)
    state = fed.clients[cid]
    assert set(state.personal) == {WEIGHTS + "generic_head.weight", START} and state.personal[START] == 1.0
    assert torch.equal(state.personal[WEIGHTS + "generic_head.weight"], torch.ones(10, 50))
    host = fed.executor.host
    local = {k: v.clone() for k, v in state.local_model.items()}
    global_ = {k: v.clone() for k, v in local.items()}
    global_["body.7.bias"][0] = 7.0
    local["body.7.bias"][0] = 5.0
    global_["generic_head.weight"] += 0.01
    personal, top = host.method.aggregate_locally(host.model, global_, local, state.personal, host.data(cid),
                                                  host.context_of(cid, 1), 18)
    assert torch.equal(top["generic_head.weight"], host.model.state_dict()["generic_head.weight"])
    got = host.model.state_dict()
    assert got["body.7.bias"][0] == 7.0 and torch.equal(got["body.0.weight"], global_["body.0.weight"])
    w = personal[WEIGHTS + "generic_head.weight"]
    assert personal[START] == 0.0 and not torch.equal(w, torch.ones_like(w)) and bool(((w >= 0) & (w <= 1)).all())
    assert torch.allclose(got["generic_head.weight"], local["generic_head.weight"] + 0.01 * w)


def test_fedala_layer_idx_beyond_the_model_names_the_field():
    with pytest.raises(ConfigError, match="train.head_params.layer_idx"):
        make_federation(*FEDALA, "train.head_params={layer_idx: 99}")
    with pytest.raises(ConfigError, match="rand_percent"):
        config_from_dict({}, [*FEDALA, "train.head_params={rand_percent: 0}"])


# --- FedDBE ----------------------------------------------------------------------------------------------------

FEDDBE = ("train.head=feddbe", "train.balanced_loss=ce", "train.head_params={kl_weight: 1}")  # kappa 50 diverges here


def test_feddbe_server_consensus_is_the_sample_weighted_mean_of_the_running_means():
    # n = (100, 300), r = (1, 0), (0, 1): zbar^g = (100 (1, 0) + 300 (0, 1)) / 400 = (0.25, 0.75).
    answers = {0: {RUNNING: torch.tensor([1.0, 0.0]), SAMPLES: torch.tensor(100.0)},
               1: {RUNNING: torch.tensor([0.0, 1.0]), SAMPLES: torch.tensor(300.0)}}
    assert torch.allclose(consensus_mean(answers), torch.tensor([0.25, 0.75]))
    with pytest.raises(RuntimeError, match="initial period"):
        consensus_mean({})


def test_feddbe_client_running_mean_and_mean_regularizer_by_hand():
    # m = 0.1, r = 0, batch z = [(1, 3), (3, 1)]: mean (2, 2), r = (0.2, 0.2); with zbar^g = (0.2, 0.6):
    # mean_k (r_k - zbar^g_k)^2 / 2 = (0 + 0.16) / 2 / 2 = 0.04, x kappa 50 = 2.0.
    r = running_mean(torch.zeros(2), torch.tensor([[1.0, 3.0], [3.0, 1.0]]), 0.1)
    assert torch.allclose(r, torch.tensor([0.2, 0.2]))
    mr = mean_regularizer(r, torch.tensor([0.2, 0.6]))
    assert torch.allclose(mr, torch.tensor(0.04)) and torch.allclose(50 * mr, torch.tensor(2.0))


class Features(torch.nn.Module):
    """A model whose features are its input: z = x, head W (2 x 2), and z^p; for the client's loss by hand."""

    def __init__(self):
        super().__init__()
        self.generic_head = torch.nn.Linear(2, 2, bias=False)
        torch.nn.init.zeros_(self.generic_head.weight)
        self.readout = DBEReadout(2, 2)

    def features(self, x):
        return x


def test_feddbe_client_loss_adds_the_prbm_before_the_head_and_kappa_times_mr():
    # Head W = 0: CE = ln 2 whatever z + z^p; r after the batch = (0.2, 0.2) (m = 0.1), zbar^g = (0.2, 0.6):
    # loss = ln 2 + 50 * 0.04. The gradient of z^p is W^T (p - e_y) = 0; r carries to the next batch, detached.
    model = Features()
    loss_fn = DBELoss(2, torch.tensor([0.2, 0.6]), FedDBEParams(momentum=0.1, kl_weight=50.0))
    x = torch.tensor([[1.0, 3.0], [3.0, 1.0]])
    loss = loss_fn(model, x, torch.tensor([0, 1]))
    assert torch.allclose(loss, torch.tensor(math.log(2) + 2.0))
    assert torch.allclose(loss_fn.r, torch.tensor([0.2, 0.2])) and not loss_fn.r.requires_grad
    # With a head, the PM's logits are h(z + z^p): W (z + z^p).
    with torch.no_grad():
        model.generic_head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
        model.readout.shift.copy_(torch.tensor([0.5, -1.0]))
    logits = model.readout.personal_logits(model, torch.tensor([[1.0, 1.0]]))
    assert torch.equal(logits, torch.tensor([[1.5, 0.0]]))
    # Without a consensus (the initial period): plain cross-entropy of h(z), no PRBM.
    plain = DBELoss(2, None, FedDBEParams(momentum=0.1))
    ce = plain(model, x, torch.tensor([0, 1]))
    assert torch.allclose(ce, torch.nn.functional.cross_entropy(x @ model.generic_head.weight.T, torch.tensor([0, 1])))


def test_feddbe_initial_period_sets_the_consensus_once_from_every_client_before_round_one():
    fed = make_federation(*FEDDBE, "train.rounds=3")
    assert fed.method_state[READY] == 0.0
    fed.step(0)
    assert fed.method_state[READY] == 1.0
    consensus = fed.method_state[CONSENSUS].clone()
    # It is every training client's answer to the initial period, weighted by its examples.
    host = fed.executor.host
    answers = {cid: host.answer(cid, INITIAL, {}, {}, 0) for cid in range(fed.setup.num_clients)}
    assert torch.equal(consensus, consensus_mean(answers))
    assert abs(float(consensus.sum())) > 0
    # Round 1 started from the initial GM: the trained clients' z^p moved, the server never changes zbar^g.
    trained = [st for st in fed.clients.values() if st.rounds_trained]
    assert trained and all(set(st.personal) == {SHIFT, CONSENSUS} for st in trained)
    assert any(st.personal[SHIFT].abs().sum() > 0 for st in trained)
    fed.step(1)
    assert torch.equal(fed.method_state[CONSENSUS], consensus)


def test_feddbe_cannot_run_with_client_level_dp():
    with pytest.raises(ConfigError, match="train.head: feddbe cannot be used with privacy.enabled: its initial"):
        config_from_dict({}, [*FEDDBE, "privacy.enabled=true", "privacy.noise_multiplier=1.0"])


# --- the sweeps and the tables' rows ---------------------------------------------------------------------------


@pytest.mark.parametrize("sweep, head, grid", [
    ("pfl_fedala", "fedala", {(eta, s) for eta in (0.1, 1.0) for s in (40.0, 80.0)}),
    ("pfl_feddbe", "feddbe", {(m, k) for m in (0.1, 1.0) for k in (10.0, 50.0)}),
])
def test_the_selection_sweeps_search_around_the_official_values_on_another_seed(sweep, head, grid):
    """tune/pfl_fedala.yaml, tune/pfl_feddbe.yaml: every grid point a valid trial of the method on FMNIST
    Dir(0.3) at a seed that is not the tables' (0), the main table's values among them; 4 trials each."""
    spec = load_sweep(Path(__file__).resolve().parents[1] / "tune" / f"{sweep}.yaml")
    grids = {k: v["grid"] for k, v in spec.search.items()}
    keys = [k.rsplit(".", 1)[1] for k in grids]
    seen = set()
    for values in itertools.product(*grids.values()):
        cfg = spec.trial_config(dict(zip(grids, values)))
        assert cfg.seed != 0 and cfg.data.alpha == 0.3 and cfg.data.dataset == "fmnist"
        assert cfg.train.head == head and cfg.train.balanced_loss == "ce"
        seen.add(tuple(cfg.train.head_params[k] for k in keys))
    assert seen == grid and len(seen) == 4
    row = MAIN[{"fedala": "FedALA", "feddbe": "FedDBE"}[head]]["train.head_params"]
    assert tuple(row[k] for k in keys) in grid


# --- the server steps, by hand ---------------------------------------------------------------------------------


def test_fedala_server_step_is_fedavg_with_no_message_and_no_state():
    method = build_method("fedala")
    ctx = ServerContext(2, {"w": torch.zeros(2)}, 0, (1, 28, 28), 10)
    assert method.init_server_state(ctx) == {}
    assert method.messages({}, [0, 1], {0: None, 1: None}, 0, 0, None) == {}
    averaged = {"w": torch.tensor([0.25, 0.75])}  # (100 (1, 0) + 300 (0, 1)) / 400, the rule's average
    new, state = method.server_update(averaged, {}, {}, {}, {}, 2, None)
    assert new is averaged and state == {}


def test_feddbe_server_asks_every_client_once_then_keeps_the_consensus_and_averages():
    method = build_method("feddbe")
    state = method.init_server_state(ServerContext(2, {SHIFT: torch.zeros(2)}, 0, (1, 28, 28), 10))
    assert state[READY] == 0.0 and torch.equal(state[CONSENSUS], torch.zeros(2))
    asked = []

    def ask(phase, common, questions):
        asked.append((phase, sorted(questions)))
        return {0: {RUNNING: torch.tensor([1.0, 0.0]), SAMPLES: torch.tensor(100.0)},
                1: {RUNNING: torch.tensor([0.0, 1.0]), SAMPLES: torch.tensor(300.0)}}

    # Round 1: every training client is asked (not only the sampled one), and the sampled one is sent zbar^g.
    sent = method.messages(state, [1], {0: None, 1: None}, 0, 0, ask)
    assert asked == [(INITIAL, [0, 1])] and list(sent) == [1]
    assert torch.allclose(sent[1][CONSENSUS], torch.tensor([0.25, 0.75]))
    averaged = {"w": torch.tensor([2.0])}
    new, state = method.server_update(averaged, {}, {}, state, {}, 2, ask)
    assert new is averaged and state[READY] == 1.0
    assert torch.allclose(state[CONSENSUS], torch.tensor([0.25, 0.75]))
    # Later rounds ask nothing and send the same zbar^g; a new client receives it too.
    sent = method.messages(state, [0, 1], {0: None, 1: None}, 1, 0, ask)
    assert len(asked) == 1 and all(torch.equal(m[CONSENSUS], state[CONSENSUS]) for m in sent.values())
    assert torch.equal(method.new_client_message(state, averaged)[CONSENSUS], state[CONSENSUS])
