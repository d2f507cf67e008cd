"""Personalization methods (``train.head``, ``fedrod_ray.personalization``): each one's hyperparameters
(``train.head_params``) and what it rules out. The first three are Fed-RoD's own: one head (FedAvg and the
generic baselines), a linear personalized head, a hypernetwork; then the personalized-FL baselines
(docs/method.md)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field
from pydantic.dataclasses import dataclass

from ..config.values import CLOSED, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, number
from .rules import NoParams


@dataclass(config=CLOSED)
class DittoParams:
    lam: NonNegativeFloat = 0.1  # lambda: the personal model's pull towards the global one


@dataclass(config=CLOSED)
class PFedMeParams:
    lam: PositiveFloat = 15.0  # lambda: the Moreau envelope's pull of theta~ towards w_m
    personal_lr: PositiveFloat = 0.01  # eta_p: the step of the inner problem's SGD
    inner_steps: PositiveInt = 5  # K: SGD steps on the inner problem per mini-batch


@dataclass(config=CLOSED)
class PerFedAvgParams:
    beta: PositiveFloat = 0.001  # beta^: the meta step (alpha, the inner step, is the round's lr)


@dataclass(config=CLOSED)
class FedFomoParams:
    models: PositiveInt = 4  # n: other clients' models a client receives per round
    # each of the n picks is a random model with this probability, else the highest affinity's (epsilon-greedy)
    epsilon: Annotated[float, Field(strict=True, ge=0, le=1), BeforeValidator(number)] = 0.3
    epsilon_decay: NonNegativeFloat = 0.05  # subtracted from epsilon every round (floor 0)
    # the share of a client's examples held out to weigh the models it receives (80/20 by default)
    val_fraction: Annotated[float, Field(strict=True, gt=0, lt=1), BeforeValidator(number)] = 0.2


@dataclass(config=CLOSED)
class MTLParams:
    lam: NonNegativeFloat = 0.1  # lambda: the pull towards the mean of all clients' models


@dataclass(config=CLOSED)
class PFedHNParams:
    # the clients' embeddings v_m; None: the paper's code's 1 + M / 4 (M training clients)
    embed_dim: PositiveInt | None = None
    hidden: PositiveInt = 100  # the hypernetwork's width (its MLP: 4 linear layers, ReLU between)
    # the server's SGD step on phi and the embeddings (the official 1e-2 diverges here: docs/method.md)
    server_lr: PositiveFloat = 0.001


@dataclass(config=CLOSED)
class PeFLLParams:
    # the descriptors v_m; None: the official code's 1 + M / 4 (M training clients)
    embed_dim: PositiveInt | None = None
    hidden: PositiveInt = 100  # the hypernetwork's width (pFedHN's)
    server_lr: PositiveFloat = 2e-4  # the server's Adam step on phi and psi (the official code's)
    reg_hyper: NonNegativeFloat = 1e-3  # lam_h: the regulariser (lam_h / 2) ||phi||^2 of the hypernetwork
    reg_embed: NonNegativeFloat = 1e-3  # lam_v: (lam_v / 2) ||psi||^2 of the embedding network
    reg_model: NonNegativeFloat = 0.0  # lam_theta: (lam_theta / 2) ||w_m||^2 of each generated model
    # the descriptor before H: none; standardize: each by its own coordinates' mean and std, (v - mean v) / std v
    # (FL-bench's PeFLL; H's first models differ by ~1% between clients instead of ~0.1%); official: every one by
    # the fixed mean and std of the run's first descriptor (the official code's rescaling; docs/method.md)
    descriptor_scaling: Literal["none", "standardize", "official"] = "none"


@dataclass(config=CLOSED)
class FedBABUParams:
    finetune_epochs: PositiveInt = 5  # tau_f: epochs of fine-tuning the GM on a client's own data (its PM)


@dataclass(config=CLOSED)
class FedALAParams:
    eta: PositiveFloat = 1.0  # eta_W: the step of the aggregation weights W_i (the official default)
    # s: the percentage of a client's training examples, one contiguous slice, that W_i is learned on
    rand_percent: Annotated[float, Field(strict=True, gt=0, le=100), BeforeValidator(number)] = 80.0
    # p: the top parameter tensors that ALA blends (0: all); the official 2 is a head's weight and bias, and
    # ours has no bias, so its head is 1 (docs/method.md)
    layer_idx: NonNegativeInt = 1
    threshold: PositiveFloat = 0.1  # tau_A: the start phase ends when the last K losses' std falls below it
    num_pre_loss: PositiveInt = 10  # K: the losses the start phase's stopping test reads


@dataclass(config=CLOSED)
class FedDBEParams:
    # m: the running mean's momentum, r <- (1 - m) r + m mean_batch z (the DBE repository's FMNIST script: 1)
    momentum: Annotated[float, Field(strict=True, gt=0, le=1), BeforeValidator(number)] = 1.0
    # kappa: the weight of the mean regularisation mean_k (r_k - zbar^g_k)^2 / 2 (the DBE repository's FMNIST
    # script: 50); 0 (PFLlib's default, MR off) is refused: the initial period and m would have no effect
    kl_weight: PositiveFloat = 50.0


@dataclass(config=CLOSED)
class GPFLParams:
    lam: NonNegativeFloat = 0.01  # lambda: the weight of ||f_G - E_fr[y]||_F (the official 4-layer CNN script's)
    mu: NonNegativeFloat = 0.1  # mu: the weight decay of the category embeddings E and the CoV (the same script's)


@dataclass(config=CLOSED)
class FedCPParams:
    lam: NonNegativeFloat = 5.0  # lambda: the weight of MMD^2 between z and the frozen received extractor's (MNIST script)


# What a client that never trained must give for its zero-shot model (``Personalization.new_client_needs``;
# ``final/meta.json``'s ``new_client``): nothing (the global weights with the initial personal part), its class
# counts (Fed-RoD (hyper)'s H(a; nu)), its data (forward passes over its examples) or training steps on it.
NEW_CLIENT_NEEDS = ("none", "class_counts", "data", "training")


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """A method's ``Params`` (filled from ``train.head_params``) and constraints.

    ``erm``: a personalized-FL baseline, trained with cross-entropy on one head (no balanced loss, no generic
    rule, none of the options only Fed-RoD's own local update has); ``plain_steps``: its updates are its own
    formulas of plain gradient steps (no momentum, no weight decay); ``global_model``: it has a global model
    (else its GM is the mean of the personalized models); ``reads_uploads``: its server reads every client's
    own upload (not only their aggregate); ``hypernetwork``: the server averages a hypernetwork that makes
    each client's head (``model.hyper_hidden``); ``generates_model``: the server generates every weight of each
client's model (which therefore can have no buffers, such as batch-norm statistics); ``not_private``: why it
cannot be used with client-level DP (empty: it can)."""

    params: type = NoParams
    erm: bool = True
    plain_steps: bool = False
    global_model: bool = True
    reads_uploads: bool = False
    hypernetwork: bool = False
    generates_model: bool = False
    not_private: str = ""


# What a personalized-FL baseline (``erm``) trains with: cross-entropy on one head, FedAvg's server step.
ERM = {"train.balanced_loss": "ce", "train.generic_rule": "fedavg"}

HEADS: dict[str, HeadSpec] = {
    "none": HeadSpec(erm=False), "linear": HeadSpec(erm=False), "hyper": HeadSpec(erm=False, hypernetwork=True),
    "fedper": HeadSpec(global_model=False), "fedrep": HeadSpec(global_model=False),
    "lg_fedavg": HeadSpec(global_model=False), "ditto": HeadSpec(DittoParams),
    "pfedme": HeadSpec(PFedMeParams, plain_steps=True), "perfedavg": HeadSpec(PerFedAvgParams, plain_steps=True),
    "fedfomo": HeadSpec(FedFomoParams, global_model=False, reads_uploads=True),
    "mtl": HeadSpec(MTLParams, global_model=False, reads_uploads=True),
    "fedbabu": HeadSpec(FedBABUParams),
    "pfedhn": HeadSpec(PFedHNParams, global_model=False, reads_uploads=True, generates_model=True),
    "pefll": HeadSpec(PeFLLParams, global_model=False, reads_uploads=True, generates_model=True),
    "gpfl": HeadSpec(GPFLParams), "fedcp": HeadSpec(FedCPParams),
    "fedala": HeadSpec(FedALAParams),
    "feddbe": HeadSpec(FedDBEParams, reads_uploads=True,
                       not_private="its initial period sends the server each client's mean feature, neither "
                                   "clipped nor noised"),
}


def hyper_hidden(dataset: str) -> int:
    """The paper's hypernetwork width for ``dataset`` (``model.hyper_hidden`` left out): 32 for CIFAR-10,
    else 16."""
    return 32 if dataset == "cifar10" else 16
