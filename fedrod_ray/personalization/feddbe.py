"""FedDBE (Zhang et al., NeurIPS 2023): FedAvg with the domain bias eliminator.

A personal vector z^p (the PRBM, ``models.readouts.DBEReadout``, zeros at first) is added to the features
before the head and absorbs the client's representation bias; the mean regularisation (MR) pulls the client's
running feature mean r toward the consensus mean zbar^g, which the server fixes once, before round 1:

- initial period: every training client (asked, ``Ask``) trains E epochs from the initial model with plain
  cross-entropy (no PRBM, no MR), tracking r, and answers r and its number of examples; the server's zbar^g
  is their sample-weighted mean. Their models are discarded: round 1 starts from the initial GM;
- client: (theta, h) <- the GM, r <- 0; per batch r <- (1 - m) r + m mean_batch z (the gradient flows through
  this batch's features only), loss = CE(h(z + z^p), y) + kappa mean_k (r_k - zbar^g_k)^2 / 2; one SGD step on
  theta and h (the round's optimiser) and on z^p (plain SGD at the initial learning rate, the official code's
  own optimiser). It uploads (theta, h) and keeps z^p (and zbar^g, which its fine-tuning reads);
- server: FedAvg's mean.

GM = h(theta(x)), without any PRBM; PM = h(theta(x) + z^p) with the latest global weights. A new client has
z^p = 0: its zero-shot PM is the GM; its "after" is the client loss from the GM and z^p = 0.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ..client_update.local import round_lr
from ..models import READOUT
from ..server_math.aggregate import StateDict
from ..specs.methods import FedDBEParams
from .base import Personalization, on_latest_global
from .finetune import FINETUNE_TAG
from .registry import register
from .sgd import client_batches, cpu_state, result, sgd_epochs, start

INITIAL_TAG = 20  # seeds the initial period's batch order apart from round 1's training
SHIFT = READOUT + "shift"  # z^p
CONSENSUS = "consensus"  # zbar^g: server state, each round's message and a trained client's personal state
READY = "consensus_ready"  # server state: 1.0 once the initial period has set zbar^g
INITIAL = "initial"  # the initial period's question
RUNNING, SAMPLES = "running_mean", "samples"  # its answer


def running_mean(r: torch.Tensor, z: torch.Tensor, m: float) -> torch.Tensor:
    """r <- (1 - m) r + m mean_batch z."""
    return (1 - m) * r + m * z.mean(0)


def mean_regularizer(r: torch.Tensor, consensus: torch.Tensor) -> torch.Tensor:
    """mean_k (r_k - zbar^g_k)^2 / 2 (unweighted by kappa)."""
    return (0.5 * (r - consensus) ** 2).mean()


def consensus_mean(answers: dict[int, StateDict]) -> torch.Tensor:
    """zbar^g: the running means r_i weighted by the clients' numbers of examples, in client order."""
    if not answers:
        raise RuntimeError("feddbe: no client answered the initial period, so there is no consensus mean")
    total = sum(float(a[SAMPLES]) for a in answers.values())
    return sum(float(answers[c][SAMPLES]) / total * answers[c][RUNNING] for c in sorted(answers))


