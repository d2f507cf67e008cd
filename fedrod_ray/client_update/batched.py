"""Many clients' local updates in one pass: a round's clients share the architecture, so their updates run
as one batched computation over stacked per-client weights (``runtime.batched_clients``).

Every parameter is one tensor of shape (clients, ...) whose slice m is client m's. The model runs under
``torch.func.functional_call`` inside ``vmap`` over the clients (its convolutions become grouped ones, its
linear layers batched matrix products), and one backward pass of the summed losses gives each client its
own gradients, since no client's loss depends on another client's weights. Everything else stays each
client's own, as ``local.local_update`` has it:

- its data order and augmentation: its ``local.batch_plan``, as ``local_update``'s, so it sees the same batches;
- its losses, the step seam's ``fedrod_losses``: the balanced loss with its own class counts, the
  personalized one with its own head or, for the hypernetwork, its own class distribution;
- its momentum buffers (SGD as ``torch.optim.SGD`` computes it, on its rows of the stack: from zero, or
  from the buffers it kept with ``train.momentum_buffers: keep``) and its rule state;
- its number of steps: clients are stacked most steps first, so the clients still training at a step are
  a prefix of the stack and a client whose shard has run out costs nothing; a last batch shorter than
  ``batch_size`` is padded with rows that weigh zero in its losses.

The results equal ``local_update``'s up to floating-point rounding (a grouped convolution sums in another
order), not bitwise (tests/test_batched.py). Meant for a GPU, which tiny ConvNets trained one client at a
time leave almost idle; on a CPU it is slower than one client at a time (bench/batched_round.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from ..algorithms import GenericRule, LocalCorrection
from ..config import TrainConfig
from ..data.transforms import normalize, normalized_black, shift_flip
from ..models import FedModel
from ..server_math.aggregate import StateDict
from ..specs.losses import DEFAULT_GAMMA
from .local import (
    Batch,
    ClientData,
    LocalTrainingError,
    Outcome,
    RoundInput,
    batch_plan,
    finish_update,
    kept_momentum,
    load_client_weights,
    round_lr,
    to_device,
)
from .losses import BALANCED_LOSSES, LossFn
from .step import fedrod_losses


@dataclass
class BatchJob:
    """One client of a batched update: what ``local_update`` takes for it besides the shared arguments."""

    client_id: int
    data: ClientData
    personal: StateDict | None = None  # linear head: phi_m (None: freshly initialised)
    rule_state: StateDict = field(default_factory=dict)
    initial: StateDict | None = None  # replaces the global weights as the start (``local_update``'s ``initial``)
    momentum: StateDict = field(default_factory=dict)  # its kept momentum buffers (``local_update``'s)


@dataclass
class _Plan:
    """A client's ``batch_plan`` for the whole update, as stacked tensors."""

    rows: torch.Tensor  # (steps, batch_size) rows of its shard; a short batch padded with its first row
    sizes: list[int]  # real examples per step
    draws: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # augmentation (dy, dx, flip), (steps, B)


class _Losses(nn.Module):
    """The step seam's ``fedrod_losses`` as a module call, for ``functional_call``; (l_BR, 0) without a
    personalized head, since ``vmap`` maps tensors only."""

    def __init__(self, model: FedModel, br_loss: LossFn, gamma: float):
        super().__init__()
        self.model, self.br_loss, self.gamma = model, br_loss, gamma

    def forward(self, x, y, counts, dist) -> tuple[torch.Tensor, torch.Tensor]:
        loss_g, loss_p = fedrod_losses(self.model, self.br_loss, self.gamma, x, y, counts, dist)
        return loss_g, torch.zeros_like(loss_g) if loss_p is None else loss_p


