"""One client update: E local epochs of SGD on the client's shard (FEDROD.md, "One round", step 2).

Per mini-batch there is one forward and one backward of

    L = l_BR(h_G(z)) + l_CE(h_G(z).detach() + h_P(z.detach()))

so the balanced loss trains theta and psi only and the personalized loss trains phi (or nu) only.
Everything random is drawn from a generator seeded by (run seed, round, client id), so the update is
the same wherever it runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .aggregate import StateDict
from .algorithms import GenericRule
from .config import DEFAULT_GAMMA, TrainConfig
from .data.transforms import augment_batch, normalize, normalized_black
from .losses import get_loss
from .meta_bsm import MetaBSM
from .models import FedModel
from .step import make_losses, make_train_step


class LocalTrainingError(RuntimeError):
    """A client's update cannot go on (for example a non-finite loss)."""


def class_distribution(counts: torch.Tensor) -> torch.Tensor:
    """a_m[c] = N_{m,c} / sum_c' N_{m,c'} from integer class counts (C,), or row by row from (M, C)."""
    return counts.to(torch.float32) / counts.sum(-1, keepdim=True).clamp_min(1)


@dataclass
class ClientData:
    x: torch.Tensor  # uint8, N x C x H x W
    y: torch.Tensor  # int64, N
    counts: torch.Tensor  # int64, per-class example counts N_{m,c}

    @property
    def class_dist(self) -> torch.Tensor:
        return class_distribution(self.counts)

    def __len__(self) -> int:
        return len(self.y)


@dataclass
class LocalResult:
    shared: StateDict  # theta*, psi* (and nu* for the hyper head): what the server averages
    num_samples: int
    loss: float  # mean balanced (generic) loss over all local steps
    personal_loss: float | None  # mean personalized loss (a model with a personalized head only)
    steps: int
    seconds: float  # wall time of the update, so that callers (benchmarks) need not time it again
    upload: StateDict = field(default_factory=dict)  # the rule's per-client message to the server
    meta_bsm: StateDict = field(default_factory=dict)  # Meta-BSM: the client's new gamma_m, which it keeps


@dataclass
class RoundInput:
    """What the server sends every client of a round: the global weights and the rule's broadcast."""

    weights: StateDict
    broadcast: StateDict = field(default_factory=dict)


def derived_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (run seed, round, client id, purpose tag)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def round_lr(cfg: TrainConfig, round_idx: int) -> float:
    """The paper's schedule: lr decayed by lr_decay once per round (round 0 uses lr)."""
    return cfg.lr * cfg.lr_decay ** round_idx


TRAIN_TAG = 1


def effective_step_sum(steps: int, momentum: float) -> float:
    """How many lr-sized steps ``steps`` SGD steps with heavy-ball ``momentum`` (buffer starting at zero,
    as in torch.optim.SGD) take along a constant gradient: sum_{s<K} (1 - beta^(K-s)) / (1 - beta);
    K itself without momentum."""
    if momentum == 0:
        return float(steps)
    return sum((1 - momentum ** (steps - s)) / (1 - momentum) for s in range(steps))


