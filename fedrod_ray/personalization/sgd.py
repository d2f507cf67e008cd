"""The pieces the personalized-FL baselines' local updates are made of: the client's batches (the same seeded
plan as ``local.local_update``), cross-entropy on the one-head model, SGD epochs with an optional gradient
term, and the update's result. Pure functions of tensors: no Ray, no files."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from ..client_update.local import (
    ClientData,
    LocalResult,
    LocalTrainingError,
    batch_plan,
    derived_seed,
    round_lr,
)
from ..data.transforms import normalize, normalized_black, shift_flip
from ..models import FedModel
from ..server_math.aggregate import StateDict

Batches = Iterator[list[tuple[torch.Tensor, torch.Tensor]]]  # one list of (x, y) mini-batches per epoch


def client_batches(data: ClientData, ctx, tag: int = 0, epochs: int | None = None) -> Batches:
    """The client's mini-batches on ``ctx.device``, epoch by epoch, from its seeded plan (``local.batch_plan``);
    ``tag`` > 0 draws another plan of the same client and round (a second pass over its data)."""
    cfg = ctx.cfg if epochs is None else dataclasses.replace(ctx.cfg, local_epochs=epochs)
    x_all = normalize(data.x, ctx.mean, ctx.std).to(ctx.device)
    y_all = data.y.to(ctx.device)
    black = normalized_black(ctx.mean, ctx.std) if ctx.augment else None
    seed = ctx.seed if tag == 0 else derived_seed(ctx.seed, tag)
    plan = batch_plan(len(data), cfg, seed=seed, round_idx=ctx.round_idx, client_id=ctx.client_id,
                      augment=ctx.augment)
    for batches in plan:
        epoch = []
        for idx, draws in batches:
            idx = idx.to(ctx.device)
            xb = x_all[idx].contiguous(memory_format=torch.channels_last)
            if draws is not None:
                xb = shift_flip(xb, *draws, fill=black)
            epoch.append((xb, y_all[idx]))
        yield epoch


def start(model: FedModel, weights: StateDict, ctx) -> None:
    """Put the model on the update's device, load ``weights`` into it and set it training."""
    model.to(ctx.device)
    model.load_partial(weights)
    model.train()


def ce_loss(model: FedModel, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
    """Cross-entropy (ERM) of the one-head model's logits."""
    return F.cross_entropy(model(xb), yb)


def optimizer(params, ctx) -> torch.optim.SGD:
    """SGD at the round's learning rate with the config's momentum and weight decay."""
    return torch.optim.SGD(params, lr=round_lr(ctx.cfg, ctx.round_idx), momentum=ctx.cfg.momentum,
                           weight_decay=ctx.cfg.weight_decay)


@contextlib.contextmanager
def frozen(params: Iterable[torch.nn.Parameter]):
    """Turn off ``params``' gradients for the block, so that a phase training the rest of the model
    back-propagates no further than it must (the same steps as leaving them out of the optimiser, at less
    cost); they are turned back on after it."""
    params = [p for p in params if p.requires_grad]
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def prox_grad_(params: dict[str, torch.Tensor], anchor: StateDict, lam: float) -> None:
    """Add the gradient of (lam / 2) ||w - anchor||^2, lam (w - anchor), to each parameter's gradient."""
    with torch.no_grad():
        for k, p in params.items():
            p.grad.add_(p - anchor[k], alpha=lam)


def sgd_epochs(model: FedModel, opt: torch.optim.Optimizer, batches: Batches,
               grad_term: Callable[[], None] | None = None,
               loss_fn: Callable[[FedModel, torch.Tensor, torch.Tensor], torch.Tensor] = ce_loss) -> tuple[float, int]:
    """SGD on ``loss_fn`` (default: the cross-entropy) over every epoch's batches, ``grad_term`` adding to the
    gradients after each backward; returns (mean loss, steps). A non-finite loss stops the update (checked
    once per epoch)."""
    loss_sum, steps = torch.zeros(()), 0
    for epoch, batch_list in enumerate(batches):
        for xb, yb in batch_list:
            loss = loss_fn(model, xb, yb)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if grad_term is not None:
                grad_term()
            opt.step()
            loss_sum = loss_sum + loss.detach().cpu()
            steps += 1
        check_finite(loss_sum, epoch)
    return (loss_sum / max(steps, 1)).item(), steps


def check_finite(loss_sum: torch.Tensor, epoch: int) -> None:
    if not torch.isfinite(loss_sum):
        raise LocalTrainingError(f"non-finite loss in local epoch {epoch + 1}", diverged=True)


def cpu_state(model: FedModel, keys: list[str] | None = None) -> StateDict:
    """A copy of the model's weights (``keys`` of them, default all) on the CPU."""
    state = model.state_dict()
    return {k: state[k].detach().to("cpu", copy=True) for k in (keys if keys is not None else state)}


def result(model: FedModel, *, num_samples: int, loss: float, steps: int, t0: float,
           upload: StateDict | None = None, shared: StateDict | None = None) -> LocalResult:
    """The update's result: the model's shared weights (or ``shared``) for the server, and the method's
    per-client ``upload``."""
    return LocalResult(shared=cpu_state(model, model.shared_keys()) if shared is None else shared,
                       num_samples=num_samples, loss=loss, personal_loss=None, steps=steps,
                       seconds=time.perf_counter() - t0, method_upload=upload or {})
