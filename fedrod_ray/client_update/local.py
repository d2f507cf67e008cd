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


# size: the outcome's fields, each named at the call (local_update and the batched update both build it)
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


@dataclass
class UpdateContext:
    """Everything a client's update reads besides the model, the round's message, its data and its state."""

    cfg: TrainConfig
    rule: GenericRule
    round_idx: int
    seed: int
    client_id: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    augment: bool
    device: torch.device | str = "cpu"
    initial: StateDict = field(default_factory=dict)  # the model's initial weights, which a new client has
    meta_set: ClientData | None = None  # the server's meta set, which a local objective learns against


@dataclass
class ClientStart:
    """What a client's update starts from besides the round's message: the state it keeps. ``personal``, its
    linear P-head (None: freshly initialised); ``rule_state``, its state under the generic rule (None: the
    rule's initial one); ``weights``, its own model, which replaces the global weights as the starting point (a
    rule whose clients keep their model); ``objectives``, its local objectives' states (absent: initial);
    ``momentum``, its kept momentum buffers (``train.momentum_buffers: keep``; absent: from zero)."""

    personal: StateDict | None = None
    rule_state: StateDict | None = None
    weights: StateDict | None = None
    objectives: dict[str, StateDict] | None = None
    momentum: StateDict | None = None


def local_update(model: FedModel, message: RoundInput, data: ClientData, ctx: UpdateContext,
                 start: ClientStart | None = None) -> Outcome:
    """Train ``model`` from the round's global weights (or ``start.weights``) on one client's data: E epochs of
    SGD on the losses of ``ctx.cfg`` (the balanced loss, or a local objective reading ``ctx.meta_set``), under
    the generic rule's correction. Returns the result for the server (with the local objective's new state in
    ``result.objectives`` and the optimiser's momentum buffers in ``result.momentum``), the new P-head and the
    new rule state; ``model`` is left holding the client's local model."""
    t0 = time.perf_counter()
    start = start or ClientStart()
    cfg, device = ctx.cfg, torch.device(ctx.device)
    plan = batch_plan(len(data), cfg, seed=ctx.seed, round_idx=ctx.round_idx, client_id=ctx.client_id,
                      augment=ctx.augment)
    model.to(device)
    load_client_weights(model, message.weights if start.weights is None else start.weights, start.personal)
    model.train()
    lr = round_lr(cfg, ctx.round_idx)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    params = dict(model.named_parameters())
    for k, buf in kept_momentum(params, start.momentum or {}).items():
        opt.state[params[k]]["momentum_buffer"] = buf
    generic = [k for k in model.generic_keys() if k in params]
    anchor = {k: message.weights[k].to(device) for k in generic}
    correction = ctx.rule.start_local(anchor, to_device(start.rule_state or {}, device),
                                      to_device(message.broadcast, device))
    losses, objective = _losses(model, data, ctx, lr, start.objectives or {})
    steps, loss, personal_loss = _epochs(plan, make_train_step(model, opt, losses, correction), data, ctx, lr)
    local = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    buffers = None
    if cfg.momentum_buffers == "keep":
        buffers = {k: opt.state[p]["momentum_buffer"].to("cpu", copy=True) for k, p in params.items()
                   if "momentum_buffer" in opt.state.get(p, {})}
    return finish_update(
        model, local, correction, {k: params[k].detach() for k in generic}, num_samples=len(data), loss=loss,
        personal_loss=personal_loss if model.variant is not None else None,
        steps=steps, lr=lr, momentum=cfg.momentum, seconds=time.perf_counter() - t0,
        objectives={objective.name: objective.state()} if objective is not None else None,
        momentum_buffers=buffers)


def _losses(model: FedModel, data: ClientData, ctx: UpdateContext, lr: float, objectives: dict[str, StateDict]):
    """The update's per-batch losses (``step.LossesFn``) and its local objective (None: the balanced loss of
    ``cfg.balanced_loss``, no objective), which starts from its entry of the client's ``objectives``."""
    cfg, device = ctx.cfg, torch.device(ctx.device)
    counts, dist = data.counts.to(device), data.class_dist.to(device)
    objective_cls = get_objective(cfg.balanced_loss)
    if objective_cls is None:
        gamma = DEFAULT_GAMMA if cfg.gamma is None else cfg.gamma
        return make_losses(model, get_loss(cfg.balanced_loss), gamma, counts, dist, batch_size=cfg.batch_size,
                           step=cfg.step), None
    meta = None
    if ctx.meta_set is not None and len(ctx.meta_set):
        meta = (normalize(ctx.meta_set.x, ctx.mean, ctx.std).to(device).contiguous(memory_format=torch.channels_last),
                ctx.meta_set.y.to(device))
    objective = objective_cls(cfg, meta, objectives.get(objective_cls.name, {}), device)
    return objective.losses(model, counts, dist, lr), objective


def _epochs(plan: Iterator[list[Batch]], train_step, data: ClientData, ctx: UpdateContext,
            lr: float) -> tuple[int, float, float]:
    """Run ``train_step`` over the client's batch ``plan``: (steps, mean generic loss, mean personal loss)."""
    device = torch.device(ctx.device)
    x_all, y_all = normalize(data.x, ctx.mean, ctx.std).to(device), data.y.to(device)
    black = normalized_black(ctx.mean, ctx.std) if ctx.augment else None
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
    return steps, (loss_sum / steps).item(), (ploss_sum / steps).item()


def to_device(state: StateDict, device) -> StateDict:
    return {k: v.to(device) for k, v in state.items()}
