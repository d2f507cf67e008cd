"""Model shapes and parameter counts (docs/method.md, "Model")."""

from __future__ import annotations

import pytest
import torch

from fedrod_ray.config import ConfigError
from fedrod_ray.models import FedModel, HyperNetwork, build_model, count_parameters, resolve_arch

MNIST = (1, 28, 28)
CIFAR = (3, 32, 32)

# conv1 1*32*25+32, conv2 32*64*25+64, fc 1024*50+50
MNIST_BODY = 832 + 51_264 + 51_250
# conv1 3*32*9+32, conv2 32*64*9+64, conv3 64*64*9+64, fc 1024*64+64
CIFAR_BODY = 896 + 18_496 + 36_928 + 65_600


@pytest.mark.parametrize(("classes", "feature_dim", "hidden", "expected"), [
    (10, 50, 16, 8_160),
    (10, 64, 32, 20_800),
    (100, 64, 16, 104_000),
])
def test_hypernetwork_parameter_counts(classes, feature_dim, hidden, expected):
    assert count_parameters(HyperNetwork(classes, hidden, feature_dim)) == expected


@pytest.mark.parametrize(("arch", "shape", "classes", "hidden", "expected"), [
    ("mnist_cnn", MNIST, 10, 16, 8_160),
    ("cifar_cnn", CIFAR, 10, 32, 20_800),
    ("cifar_cnn", CIFAR, 100, 16, 104_000),
])
def test_hypernetwork_inside_fedmodel(arch, shape, classes, hidden, expected):
    model = build_model(arch, classes, shape, "hyper", hidden)
    assert count_parameters(model.hypernet) == expected


def test_feature_extractor_counts():
    assert MNIST_BODY == 103_346
    assert CIFAR_BODY == 121_920
    assert count_parameters(build_model("mnist_cnn", 10, MNIST, None).body) == MNIST_BODY
    assert count_parameters(build_model("cifar_cnn", 10, CIFAR, None).body) == CIFAR_BODY