# size: local_update's batched twin: the same inputs as local_update for many clients, and one sequence of tensor
# ops that must stay in step with it
def batched_local_update(model: FedModel, message: RoundInput, jobs: list[BatchJob], cfg: TrainConfig,
                         rule: GenericRule, *, round_idx: int, seed: int, mean, std, augment: bool,
                         device: torch.device | str = "cpu") -> list[Outcome | Exception]:
    """``local_update`` for every client of ``jobs`` at once, in one batched computation on ``device``.

    Returns, in the order of ``jobs``, what ``local_update`` returns for each client (the result for the
    server, the new P-head, the new rule state), or the exception that client's own update would have
    raised (no examples, a state that does not fit the model, a non-finite loss). ``model`` only lends its
    architecture; its weights are left as some client's start.

    The generic rule's correction is applied once per step to the stacked weights and gradients: it must
    act elementwise (broadcasting over the leading client dimension) and keep no state between steps, as
    every registered rule does (tests/test_batched.py runs each one); its ``finish`` runs per client.
    """
    t0 = time.perf_counter()
    device = torch.device(device)
    model.to(device)
    if any(True for _ in model.buffers()):
        raise ValueError("the batched local update needs a model without buffers")
    params = dict(model.named_parameters())
    generic = [k for k in model.generic_keys() if k in params]
    anchor = {k: message.weights[k].to(device) for k in generic}
    broadcast = to_device(message.broadcast, device)

    outcomes: list[Outcome | Exception | None] = [None] * len(jobs)
    plans: dict[int, _Plan] = {}
    starts: dict[int, tuple[StateDict, StateDict, StateDict]] = {}
    for i, job in enumerate(jobs):
        try:
            plans[i] = _plan(batch_plan(len(job.data), cfg, seed=seed, round_idx=round_idx, client_id=job.client_id,
                                        augment=augment), cfg.batch_size, augment)
            starts[i] = _start(model, message, job, anchor, device)
        except Exception as e:  # noqa: BLE001 - this client fails alone, as its own update would
            outcomes[i] = e
    if not starts:
        return outcomes
    steps_per_epoch = {i: math.ceil(len(jobs[i].data) / cfg.batch_size) for i in starts}
    # Most steps first: the clients still training at any step are then a prefix of the stack.
    order = sorted(starts, key=lambda i: -steps_per_epoch[i])
    steps = [cfg.local_epochs * steps_per_epoch[i] for i in order]
    state_keys = sorted({k for i in order for k in starts[i][1]})
    stacked_state = {k: torch.stack([starts[i][1].get(k, torch.zeros_like(anchor[k])) for i in order])
                     for k in state_keys}
    correction = rule.start_local(anchor, stacked_state, broadcast)
    weights, momentum, history = _train(
        model, [jobs[i] for i in order], [plans[i] for i in order], [starts[i][0] for i in order],
        [starts[i][2] for i in order], steps, correction, cfg, round_idx=round_idx, mean=mean, std=std,
        augment=augment, device=device)

    lr = round_lr(cfg, round_idx)
    seconds = time.perf_counter() - t0
    stacked = {k: w.cpu() for k, w in weights.items()}
    # Cloned per client below, so that a client's buffers pickle without the whole stack.
    buffers = {k: b.cpu() for k, b in momentum.items()} if cfg.momentum_buffers == "keep" else None
    for pos, i in enumerate(order):
        k_steps = steps[pos]
        per_step = history[:k_steps, pos]
        bad = (~torch.isfinite(per_step.sum(1))).nonzero()
        if len(bad):
            outcomes[i] = LocalTrainingError(
                f"non-finite loss in local epoch {int(bad[0]) // steps_per_epoch[i] + 1} (lr={lr:g})", diverged=True)
            continue
        # A correction of this client's own: the stacked one's finish cannot take per-client step sums.
        own = rule.start_local(anchor, starts[i][1], broadcast) if correction is not None else None
        outcomes[i] = finish_update(
            model, {k: stacked[k][pos].clone() for k in stacked}, own, {k: weights[k][pos] for k in generic},
            num_samples=len(jobs[i].data), loss=float(per_step[:, 0].sum() / k_steps),
            personal_loss=float(per_step[:, 1].sum() / k_steps) if model.variant is not None else None,
            steps=k_steps, lr=lr, momentum=cfg.momentum,
            # The pass's wall time, shared out by steps: the clients' seconds add up to it.
            seconds=seconds * k_steps / sum(steps),
            momentum_buffers=None if buffers is None else {k: b[pos].clone() for k, b in buffers.items()})
    return outcomes


