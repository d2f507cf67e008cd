"""GPFL and FedCP (docs/method.md): each client step and server step checked by hand on tiny tensors (the spec's
"Check" examples, the MMD^2 kernel, the CoV), the seeded Gumbel noise, the model's readout (kept and shared
entries, the GM and PM it reads), and the served final/. Their runs resume bitwise in
tests/test_personalization.py and match on Ray in tests/test_ray_runtime.py."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from fedrod_ray_tune.space import load_sweep
from fedrod_ray_tune.tables import MAIN
from test_federation import make_federation
from torch import nn

from fedrod_ray.client_update.local import RoundInput
from fedrod_ray.clients.client import ClientState
from fedrod_ray.config import ConfigError, config_from_dict
from fedrod_ray.federation_state.final import write_final
from fedrod_ray.models import build_model
from fedrod_ray.models.export import load_final
from fedrod_ray.models.readouts import (
    CoV,
    FedCPReadout,
    GPFLReadout,
    cosine_logits,
    gumbel_softmax,
    masked_logits,
)
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.personalization.fedcp import context_of, mmd2, upload_head
from fedrod_ray.personalization.gpfl import conditions, gpfl_loss
from fedrod_ray.server_math.aggregate import weighted_average
from fedrod_ray.server_math.server import sample_clients

pytestmark = pytest.mark.usefixtures("one_torch_thread")

E = torch.tensor([[1.0, 0.0], [0.0, 2.0]])


def ce(name: str, *extra: str) -> tuple[str, ...]:
    return (f"train.head={name}", "train.balanced_loss=ce", *extra)


# --- GPFL, by hand ---------------------------------------------------------------------------------------------


def test_gpfl_conditions_are_the_mean_and_the_label_weighted_sum_of_the_embeddings():
    g, p = conditions(E, torch.tensor([0.25, 0.75]))
    assert torch.allclose(g, torch.tensor([0.5, 1.0])) and torch.allclose(p, torch.tensor([0.25, 1.5]))


def test_gpfl_cosine_logits_are_unscaled_cosines():
    assert torch.allclose(cosine_logits(torch.tensor([[3.0, 4.0]]), E), torch.tensor([[0.6, 0.8]]))


def test_the_cov_scales_and_shifts_by_its_layer_normed_conditions():
    """gamma = LN(ReLU(I c)) with c = (1, -1): LN((1, 0)) = (1, -1) (to 1e-5), so z * (gamma + 1) = (3, 4) * (2, 0);
    beta's linear layer is zero: beta = LN(0) = 0. CoV = ReLU((6, 0))."""
    cov = CoV(2)
    with torch.no_grad():
        cov.gamma[0].weight.copy_(torch.eye(2))
        cov.gamma[0].bias.zero_()
        cov.beta[0].weight.zero_()
        cov.beta[0].bias.zero_()
    out = cov(torch.tensor([[3.0, 4.0]]), torch.tensor([1.0, -1.0]))
    assert torch.allclose(out, torch.tensor([[6.0, 0.0]]), atol=1e-4)


class Identity(nn.Module):
    """The extractor z = x, so that the loss below is a function of hand-picked features."""

    def forward(self, x):
        return x


def test_gpfl_client_loss_is_ce_plus_the_cosine_loss_plus_lambda_times_the_frobenius_distance():
    """f_P = f_G = z = (3, 4) (the CoV at zero weights is ReLU), y = 1, h = 0: CE = ln 2; cosine loss
    ln(1 + e^-0.2) = 0.5981; lambda ||(3, 4) - (0, 2)|| = 0.01 sqrt(13) = 0.0361: 1.3273 in all."""
    r = GPFLReadout(2, 2)
    with torch.no_grad():
        for p in [*r.cov.parameters(), *r.head.parameters()]:
            if p.dim() == 2 or p is r.cov.gamma[0].bias or p is r.cov.beta[0].bias:
                p.zero_()
        r.embedding.weight.copy_(E)
    model = nn.Module()
    model.readout, model.body = r, Identity()
    model.features = model.body
    loss = gpfl_loss(model, torch.tensor([[3.0, 4.0]]), torch.tensor([1]), E, lam=0.01)
    assert math.isclose(loss.item(), math.log(2) + 0.5981389 + 0.0360555, abs_tol=1e-5)


def test_gpfl_gm_and_pm_read_the_global_and_the_personal_route():
    r = GPFLReadout(2, 2)
    with torch.no_grad():
        r.embedding.weight.copy_(E)
        r.p.copy_(torch.tensor([0.25, 1.5]))
    z = torch.tensor([[3.0, 4.0], [1.0, 0.0]])
    g_bar = E.mean(0)
    assert torch.equal(r.generic_logits(None, z), cosine_logits(r.cov(z, g_bar), E))
    assert torch.equal(r.personal_logits(None, z), r.head(r.cov(z, r.p)))