@pytest.mark.parametrize(("arch", "shape", "head"), [("mnist_cnn", MNIST, 500), ("cifar_cnn", CIFAR, 640)])
def test_heads_are_bias_free_and_sized(arch, shape, head):
    model = build_model(arch, 10, shape, "linear")
    assert model.generic_head.bias is None
    assert model.personal_head.bias is None
    assert count_parameters(model.generic_head) == head
    assert count_parameters(model.personal_head) == head
    assert model.personal_head.weight.shape == (10, head // 10)
    body = MNIST_BODY if arch == "mnist_cnn" else CIFAR_BODY
    assert count_parameters(model) == body + 2 * head
    assert count_parameters(build_model(arch, 10, shape, None)) == body + head


def test_hypernet_output_shape_and_dependence_on_distribution():
    hyper = HyperNetwork(10, 16, 50)
    a = torch.full((10,), 0.1)
    b = torch.zeros(10)
    b[3] = 1.0
    out = hyper(a)
    assert out.shape == (10, 50)
    # zero output layer at initialisation: every client starts from a zero P-head
    assert torch.equal(out, torch.zeros(10, 50))
    with torch.no_grad():
        hyper.net[2].weight.normal_(generator=torch.Generator().manual_seed(1))
    out_a, out_b = hyper(a), hyper(b)
    assert out_a.shape == (10, 50)
    assert out_a.abs().sum() > 0
    assert not torch.allclose(out_a, out_b)


def test_hyper_personal_weight_needs_distribution():
    model = build_model("mnist_cnn", 10, MNIST, "hyper")
    with pytest.raises(ValueError):
        model.personal_weight(None)
    assert model.personal_weight(torch.full((10,), 0.1)).shape == (10, 50)
    with pytest.raises(ValueError):
        build_model("mnist_cnn", 10, MNIST, None).personal_weight()


@pytest.mark.parametrize(("arch", "shape", "feature_dim"), [("mnist_cnn", MNIST, 50), ("cifar_cnn", CIFAR, 64)])
@pytest.mark.parametrize("classes", [10, 100])
def test_forward_shapes(arch, shape, feature_dim, classes):
    model = build_model("auto", classes, shape, "linear")
    assert model.arch == arch
    x = torch.randn(3, *shape)
    z = model.features(x)
    assert z.shape == (3, feature_dim)
    g = model(x)
    assert g.shape == (3, classes)
    assert model.personal_logits(z, g).shape == (3, classes)


def test_resolve_arch():
    assert resolve_arch("auto", MNIST) == "mnist_cnn"
    assert resolve_arch("auto", CIFAR) == "cifar_cnn"
    assert resolve_arch("cifar_cnn", MNIST) == "cifar_cnn"
    # Other sizes: mnist_cnn where it fits, cifar_cnn below 16 x 16, an error naming model.arch below 8 x 8.
    assert resolve_arch("auto", (3, 16, 16)) == resolve_arch("auto", (1, 64, 40)) == "mnist_cnn"
    assert resolve_arch("auto", (1, 15, 30)) == resolve_arch("auto", (3, 8, 8)) == "cifar_cnn"
    with pytest.raises(ConfigError, match=r"^model\.arch: auto has no built-in ConvNet for 7 x 9 images"):
        resolve_arch("auto", (1, 7, 9))


@pytest.mark.parametrize(("arch", "shape", "fc_in"), [
    ("mnist_cnn", (3, 16, 16), 64), ("mnist_cnn", (1, 40, 28), 64 * 7 * 4), ("mnist_cnn", (1, 31, 29), 64 * 4 * 4),
    ("cifar_cnn", (1, 8, 8), 64), ("cifar_cnn", (3, 28, 64), 64 * 3 * 8),
])
def test_the_convnets_size_their_first_fc_layer_from_the_image(arch, shape, fc_in):
    model = build_model(arch, 10, shape, "linear")
    assert model.body[-2].in_features == fc_in
    assert model(torch.zeros(2, *shape)).shape == (2, 10)


def test_the_paper_sizes_keep_the_paper_models_exactly():
    """28 x 28 and 32 x 32 give the networks the paper's sizes always gave: the same parameters and, seeded,
    the same initial weights as a model built without an image size (the paper's by default)."""
    for arch, shape, body in (("mnist_cnn", MNIST, MNIST_BODY), ("cifar_cnn", CIFAR, CIFAR_BODY)):
        sized = build_model(arch, 10, shape, "hyper", seed=3).state_dict()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            plain = FedModel(arch, 10, shape[0], "hyper").state_dict()
        assert count_parameters(build_model(arch, 10, shape, None).body) == body
        assert sized.keys() == plain.keys() and all(torch.equal(sized[k], plain[k]) for k in sized)


@pytest.mark.parametrize(("arch", "shape"), [("mnist_cnn", (1, 15, 28)), ("cifar_cnn", (3, 32, 7))])
def test_a_convnet_refuses_an_image_too_small_naming_model_arch(arch, shape):
    with pytest.raises(ConfigError, match=rf"^model\.arch: {arch} takes images of at least"):
        build_model(arch, 10, shape, None)


def test_build_model_seeding_and_global_rng():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = build_model("mnist_cnn", 10, MNIST, "hyper", seed=7)
    after = torch.get_rng_state()
    assert torch.equal(before, after)
    b = build_model("mnist_cnn", 10, MNIST, "hyper", seed=7)
    c = build_model("mnist_cnn", 10, MNIST, "hyper", seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["body.0.weight"], sc["body.0.weight"])
    assert not torch.equal(sa["generic_head.weight"], sc["generic_head.weight"])
    # initial weights do not depend on the global RNG's state either
    torch.manual_seed(999)
    d = build_model("mnist_cnn", 10, MNIST, "hyper", seed=7)
    assert all(torch.equal(sa[k], v) for k, v in d.state_dict().items())


def test_linear_personal_head_starts_at_zero():
    model = build_model("mnist_cnn", 10, MNIST, "linear")
    assert torch.equal(model.personal_head.weight, torch.zeros(10, 50))


def test_key_sets():
    lin = build_model("mnist_cnn", 10, MNIST, "linear")
    hyp = build_model("mnist_cnn", 10, MNIST, "hyper")
    plain = build_model("mnist_cnn", 10, MNIST, None)

    assert "personal_head.weight" not in lin.shared_keys()
    assert lin.personal_keys() == ["personal_head.weight"]
    assert set(lin.shared_keys()) == set(lin.state_dict()) - {"personal_head.weight"}

    assert {"hypernet.net.0.weight", "hypernet.net.2.weight"} <= set(hyp.shared_keys())
    assert set(hyp.shared_keys()) == set(hyp.state_dict())
    assert hyp.personal_keys() == []

    for model in (lin, hyp, plain):
        gk = model.generic_keys()
        assert gk, model.variant
        assert all(k.startswith(("body.", "generic_head.")) for k in gk)
        assert set(gk) == {k for k in model.state_dict() if k.startswith(("body.", "generic_head."))}
        assert "generic_head.weight" in gk
    assert set(plain.shared_keys()) == set(plain.generic_keys())


def test_bad_arch_and_variant():
    with pytest.raises(ValueError):
        FedModel("resnet", 10, 1)
    with pytest.raises(ValueError):
        FedModel("mnist_cnn", 10, 1, variant="mixture")


@pytest.mark.parametrize("arch, shape", [("mnist_cnn", MNIST), ("cifar_cnn", (3, 32, 32))])
def test_normal_init_is_he_normal_and_pytorch_init_is_uniform(arch, shape):
    """model.init: normal draws every weight of theta, psi and nu's first layer from N(0, 2 / fan_in) (the
    sample std within 4 of its standard errors, 1 / sqrt(2n)), biases 0; pytorch keeps PyTorch's uniform
    U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    normal = build_model(arch, 10, shape, "hyper", init="normal").state_dict()
    uniform = build_model(arch, 10, shape, "hyper", init="pytorch").state_dict()
    for k, w in normal.items():
        if k == "hypernet.net.2.weight":  # zero under both: a fresh PM is the GM
            assert not w.any() and not uniform[k].any()
        elif k.endswith("bias"):
            assert not w.any() and uniform[k].any(), k
        else:
            fan_in = w[0].numel()
            assert w.std().item() == pytest.approx((2 / fan_in) ** 0.5, rel=4 / (2 * w.numel()) ** 0.5), k
            assert w.abs().max() > fan_in ** -0.5 >= uniform[k].abs().max(), k


def test_normal_init_gives_every_variant_the_same_theta_and_psi():
    models = [build_model("mnist_cnn", 10, MNIST, v, seed=3) for v in (None, "linear", "hyper")]
    states = [m.state_dict() for m in models]
    for k in models[0].generic_keys():
        assert torch.equal(states[0][k], states[1][k]) and torch.equal(states[0][k], states[2][k]), k
    with pytest.raises(ValueError, match="unknown init 'xavier'"):
        build_model("mnist_cnn", 10, MNIST, None, init="xavier")