# size: the batched epochs' loop state, each piece a per-client stack that batched_local_update built and reads
# back
def _train(model: FedModel, jobs: list[BatchJob], plans: list[_Plan], starts: list[StateDict],
           kept: list[StateDict], steps: list[int], correction: LocalCorrection | None, cfg: TrainConfig, *,
           round_idx: int, mean, std, augment: bool, device: torch.device) -> tuple[StateDict, StateDict, torch.Tensor]:
    """Every client's SGD steps, clients ordered by ``steps`` (most first), from their ``starts`` and their
    ``kept`` momentum buffers (a buffer not kept starts at zero): the stacked trained weights (detached, on
    ``device``), the stacked momentum buffers (empty without momentum) and each step's (l_BR, l_P) per
    client (steps x clients x 2, on the CPU; zeros after a client's last step)."""
    batches = _Batches([job.data for job in jobs], plans, cfg.batch_size, mean, std, augment, device)
    counts = torch.stack([job.data.counts for job in jobs]).to(device)
    dists = torch.stack([job.data.class_dist for job in jobs]).to(device)
    losses = _client_losses(model, cfg)
    lr = round_lr(cfg, round_idx)
    weights = {k: torch.stack([start[k] for start in starts]).requires_grad_() for k in starts[0]}
    momentum = {k: torch.zeros_like(w) for k, w in weights.items()} if cfg.momentum else {}
    for k, buf in momentum.items():
        for row, own in zip(buf, kept):
            if k in own:
                row.copy_(own[k])
    buffers = list(momentum.values()) or None
    # One copy to the host at the end: a check per step would synchronise a GPU on every batch.
    history = torch.zeros(steps[0], len(jobs), 2, device=device)
    for s in range(steps[0]):
        active = sum(k > s for k in steps)
        x, y, weight = batches.step(s, active)
        # Sliced only once a client is done: a slice's backward costs a zero fill and a copy per weight.
        current = weights if active == len(jobs) else {k: w[:active] for k, w in weights.items()}
        loss_g, loss_p = vmap(losses)(current, x, y, weight, counts[:active], dists[:active])
        for w in weights.values():
            w.grad = None
        (loss_g.sum() + loss_p.sum()).backward()
        with torch.no_grad():
            if correction is not None:
                correction.apply(weights)
            _sgd_step(list(weights.values()), buffers, active, lr, cfg)
            history[s, :active, 0] = loss_g
            history[s, :active, 1] = loss_p
    return {k: w.detach() for k, w in weights.items()}, momentum, history.cpu()


def _start(model: FedModel, message: RoundInput, job: BatchJob, anchor: StateDict,
           device: torch.device) -> tuple[StateDict, StateDict, StateDict]:
    """A client's starting weights, its rule state and its kept momentum buffers on ``device``, checked as
    ``local_update`` loads them."""
    load_client_weights(model, message.weights if job.initial is None else job.initial, job.personal)
    params = dict(model.named_parameters())
    start = {k: p.detach().clone() for k, p in params.items()}
    buffers = kept_momentum(params, job.momentum)
    # Stacked with the other clients', a state must have exactly the shape its rule gives it; the rule
    # reads only the generic weights' keys.
    state = {k: v.to(device) for k, v in job.rule_state.items() if k in anchor}
    for k, v in state.items():
        if v.shape != anchor[k].shape:
            raise ValueError(f"rule state {k}: shape {tuple(v.shape)} does not match the model's "
                             f"{tuple(anchor[k].shape)}")
    return start, state, buffers


def _plan(epochs: Iterator[list[Batch]], b: int, augment: bool) -> _Plan:
    """A client's ``batch_plan`` stacked: every batch padded to ``b`` rows."""
    rows, sizes, draws = [], [], []
    for batches in epochs:
        for idx, d in batches:
            sizes.append(len(idx))
            rows.append(F.pad(idx, (0, b - len(idx)), value=int(idx[0])))
            if augment:
                # Padding rows are neither shifted nor flipped (and weigh nothing).
                draws.append([F.pad(x.to(torch.long), (0, b - len(idx))) for x in d])
    stacked = None
    if augment:
        dy, dx, flip = (torch.stack(d) for d in zip(*draws))
        stacked = (dy, dx, flip.bool())
    return _Plan(torch.stack(rows), sizes, stacked)


