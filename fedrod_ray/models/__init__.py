"""Models: a feature extractor with a generic head, plus (Fed-RoD) a personalized head or hypernetwork."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError
from ..specs.models import INITS
from .convnet import MIN_SIDE
from .extractors import BUILDERS, feature_extractor
from .heads import HyperNetwork
from .readouts import READOUTS, Readout

__all__ = ["READOUTS", "FedModel", "HyperNetwork", "Readout", "build_model", "count_parameters", "resolve_arch"]

# Parameter-name prefixes: what the server averages and what a client keeps.
BODY = "body."
GENERIC_HEAD = "generic_head."
PERSONAL_HEAD = "personal_head."
HYPERNET = "hypernet."
READOUT = "readout."


class FedModel(nn.Module):
    """Feature extractor f(x; theta), generic head psi and an optional personalized part.

    ``variant`` is ``None`` for the plain one-head model (FedAvg and other baselines), ``"linear"`` for
    a per-client P-head phi_m, or ``"hyper"`` for phi_m = H(a_m; nu). ``parts`` adds a local objective's
    modules (``fedrod_ray.objectives``, e.g. Meta-BSM's Meta-Weight-Net ``mwn``) by attribute name, which no
    forward pass uses: only the objective's update does. ``readout`` names a method's own readout of the
    features (``models.readouts``: GPFL's, FedCP's), which the GM's and the PM's logits go through.
    """

    # size: nine arguments, each a part of the model or of its initial weights that a caller chooses.
    def __init__(self, arch: str, num_classes: int, in_channels: int, variant: str | None = None,
                 hyper_hidden: int = 16, parts: dict[str, Callable[[], nn.Module]] | None = None,
                 init: str = "normal", image_hw: tuple[int, int] | None = None, readout: str | None = None):
        """``image_hw`` (H, W) is needed by an ``arch`` that is a factory (``models.extractors``); without it a
        built-in is built for the paper's image size."""
        super().__init__()
        if image_hw is None and arch not in BUILDERS:
            raise ValueError(f"arch {arch!r} is not a built-in ({', '.join(BUILDERS)}): it needs image_hw")
        if variant not in (None, "linear", "hyper"):
            raise ValueError(f"unknown variant {variant!r}")
        if init not in INITS:
            raise ValueError(f"unknown init {init!r}; expected one of {list(INITS)}")
        self.arch = arch
        self.variant = variant
        self.num_classes = num_classes
        self.body, self.feature_dim = feature_extractor(arch, (in_channels, *(image_hw or ())))
        self.generic_head = nn.Linear(self.feature_dim, num_classes, bias=False)
        # Each part is re-drawn right after it is built, so that theta and psi start the same whatever
        # personalized part (or none) follows.
        if init == "normal":
            _he_normal(self.body, self.generic_head)
        if variant == "linear":
            self.personal_head = nn.Linear(self.feature_dim, num_classes, bias=False)
            nn.init.zeros_(self.personal_head.weight)
        elif variant == "hyper":
            self.hypernet = HyperNetwork(num_classes, hyper_hidden, self.feature_dim)
            if init == "normal":
                _he_normal(self.hypernet.net[0])  # its output layer stays at zero (HyperNetwork)
        # Built last, so that every other initial weight is the same with and without them.
        self.parts = tuple(parts or {})
        for name, build in (parts or {}).items():
            self.add_module(name, build())
        if readout is not None and readout not in READOUTS:
            raise ValueError(f"unknown readout {readout!r}; expected one of {list(READOUTS)}")
        self.readout: Readout | None = (READOUTS[readout](self.feature_dim, num_classes)
                                        if readout is not None else None)
        # Parameters besides the personalized head that each client keeps and never sends (``keep``).
        self.kept: frozenset[str] = frozenset()

    def keep(self, keys) -> None:
        """Make ``keys`` (parameter names) personal: kept by each client, never averaged (a personalization
        method's split, e.g. FedPer's head)."""
        unknown = sorted(set(keys) - set(self.state_dict()))
        if unknown:
            raise KeyError(f"{unknown} are not parameters of this model")
        self.kept = frozenset(keys)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Generic logits h_G(f(x))."""
        return self.generic_logits(self.body(x))

    def generic_logits(self, z: torch.Tensor) -> torch.Tensor:
        """The GM's logits of features z: h_G(z), or the method's readout's (GPFL: the cosine classifier)."""
        return self.generic_head(z) if self.readout is None else self.readout.generic_logits(self, z)

    @property
    def has_personal(self) -> bool:
        """A personalized model's logits differ from the generic ones: a personalized head or a readout's."""
        return self.variant is not None or self.readout is not None

    def readout_personal_keys(self) -> list[str]:
        """The readout's entries each client keeps (``Readout.personal``)."""
        return [] if self.readout is None else [READOUT + k for k in self.readout.personal]

    def personal_weight(self, class_dist: torch.Tensor | None = None) -> torch.Tensor:
        if self.variant == "linear":
            return self.personal_head.weight
        if self.variant == "hyper":
            if class_dist is None:
                raise ValueError("the hyper variant needs the client's class distribution")
            return self.hypernet(class_dist)
        raise ValueError("this model has no personalized head")

    def personal_logits(self, z: torch.Tensor, generic_logits: torch.Tensor,
                        class_dist: torch.Tensor | None = None) -> torch.Tensor:
        """h_G(z) + h_P(z), the personalized model's logits."""
        return generic_logits + F.linear(z, self.personal_weight(class_dist))

    @torch.no_grad()
    def load_partial(self, state: dict[str, torch.Tensor]) -> None:
        """Copy the given entries (a subset of the state dict) into the model, on its device."""
        params = self.state_dict()
        for k, v in state.items():
            if k not in params:
                raise KeyError(f"{k} is not a parameter of this model")
            # copy_ would broadcast a wrongly shaped tensor without complaint.
            if params[k].shape != v.shape:
                raise ValueError(f"{k}: shape {tuple(v.shape)} does not match the model's {tuple(params[k].shape)}")
            params[k].copy_(v)

    def shared_keys(self) -> list[str]:
        """Parameters the server averages: theta, psi, (hyper) nu and the objective's parts. The linear P-head
        and the ``kept`` ones stay local."""
        return [k for k in self.state_dict() if not k.startswith(PERSONAL_HEAD) and k not in self.kept]

    def personal_keys(self) -> list[str]:
        return [k for k in self.state_dict() if k.startswith(PERSONAL_HEAD) or k in self.kept]

    def part_keys(self) -> list[str]:
        """The objective's parts: they only train, so a served model has none."""
        return [k for k in self.state_dict() if k.split(".", 1)[0] in self.parts]

    def generic_keys(self) -> list[str]:
        """theta and psi: what the balanced loss trains and the generic-FL rules act on."""
        return [k for k in self.state_dict() if k.startswith((BODY, GENERIC_HEAD))]


def _he_normal(*modules: nn.Module) -> None:
    """Weights of every convolution and linear layer from N(0, 2 / fan_in), biases zero."""
    for module in modules:
        for m in module.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                if m.bias is not None:
                    nn.init.zeros_(m.bias)


def resolve_arch(arch: str, image_shape: tuple[int, int, int]) -> str:
    """``auto``: the paper's ConvNet for 32 x 32 images (cifar_cnn), else mnist_cnn, else cifar_cnn where only it
    takes the size (both size their first FC layer from the image); a ConfigError naming model.arch for images
    smaller than any built-in takes."""
    if arch != "auto":
        return arch
    hw = tuple(image_shape[1:])
    if hw == (32, 32):
        return "cifar_cnn"
    fits = [name for name in ("mnist_cnn", "cifar_cnn") if min(hw) >= MIN_SIDE[name]]
    if not fits:
        raise ConfigError(f"model.arch: auto has no built-in ConvNet for {' x '.join(map(str, hw))} images (the "
                          f"smallest, cifar_cnn, takes {MIN_SIDE['cifar_cnn']} x {MIN_SIDE['cifar_cnn']}); set "
                          "model.arch to a package.module:factory")
    return fits[0]


# size: nine arguments, FedModel's with the seed.
def build_model(arch: str, num_classes: int, image_shape: tuple[int, int, int], variant: str | None,
                hyper_hidden: int = 16, seed: int = 0, parts: dict[str, Callable[[], nn.Module]] | None = None,
                init: str = "normal", readout: str | None = None) -> FedModel:
    """Build a model whose initial weights depend only on ``seed`` and ``init`` (not on the global RNG's
    state)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FedModel(resolve_arch(arch, image_shape), num_classes, image_shape[0], variant, hyper_hidden,
                         parts, init, tuple(image_shape[1:]), readout)
    # channels_last convolutions train faster on CPU (oneDNN) for these small ConvNets (docs/benchmarks.md).
    return model.to(memory_format=torch.channels_last)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