def test_gpfl_uploads_theta_e_and_the_cov_keeps_h_g_p_and_the_server_averages_them():
    """A client step from g = p = 0: its g and p are then those of its trained E and its label frequencies;
    the server's E, CoV and theta are the sample-weighted mean of the uploads, bitwise."""
    fed = make_federation(*ce("gpfl"))
    start = {k: v.clone() for k, v in fed.global_shared.items()}
    assert {"readout.head.weight", "readout.g", "readout.p"}.isdisjoint(start)
    assert {"readout.embedding.weight", "readout.cov.gamma.0.weight", "readout.cov.beta.2.bias"} <= set(start)
    ids = sample_clients(fed.cfg.seed, 0, fed.setup.num_clients, fed.cfg.train.client_fraction)
    ref = make_federation(*ce("gpfl"))
    outs = [ref.executor.host.train(cid, ClientState(), RoundInput(start), 0) for cid in ids]
    results = [o[0] for o in outs]
    for cid, (res, state) in zip(ids, outs):
        personal = state.personal
        g, p = conditions(res.shared["readout.embedding.weight"], ref.executor.host.data(cid).class_dist)
        assert torch.equal(personal["readout.g"], g) and torch.equal(personal["readout.p"], p)
        assert not torch.equal(personal["readout.head.weight"], fed.initial["readout.head.weight"])
    expected = weighted_average([r.shared for r in results], [r.num_samples for r in results])
    fed.step(0)
    for k, v in expected.items():
        assert torch.equal(fed.global_shared[k], v), k


def test_gpfl_params_are_checked_by_name():
    cfg = config_from_dict({}, list(ce("gpfl")))
    assert cfg.train.head_params == {"lam": 0.01, "mu": 0.1}
    for bad, field in (("{lam: -1}", "lam"), ("{mu: -0.1}", "mu"), ("{tau: 1}", "tau")):
        with pytest.raises(ConfigError, match=f"train.head_params.{field}"):
            config_from_dict({}, list(ce("gpfl", f"train.head_params={bad}")))


# --- FedCP, by hand --------------------------------------------------------------------------------------------

WP = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
WG = torch.tensor([[0.0, 1.0], [1.0, 0.0]])


def linear(w: torch.Tensor) -> nn.Linear:
    layer = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    return layer


def test_fedcp_context_is_the_personal_heads_weight_summed_over_classes():
    assert torch.equal(context_of(WP), torch.tensor([4.0, 1.0]))


def test_fedcp_output_adds_the_personal_head_on_the_masked_and_the_global_head_on_the_rest():
    z, s = torch.tensor([[1.0, 2.0]]), torch.tensor([[0.8, 0.3]])
    out = masked_logits(z, s, 1 - s, linear(WP), linear(WG))
    assert torch.allclose(out, torch.tensor([[3.4, 2.0]]))


def test_fedcp_uploads_the_mean_of_its_personal_and_the_global_head():
    assert torch.equal(upload_head(WP, WG), torch.tensor([[0.5, 1.5], [2.0, -0.5]]))


def test_mmd2_of_two_samples_by_hand():
    """x = (0, 2), y = (0, 0) (d = 1): with k = sum_a exp(-4 / 2a) = 3.5595, the means of K_xx, K_yy and K_xy
    are (8 + 2k) / 4, 4 and (8 + 2k) / 4: MMD^2 = 2 - k / 2 = 0.22023."""
    x, y = torch.tensor([[0.0], [2.0]]), torch.zeros(2, 1)
    assert math.isclose(mmd2(x, y).item(), 0.2202345, abs_tol=1e-6)
    assert mmd2(x, x).item() == 0.0


def test_fedcp_gumbel_masks_sum_to_one_and_are_seeded():
    a = torch.randn(3, 2, 4)
    s1 = gumbel_softmax(a, torch.Generator().manual_seed(5), dim=1)
    s2 = gumbel_softmax(a, torch.Generator().manual_seed(5), dim=1)
    s3 = gumbel_softmax(a, torch.Generator().manual_seed(6), dim=1)
    assert torch.equal(s1, s2) and not torch.equal(s1, s3)
    assert torch.allclose(s1.sum(1), torch.ones(3, 4))
    r = FedCPReadout(4, 3)
    with pytest.raises(RuntimeError, match="noise"):
        r.masks(torch.ones(2, 4))