class DBELoss:
    """The client's loss on a batch, tracking r across the batches it is called on (r detached after each):
    with ``consensus`` (zbar^g) the PRBM and MR term, without it (the initial period) plain cross-entropy."""

    def __init__(self, dim: int, consensus: torch.Tensor | None, params: FedDBEParams):
        self.r = torch.zeros(dim)
        self.consensus = consensus
        self.params = params

    def __call__(self, model, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        z = model.features(xb)
        r = running_mean(self.r.to(z.device), z, self.params.momentum)
        self.r = r.detach()
        if self.consensus is None:
            return F.cross_entropy(model.generic_head(z), yb)
        mr = mean_regularizer(r, self.consensus.to(z.device))
        return F.cross_entropy(model.readout.personal_logits(model, z), yb) + self.params.kl_weight * mr


@register
class FedDBE(Personalization):
    name = "feddbe"
    Params = FedDBEParams
    readout = "feddbe"
    global_reading = None  # the PM adds z^p inside the head; the GM is the reading of a client without one
    pm_from_global = True
    server_reads_clients = True  # the initial period reads each client's running mean

    def __init__(self, params=None):
        super().__init__(params)
        self._num_clients = 0
        self._consensus: torch.Tensor | None = None  # the initial period's zbar^g, until the server state has it

    def personal_keys(self, model):
        return model.readout_personal_keys()

    # --- the client ----------------------------------------------------------------------------------------

    def fit(self, model, data, ctx, consensus: torch.Tensor | None, epochs: int, tag: int) -> tuple[float, int, DBELoss]:
        """``epochs`` epochs of the client's loss on the model as loaded (batches drawn with ``tag``): the
        round's optimiser on theta and h, plain SGD at the initial learning rate on z^p."""
        shift = model.readout.shift
        rest = [p for p in model.parameters() if p is not shift]
        opt = torch.optim.SGD([{"params": rest}, {"params": [shift], "lr": ctx.cfg.lr, "momentum": 0.0,
                                                  "weight_decay": 0.0}],
                              lr=round_lr(ctx.cfg, ctx.round_idx), momentum=ctx.cfg.momentum, weight_decay=ctx.cfg.weight_decay)
        loss_fn = DBELoss(shift.shape[0], consensus, self.params)
        loss, steps = sgd_epochs(model, opt, client_batches(data, ctx, tag, epochs), loss_fn=loss_fn)
        return loss, steps, loss_fn

    def answer(self, phase, model, common, question, data, ctx):
        """``initial``: E epochs of plain cross-entropy from the initial model; r and the number of examples."""
        if phase != INITIAL:
            return super().answer(phase, model, common, question, data, ctx)
        start(model, ctx.initial, ctx)
        _, _, loss_fn = self.fit(model, data, ctx, None, ctx.cfg.local_epochs, INITIAL_TAG)
        return {RUNNING: loss_fn.r.cpu(), SAMPLES: torch.tensor(float(len(data)))}

    def train(self, model, message, data, personal, local_model, rule_state, objectives, momentum, ctx):
        t0 = time.perf_counter()
        consensus = message.per_client[ctx.client_id][CONSENSUS]
        start(model, {**message.weights, SHIFT: ctx.initial[SHIFT] if personal is None else personal[SHIFT]}, ctx)
        loss, steps, _ = self.fit(model, data, ctx, consensus, ctx.cfg.local_epochs, 0)
        return (result(model, num_samples=len(data), loss=loss, steps=steps, t0=t0),
                {**cpu_state(model, [SHIFT]), CONSENSUS: consensus.clone()}, {})

    def pm_job(self, state, global_shared, rounds_done, server_state, client_id):
        """The latest global weights with the client's z^p (a client that never trained: its PM is the GM)."""
        return on_latest_global(state, global_shared, rounds_done)

    def load_pm(self, model, state, data, ctx):
        model.load_partial({**state.local_model, SHIFT: state.personal[SHIFT]})

    def adapt(self, model, message, data, personal, epochs, ctx):
        """``epochs`` epochs of the client loss from the global weights and the client's z^p (a new client:
        zeros, and zbar^g from its message; a training client that never trained has neither: plain
        cross-entropy, as the initial period)."""
        sent = personal if personal is not None else message.per_client.get(ctx.client_id, {})
        consensus = sent.get(CONSENSUS) if sent.get(READY, 1.0) else None
        start(model, {**message.weights, SHIFT: ctx.initial[SHIFT] if personal is None else personal[SHIFT]}, ctx)
        self.fit(model, data, ctx, consensus, epochs, FINETUNE_TAG)
        return model

    # --- the server ----------------------------------------------------------------------------------------

    def init_server_state(self, ctx):
        self._num_clients = ctx.num_clients
        return {CONSENSUS: torch.zeros_like(ctx.initial[SHIFT]), READY: torch.tensor(0.0)}

    def consensus(self, server_state: StateDict, ask) -> torch.Tensor:
        """zbar^g: the server state's, or, before round 1, the initial period's (asked of every training
        client once; ``server_update`` then keeps it)."""
        if bool(server_state[READY]):
            return server_state[CONSENSUS]
        if self._consensus is None:
            self._consensus = consensus_mean(ask(INITIAL, {}, {m: {} for m in range(self._num_clients)}))
        return self._consensus

    def messages(self, server_state, ids, uploads, round_idx, seed, ask):
        consensus = self.consensus(server_state, ask)
        return {cid: {CONSENSUS: consensus} for cid in ids}

    def server_update(self, averaged, results, uploads, server_state, initial, num_clients, ask):
        if self._consensus is not None and not bool(server_state[READY]):
            server_state = {**server_state, CONSENSUS: self._consensus, READY: torch.tensor(1.0)}
        self._consensus = None
        return averaged, server_state

    def new_client_message(self, server_state, global_shared):
        return {CONSENSUS: server_state[CONSENSUS], READY: server_state[READY]}