def local_update(model: FedModel, message: RoundInput, data: ClientData, cfg: TrainConfig, rule: GenericRule, *,
                 round_idx: int, seed: int, client_id: int, mean, std, augment: bool,
                 personal: StateDict | None = None, rule_state: StateDict | None = None,
                 initial: StateDict | None = None, meta_set: ClientData | None = None,
                 meta_state: StateDict | None = None,
                 device: torch.device | str = "cpu") -> tuple[LocalResult, StateDict | None, StateDict]:
    """Train ``model`` from the round's global weights on one client's data.

    ``personal`` is the client's stored P-head (linear head; None means freshly initialised) and
    ``rule_state`` its state under the generic rule (empty: the rule's initial state). ``initial``, if
    given, replaces the global weights as the starting point (a rule whose clients keep their own model).
    Returns the
    result for the server, the new P-head and the new rule state; ``model`` is left holding the
    client's local model. Meta-BSM (``cfg.balanced_loss == "meta_bsm"``) takes the server's meta set and
    the client's state (gamma_m; None: its initial value) and returns the new state in ``result.meta_bsm``.
    """
    t0 = time.perf_counter()
    n = len(data)
    if n == 0:
        raise LocalTrainingError("the client has no training examples")
    device = torch.device(device)
    model.to(device)
    model.load_partial(message.weights if initial is None else initial)
    if model.variant == "linear":
        if personal is None:
            torch.nn.init.zeros_(model.personal_head.weight)
        else:
            model.load_partial(personal)
    model.train()

    gen = torch.Generator().manual_seed(derived_seed(seed, round_idx, client_id, TRAIN_TAG))
    x_all = normalize(data.x, mean, std).to(device)
    y_all = data.y.to(device)
    counts = data.counts.to(device)
    dist = data.class_dist.to(device)
    black = normalized_black(mean, std) if augment else None
    meta = MetaBSM(cfg, meta_set, meta_state, mean, std, device) if cfg.balanced_loss == "meta_bsm" else None
    br_loss = get_loss(cfg.balanced_loss) if meta is None else None
    gamma = DEFAULT_GAMMA if cfg.gamma is None else cfg.gamma

    lr = round_lr(cfg, round_idx)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    params = dict(model.named_parameters())
    generic = [k for k in model.generic_keys() if k in params]
    anchor = {k: message.weights[k].to(device) for k in generic}
    correction = rule.start_local(anchor, _to(rule_state or {}, device), _to(message.broadcast, device))
    if meta is not None:
        def losses(xb, yb):
            return meta.step(model, xb, yb, counts, dist, lr)
    else:
        losses = make_losses(model, br_loss, gamma, counts, dist, batch_size=cfg.batch_size, step=cfg.step)
    train_step = make_train_step(model, opt, losses, correction)

    loss_sum = torch.zeros((), device=device)
    ploss_sum = torch.zeros((), device=device)
    steps = 0
    for epoch in range(cfg.local_epochs):
        order = torch.randperm(n, generator=gen).to(device)
        for start in range(0, n, cfg.batch_size):
            idx = order[start:start + cfg.batch_size]
            xb, yb = x_all[idx].contiguous(memory_format=torch.channels_last), y_all[idx]
            if augment:
                xb = augment_batch(xb, gen, fill=black)
            loss_g, loss_p = train_step(xb, yb)
            loss_sum += loss_g
            if loss_p is not None:
                ploss_sum += loss_p
            steps += 1
        # One check per epoch: a per-step .item() would synchronise a GPU on every batch.
        if not torch.isfinite(loss_sum + ploss_sum):
            raise LocalTrainingError(f"non-finite loss in local epoch {epoch + 1} (lr={lr:g})")

    state = model.state_dict()
    shared = {k: state[k].detach().to("cpu", copy=True) for k in model.shared_keys()}
    new_personal = ({k: state[k].detach().to("cpu", copy=True) for k in model.personal_keys()}
                    if model.variant == "linear" else None)
    new_rule_state, upload = {}, {}
    if correction is not None:
        with torch.no_grad():
            new_rule_state, upload = correction.finish({k: params[k].detach() for k in generic},
                                                       lr * effective_step_sum(steps, cfg.momentum))
    result = LocalResult(
        shared=shared,
        num_samples=n,
        loss=(loss_sum / steps).item(),
        personal_loss=(ploss_sum / steps).item() if model.variant is not None else None,
        steps=steps,
        seconds=time.perf_counter() - t0,
        upload=_to(upload, "cpu"),
        meta_bsm=meta.state() if meta is not None else {},
    )
    return result, new_personal, _to(new_rule_state, "cpu")


def _to(state: StateDict, device) -> StateDict:
    return {k: v.to(device) for k, v in state.items()}