def test_fedcp_server_averages_theta_the_cpn_and_the_uploaded_half_mixed_heads():
    """Each upload's generic head is (h^p + h^g) / 2 of the client's trained h^p and the h^g it received
    (frozen); its c is 1^T W^p; the server's generic head, CPN and theta are the weighted mean, bitwise."""
    fed = make_federation(*ce("fedcp"))
    start = {k: v.clone() for k, v in fed.global_shared.items()}
    assert {"readout.head.weight", "readout.context"}.isdisjoint(start) and "readout.cpn.0.weight" in start
    ids = sample_clients(fed.cfg.seed, 0, fed.setup.num_clients, fed.cfg.train.client_fraction)
    ref = make_federation(*ce("fedcp"))
    outs = [ref.executor.host.train(cid, ClientState(), RoundInput(start), 0) for cid in ids]
    for res, state in outs:
        head = state.personal["readout.head.weight"]
        assert torch.equal(res.shared["generic_head.weight"], upload_head(head, start["generic_head.weight"]))
        assert torch.equal(state.personal["readout.context"], context_of(head))
    results = [o[0] for o in outs]
    expected = weighted_average([r.shared for r in results], [r.num_samples for r in results])
    fed.step(0)
    for k, v in expected.items():
        assert torch.equal(fed.global_shared[k], v), k


def test_fedcp_pm_is_seeded_at_evaluation_and_its_gm_is_the_global_head():
    """Two evaluations of one client's PM draw the same noise (so the same counts); the GM reads h^g(theta(x))."""
    fed = make_federation(*ce("fedcp"))
    fed.step(0)
    host = fed.executor.host
    cid = next(c for c, st in fed.clients.items() if st.rounds_trained)
    job = fed.evaluation._pm_state(fed.clients, cid, fed.global_shared, 1, fed.method_state)
    assert job.local_model is fed.global_shared
    first, second = host.evaluate([(cid, job)]), host.evaluate([(cid, job)])
    assert torch.equal(first.correct[cid], second.correct[cid])
    x = torch.randn(2, 1, 28, 28)
    host.model.load_partial(fed.global_shared)
    assert torch.equal(host.model(x), host.model.generic_head(host.model.features(x)))


def test_fedcp_params_are_checked_by_name():
    assert config_from_dict({}, list(ce("fedcp"))).train.head_params == {"lam": 5.0}
    with pytest.raises(ConfigError, match="train.head_params.lam"):
        config_from_dict({}, list(ce("fedcp", "train.head_params={lam: -1}")))


# --- the model and final/ ------------------------------------------------------------------------------------


def test_a_readout_is_built_from_the_seed_after_every_other_weight():
    plain = build_model("auto", 10, (1, 28, 28), None, seed=3).state_dict()
    for readout in ("gpfl", "fedcp"):
        a = build_model("auto", 10, (1, 28, 28), None, seed=3, readout=readout).state_dict()
        b = build_model("auto", 10, (1, 28, 28), None, seed=3, readout=readout).state_dict()
        assert all(torch.equal(a[k], plain[k]) for k in plain) and all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="unknown readout"):
        build_model("auto", 10, (1, 28, 28), None, readout="nope")


@pytest.mark.parametrize("name", ["gpfl", "fedcp"])
def test_final_serves_the_methods_gm_with_its_readout(name, tmp_path):
    """final/ holds theta, the generic head and the readout's shared part (no client's entries), and the served
    model's logits are the GM's: GPFL's cosine classifier, FedCP's global head."""
    fed = make_federation(*ce(name))
    fed.step(0)
    write_final(RunStorage(str(tmp_path)), fed.setup, fed.snapshot(), {"gfl_gm": 0.5})
    served = load_final(str(tmp_path))
    model = fed.executor.host.model
    model.load_partial(fed.global_shared)
    state = served.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in fed.global_shared.items())
    x = torch.randn(3, 1, 28, 28)
    model.eval()
    with torch.no_grad():
        assert torch.equal(served.model(x), model(x))


# --- the sweeps and the tables' rows ---------------------------------------------------------------------------


@pytest.mark.parametrize("sweep, head, grid", [
    ("pfl_gpfl", "gpfl", {(lam, mu) for lam in (0.01, 0.1) for mu in (0.01, 0.1)}),
    ("pfl_fedcp", "fedcp", {(lam,) for lam in (1.0, 2.0, 5.0, 10.0)}),
])
def test_the_selection_sweeps_search_around_the_official_values_on_another_seed(sweep, head, grid):
    """tune/pfl_gpfl.yaml, tune/pfl_fedcp.yaml: every grid point a valid trial of the method on FMNIST Dir(0.3)
    at a seed that is not the tables' (0), the official values among them; 4 trials each."""
    spec = load_sweep(Path(__file__).resolve().parents[1] / "tune" / f"{sweep}.yaml")
    grids = {k: v["grid"] for k, v in spec.search.items()}
    seen = set()
    for values in itertools.product(*grids.values()):
        cfg = spec.trial_config(dict(zip(grids, values)))
        assert cfg.seed != 0 and cfg.data.alpha == 0.3 and cfg.data.dataset == "fmnist"
        assert cfg.train.head == head and cfg.train.balanced_loss == "ce"
        seen.add(tuple(cfg.train.head_params.values()))
    assert seen == grid and len(seen) == 4
    assert tuple(MAIN[{"gpfl": "GPFL", "fedcp": "FedCP"}[head]]["train.head_params"].values()) in grid