class _Batches:
    """Every client's data on the device, and each step's batches of the active clients."""

    def __init__(self, data: list[ClientData], plans: list[_Plan], batch_size: int, mean, std, augment: bool,
                 device: torch.device):
        # The shards one after another, normalised as local_update does (on the CPU, then moved).
        self.x = torch.cat([normalize(d.x, mean, std) for d in data]).to(device)
        self.y = torch.cat([d.y for d in data]).to(device)
        offsets = torch.tensor([0] + [len(d) for d in data[:-1]]).cumsum(0)
        total = len(plans[0].sizes)
        # (steps, clients, batch_size): a client's rows past its last step are never read.
        self.rows = torch.zeros(total, len(plans), batch_size, dtype=torch.long)
        sizes = torch.zeros(total, len(plans))
        for m, plan in enumerate(plans):
            self.rows[:len(plan.sizes), m] = plan.rows + offsets[m]
            sizes[:len(plan.sizes), m] = torch.tensor(plan.sizes, dtype=sizes.dtype)
        self.rows = self.rows.to(device)
        # Each real example weighs 1 / (its batch's size), padding 0: the per-client batch means.
        real = torch.arange(batch_size) < sizes[..., None]
        self.weight = (real / sizes.clamp_min(1)[..., None]).to(device)
        self.draws = None
        if augment:
            self.draws = tuple(torch.zeros(total, len(plans), batch_size, dtype=d.dtype) for d in plans[0].draws)
            for m, plan in enumerate(plans):
                for full, d in zip(self.draws, plan.draws):
                    full[:len(plan.sizes), m] = d
            self.draws = tuple(d.to(device) for d in self.draws)
            self.fill = normalized_black(mean, std)

    def step(self, s: int, active: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, y, weight) of step s for the first ``active`` clients: (active, B, C, H, W), (active, B) twice."""
        rows = self.rows[s, :active]
        x = self.x[rows.reshape(-1)]
        if self.draws is not None:
            dy, dx, flip = (d[s, :active].reshape(-1) for d in self.draws)
            x = shift_flip(x, dy, dx, flip, fill=self.fill)
        return x.view(*rows.shape, *x.shape[1:]), self.y[rows], self.weight[s, :active]


def _client_losses(model: FedModel, cfg: TrainConfig):
    """One client's (l_BR, l_P) on its batch, as a function of its weights: what ``vmap`` maps over clients.

    ``fedrod_losses`` runs per example (an inner ``vmap`` over the batch, each example a batch of one), and
    each loss is the weighted sum of the per-example losses (weights 1/size, zero for padding): the batch
    mean of ``local_update`` for a full or a short batch alike.
    """
    module = _Losses(model, BALANCED_LOSSES[cfg.balanced_loss], DEFAULT_GAMMA if cfg.gamma is None else cfg.gamma)

    def losses(weights, x, y, weight, counts, dist):
        named = {f"model.{k}": w for k, w in weights.items()}
        loss_g, loss_p = vmap(lambda xi, yi: functional_call(module, named, (xi[None], yi[None], counts, dist)))(x, y)
        return (loss_g * weight).sum(), (loss_p * weight).sum()

    return losses


def _sgd_step(weights: list[torch.Tensor], momentum: list[torch.Tensor] | None, active: int, lr: float,
              cfg: TrainConfig) -> None:
    """``torch.optim.SGD``'s step (weight decay, heavy-ball momentum, no dampening) on the rows of the first
    ``active`` clients; a buffer starting at zero gives torch's first step (buffer = gradient) exactly.
    The same arithmetic as torch's, as its multi-tensor (CUDA) path does it: a few kernels for all weights."""
    params = [w[:active] for w in weights]  # a prefix of a contiguous stack is contiguous
    steps = [w.grad[:active] for w in weights]
    if cfg.weight_decay:
        steps = torch._foreach_add(steps, params, alpha=cfg.weight_decay)
    if momentum is not None:
        buffers = [b[:active] for b in momentum]
        torch._foreach_mul_(buffers, cfg.momentum)
        torch._foreach_add_(buffers, steps)
        steps = buffers
    torch._foreach_add_(params, steps, alpha=-lr)
