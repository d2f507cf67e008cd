"""One client update: E local epochs of SGD on the client's shard (docs/method.md, "One round", step 2).

Per mini-batch there is one forward and one backward of

    L = l_BR(h_G(z)) + l_CE(h_G(z).detach() + h_P(z.detach()))

so the balanced loss trains theta and psi only and the personalized loss trains phi (or nu) only.
Everything random is drawn from a generator seeded by (run seed, round, client id), so the update is
the same wherever it runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from ..algorithms import GenericRule, LocalCorrection
from ..config import TrainConfig
from ..data.transforms import augment_draws, normalize, normalized_black, shift_flip
from ..models import FedModel
from ..objectives import get_objective
from ..server_math.aggregate import StateDict
from ..specs.losses import DEFAULT_GAMMA
from .losses import get_loss
from .step import make_losses, make_train_step


class LocalTrainingError(RuntimeError):
    """A client's update cannot go on (for example a non-finite loss). ``diverged``: its loss or (client-level
    DP) its update is not finite, which under DP drops the client from its round without counting against
    the failure limits."""

    def __init__(self, message: str, diverged: bool = False):
        super().__init__(message)
        self.diverged = diverged

    def __reduce__(self):
        return type(self), (str(self), self.diverged)


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
    # The local objective's new client state under its name (``ClientState.objectives``), which the client keeps.
    objectives: dict[str, StateDict] = field(default_factory=dict)
    # The optimiser's momentum buffers after the update, by parameter name (``train.momentum_buffers: keep``;
    # else empty), which the client keeps (``ClientState.momentum``); the server never reads them.
    momentum: StateDict = field(default_factory=dict)
    # The personalization method's per-client message to the server (FedFOMO's affinities), never averaged.
    method_upload: StateDict = field(default_factory=dict)
    # Client-level DP: ``shared`` is the global weights plus the update clipped to ``RoundInput.clip_norm``, and
    # this says whether clipping shortened it (adaptive clipping counts the updates it did not).
    clipped: bool = False


@dataclass
class RoundInput:
    """What the server sends every client of a round: the global weights and the rule's broadcast (and with
    client-level DP the clip norm), and what the personalization method sends to each client in particular
    (by client id)."""

    weights: StateDict
    broadcast: StateDict = field(default_factory=dict)
    per_client: dict[int, StateDict] = field(default_factory=dict)
    # Client-level DP: the L2 norm every client clips its update to the shared weights to (None: no clipping).
    clip_norm: float | None = None


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


def kept_momentum(params: dict[str, torch.Tensor], kept: StateDict) -> StateDict:
    """A client's kept momentum buffers (``ClientState.momentum``) as new tensors on its parameters' device
    and in their memory layout, for the optimiser to update in place: the kept ones are the client's
    committed state, which training never writes into. A buffer that fits no parameter is an error, as a
    rule state that does not fit the model is."""
    out = {}
    for k, v in kept.items():
        p = params.get(k)
        if p is None:
            raise ValueError(f"momentum buffer {k}: the model has no such parameter")
        if p.shape != v.shape:
            raise ValueError(f"momentum buffer {k}: shape {tuple(v.shape)} does not match the parameter's "
                             f"{tuple(p.shape)}")
        out[k] = torch.empty_like(p, requires_grad=False).copy_(v)
    return out


# A mini-batch of a client's plan: its rows of the client's shard and its augmentation draws (dy, dx, flip),
# None without augmentation.
Batch = tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None]
# What a client update gives back: the result for the server, the new P-head, the new rule state.
Outcome = tuple[LocalResult, StateDict | None, StateDict]


def batch_plan(n: int, cfg: TrainConfig, *, seed: int, round_idx: int, client_id: int,
               augment: bool) -> Iterator[list[Batch]]:
    """A client's mini-batches, one list per local epoch, drawn (lazily, epoch by epoch) from its own generator
    seeded by (run seed, round, client id): each epoch's permutation, then each of its batches' augmentation.
    The per-client and the batched update (``fedrod_ray.client_update.batched``) both train on this plan, so a
    client sees the same batches in either."""
    if n == 0:
        raise LocalTrainingError("the client has no training examples")
    gen = torch.Generator().manual_seed(derived_seed(seed, round_idx, client_id, TRAIN_TAG))

    def epoch() -> list[Batch]:
        order = torch.randperm(n, generator=gen)
        return [(idx, augment_draws(len(idx), gen) if augment else None) for idx in order.split(cfg.batch_size)]

    return (epoch() for _ in range(cfg.local_epochs))


def load_client_weights(model: FedModel, weights: StateDict, personal: StateDict | None) -> None:
    """Load a client's model: ``weights`` (the global ones, or its own local model) and, for the linear head,
    its phi_m (None: a client that never trained, whose head starts at zero)."""
    model.load_partial(weights)
    if model.variant == "linear":
        if personal is None:
            torch.nn.init.zeros_(model.personal_head.weight)
        else:
            model.load_partial(personal)


def finish_update(model: FedModel, local: StateDict, correction: LocalCorrection | None, generic: StateDict, *,
                  num_samples: int, loss: float, personal_loss: float | None, steps: int, lr: float,
                  momentum: float, seconds: float, objectives: dict[str, StateDict] | None = None,
                  momentum_buffers: StateDict | None = None) -> Outcome:
    """A client update's outcome from its trained weights: ``local`` (every parameter, on the CPU) gives the
    shared weights for the server and the linear head's phi_m; ``generic`` (theta and psi, on the training
    device) the rule's new client state and upload; ``momentum_buffers`` (on the CPU) are what the client
    keeps of its optimiser."""
    new_rule_state, upload = {}, {}
    if correction is not None:
        with torch.no_grad():
            new_rule_state, upload = correction.finish(generic, lr * effective_step_sum(steps, momentum))
    result = LocalResult(
        shared={k: local[k] for k in model.shared_keys()},
        num_samples=num_samples,
        loss=loss,
        personal_loss=personal_loss,
        steps=steps,
        seconds=seconds,
        upload=to_device(upload, "cpu"),
        objectives=objectives or {},
        momentum=momentum_buffers or {},
    )
    personal = {k: local[k] for k in model.personal_keys()} if model.variant == "linear" else None
    return result, personal, to_device(new_rule_state, "cpu")


def local_update(model: FedModel, message: RoundInput, data: ClientData, cfg: TrainConfig, rule: GenericRule, *,
                 round_idx: int, seed: int, client_id: int, mean, std, augment: bool,
                 personal: StateDict | None = None, rule_state: StateDict | None = None,
                 initial: StateDict | None = None, meta_set: ClientData | None = None,
                 objectives: dict[str, StateDict] | None = None, momentum_buffers: StateDict | None = None,
                 device: torch.device | str = "cpu") -> Outcome:
    """Train ``model`` from the round's global weights on one client's data.

    ``personal`` is the client's stored P-head (linear head; None means freshly initialised) and
    ``rule_state`` its state under the generic rule (empty: the rule's initial state). ``initial``, if
    given, replaces the global weights as the starting point (a rule whose clients keep their own model).
    Returns the result for the server, the new P-head and the new rule state; ``model`` is left holding the
    client's local model. A local objective (``fedrod_ray.objectives``, by ``cfg.balanced_loss``) reads the
    server's ``meta_set`` and its entry of the client's ``objectives`` (absent: its initial state), and
    returns the new entry in ``result.objectives``. ``momentum_buffers`` are the client's kept momentum
    buffers (``train.momentum_buffers: keep``; absent or empty: from zero), continued by this update's
    optimiser, whose buffers then come back in ``result.momentum``.
    """
    t0 = time.perf_counter()
    n = len(data)
    plan = batch_plan(n, cfg, seed=seed, round_idx=round_idx, client_id=client_id, augment=augment)
    device = torch.device(device)
    model.to(device)
    load_client_weights(model, message.weights if initial is None else initial, personal)
    model.train()

    x_all = normalize(data.x, mean, std).to(device)
    y_all = data.y.to(device)
    counts = data.counts.to(device)
    dist = data.class_dist.to(device)
    black = normalized_black(mean, std) if augment else None
    lr = round_lr(cfg, round_idx)
    objective_cls = get_objective(cfg.balanced_loss)
    objective = None
    if objective_cls is not None:
        meta = None
        if meta_set is not None and len(meta_set):
            meta = (normalize(meta_set.x, mean, std).to(device).contiguous(memory_format=torch.channels_last),
                    meta_set.y.to(device))
        objective = objective_cls(cfg, meta, (objectives or {}).get(objective_cls.name, {}), device)

    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    params = dict(model.named_parameters())
    for k, buf in kept_momentum(params, momentum_buffers or {}).items():
        opt.state[params[k]]["momentum_buffer"] = buf
    generic = [k for k in model.generic_keys() if k in params]
    anchor = {k: message.weights[k].to(device) for k in generic}
    correction = rule.start_local(anchor, to_device(rule_state or {}, device), to_device(message.broadcast, device))
    if objective is not None:
        losses = objective.losses(model, counts, dist, lr)
    else:
        gamma = DEFAULT_GAMMA if cfg.gamma is None else cfg.gamma
        losses = make_losses(model, get_loss(cfg.balanced_loss), gamma, counts, dist, batch_size=cfg.batch_size,
                             step=cfg.step)
    train_step = make_train_step(model, opt, losses, correction)

    loss_sum = torch.zeros((), device=device)
    ploss_sum = torch.zeros((), device=device)
    steps = 0
    for epoch, batches in enumerate(plan):
        for idx, draws in batches:
            idx = idx.to(device)
            xb, yb = x_all[idx].contiguous(memory_format=torch.channels_last), y_all[idx]
            if draws is not None:
                xb = shift_flip(xb, *draws, fill=black)
            loss_g, loss_p = train_step(xb, yb)
            loss_sum += loss_g
            if loss_p is not None:
                ploss_sum += loss_p
            steps += 1
        # One check per epoch: a per-step .item() would synchronise a GPU on every batch.
        if not torch.isfinite(loss_sum + ploss_sum):
            raise LocalTrainingError(f"non-finite loss in local epoch {epoch + 1} (lr={lr:g})", diverged=True)

    local = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    buffers = None
    if cfg.momentum_buffers == "keep":
        buffers = {k: opt.state[p]["momentum_buffer"].to("cpu", copy=True) for k, p in params.items()
                   if "momentum_buffer" in opt.state.get(p, {})}
    return finish_update(
        model, local, correction, {k: params[k].detach() for k in generic}, num_samples=n,
        loss=(loss_sum / steps).item(),
        personal_loss=(ploss_sum / steps).item() if model.variant is not None else None,
        steps=steps, lr=lr, momentum=cfg.momentum, seconds=time.perf_counter() - t0,
        objectives={objective.name: objective.state()} if objective is not None else None,
        momentum_buffers=buffers)


def to_device(state: StateDict, device) -> StateDict:
    return {k: v.to(device) for k, v in state.items()}
