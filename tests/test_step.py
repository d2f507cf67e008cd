"""fedrod_ray.client_update.step: the eager step is the local update's step, the compiled one equals it up to
rounding, and train.step's config checks. One test compiles (tens of seconds); the others are instant."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny import MEAN, STD, make_data, model_and_global

from fedrod_ray.algorithms import build_rule
from fedrod_ray.client_update.local import RoundInput, UpdateContext, local_update
from fedrod_ray.client_update.losses import balanced_softmax
from fedrod_ray.client_update.step import make_losses, make_train_step
from fedrod_ray.config import ConfigError, TrainConfig, config_from_dict
from fedrod_ray.data.transforms import normalize

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# The compiled step against the eager one after 6 SGD steps of the tiny model: fused kernels sum in another
# order, so the weights differ by float32 rounding (measured: at most 1.5e-8 here), never by more than this.
RTOL, ATOL = 1e-4, 1e-6


def test_eager_step_is_forward_losses_backward_rule_term_and_sgd():
    data = make_data()
    x = normalize(data.x, MEAN, STD).contiguous(memory_format=torch.channels_last)
    dist = data.class_dist
    rule = build_rule("fedprox", {"mu": 0.5})
    models, opts, corrections = [], [], []
    for _ in range(2):
        model, shared = model_and_global("linear")
        with torch.no_grad():
            model.personal_head.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
            for p in model.parameters():  # away from the anchor, so that FedProx's term is not zero
                p.add_(0.01)
        models.append(model)
        opts.append(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3))
        corrections.append(rule.start_local({k: shared[k] for k in model.generic_keys()}, {}, {}))

    step = make_train_step(models[0], opts[0], make_losses(models[0], balanced_softmax, 0.5, data.counts, dist,
                                                           batch_size=len(data)), corrections[0])
    loss_g, loss_p = step(x, data.y)

    ref = models[1]
    z = ref.features(x)
    g = ref.generic_head(z)
    ref_g = balanced_softmax(g, data.y, data.counts, 0.5)
    ref_p = F.cross_entropy(ref.personal_logits(z.detach(), g.detach(), dist), data.y)
    (ref_g + ref_p).backward()
    with torch.no_grad():
        corrections[1].apply(dict(ref.named_parameters()))
    opts[1].step()

    assert torch.equal(loss_g, ref_g.detach()) and torch.equal(loss_p, ref_p.detach())
    assert not loss_g.requires_grad and not loss_p.requires_grad
    for (k, a), b in zip(models[0].state_dict().items(), ref.state_dict().values()):
        assert torch.equal(a, b), k


def test_one_head_model_has_no_personal_loss():
    data = make_data()
    model, _ = model_and_global(None)
    step = make_train_step(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           make_losses(model, balanced_softmax, 1.0, data.counts, data.class_dist,
                                       batch_size=len(data)), None)
    loss_g, loss_p = step(normalize(data.x, MEAN, STD), data.y)
    assert loss_p is None and torch.isfinite(loss_g)


def test_unknown_step_is_refused():
    data = make_data()
    model, _ = model_and_global("linear")
    with pytest.raises(ValueError, match="unknown step 'jit'"):
        make_losses(model, balanced_softmax, 1.0, data.counts, data.class_dist, batch_size=8, step="jit")


@pytest.mark.parametrize("overrides, match", [
    (["train.step=jit"], r"train\.step: 'jit' is not one of \['compiled', 'eager'\]"),
    (["train.step=compiled", "train.balanced_loss=meta_bsm"],
     r"train\.step: compiled has no effect with train\.balanced_loss=meta_bsm"),
    (["train.step=compiled", "runtime.mode=local", "runtime.batched_clients=4"],
     r"train\.step: compiled has no effect with runtime\.batched_clients"),
])
def test_config_checks_train_step(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config_from_dict({}, overrides)


def test_config_default_step_is_eager():
    assert config_from_dict({}).train.step == "eager" == TrainConfig().step


def update(step: str, n: int, client_id: int = 2):
    """A linear-head update of n examples, batch 10 (so a last batch of n % 10), 2 epochs, momentum on."""
    cfg = TrainConfig(head="linear", batch_size=10, local_epochs=2, lr=0.05, step=step)
    model, shared = model_and_global("linear")
    result, personal, _ = local_update(model, RoundInput(shared), make_data(client_id, n),
                                       UpdateContext(cfg, build_rule("fedavg"), 1, 3, client_id, MEAN, STD, True))
    return result, personal


@pytest.mark.slow
def test_compiled_step_matches_eager_without_recompiling_for_other_client_sizes():
    import torch._dynamo
    from torch._dynamo.utils import counters

    # Dynamo's caches and counters are process-wide: an earlier test may have compiled already.
    torch._dynamo.reset()
    counters.clear()
    eager, eager_personal = update("eager", 25)
    assert counters["stats"]["unique_graphs"] == 0  # eager compiles nothing
    compiled, compiled_personal = update("compiled", 25)
    # train.step: compiled built a graph, and called it: Dynamo ran the frames it captured.
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1 and counters["frames"]["ok"] >= 1
    for k, v in eager.shared.items():
        torch.testing.assert_close(compiled.shared[k], v, rtol=RTOL, atol=ATOL, msg=k)
    torch.testing.assert_close(compiled_personal["personal_head.weight"], eager_personal["personal_head.weight"],
                               rtol=RTOL, atol=ATOL)
    assert compiled.loss == pytest.approx(eager.loss, rel=RTOL)
    assert compiled.personal_loss == pytest.approx(eager.personal_loss, rel=RTOL)
    assert compiled.steps == eager.steps == 6

    # The same update again gives the same bits (what the Ray and in-process runtimes' equality rests on),
    # and another client, with another last-batch size, reuses the graph: its ragged batch runs eagerly.
    again, again_personal = update("compiled", 25)
    for k, v in compiled.shared.items():
        assert torch.equal(again.shared[k], v), k
    assert torch.equal(again_personal["personal_head.weight"], compiled_personal["personal_head.weight"])
    other, _ = update("compiled", 27, client_id=4)
    assert other.steps == 6 and counters["stats"]["unique_graphs"] == graphs
