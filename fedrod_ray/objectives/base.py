"""The seam for local objectives: a generic-head loss with a procedure of its own (Meta-BSM's meta step).

An objective, chosen by ``train.balanced_loss: <name>`` and configured by the section ``train.<name>``,
replaces step 2's l_BR for one client update (docs/method.md, "One round"); the personalized loss, the generic
rule's correction, the optimizer and the server's average stay as they are. Besides its step it may own:

- client state: a ``StateDict`` the client keeps between rounds, ``ClientState.objectives[name]`` (absent:
  its initial state), which checkpoints store under the part ``<name>/``;
- a meta set: ``meta_per_class`` examples of every class that the server takes out of the training set
  before the split (``Partition.meta_indices``), so that no client holds them; every host gets them and
  each update reads them, normalised and on the training device;
- model parts: modules the model gets besides its heads (``model_parts``), built after every other weight,
  used by no forward pass, shared (averaged by sample count, like nu) and never served.

One object serves one client update: built from the meta set and the client's state, it gives the
mini-batches' losses and, afterwards, the state the client keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from ..client_update.step import LossesFn
from ..config import TrainConfig
from ..models import FedModel
from ..server_math.aggregate import StateDict

# The server's meta set on the training device: (normalised images, labels), or None when it has none.
MetaSet = tuple[torch.Tensor, torch.Tensor] | None


class LocalObjective:
    """Base class: an objective without state, meta set or model parts. Subclasses give ``losses``."""

    name: ClassVar[str] = ""
    # The plain balanced loss (``losses.BALANCED_LOSSES``) that takes its place where its procedure cannot
    # run: fine-tuning trains from the global model with no meta step.
    fallback_loss: ClassVar[str] = "bsm"

    @classmethod
    def meta_per_class(cls, cfg: TrainConfig) -> int:
        """The size of the server's meta set.

        Args:
            cfg: the run's training config (its section ``train.<name>`` holds the objective's settings).

        Returns:
            Examples of every class taken out of the training set before the split; 0: no meta set.
        """
        return 0

    @classmethod
    def model_parts(cls, cfg: TrainConfig) -> dict[str, Callable[[], nn.Module]]:
        """The model's extra modules, trained by the objective and averaged by the server.

        Args:
            cfg: the run's training config.

        Returns:
            Factories by attribute name (Meta-BSM: ``{"mwn": ...}``); each is called (seeded) after every
            other weight is built.
        """
        return {}

    def __init__(self, cfg: TrainConfig, meta: MetaSet, state: StateDict, device: torch.device):
        """Start one client update.

        Args:
            cfg: the run's training config.
            meta: the server's meta set on the training device, or None without one.
            state: the client's objective state (empty: its initial state).
            device: the training device.
        """
        self.cfg = cfg

    def losses(self, model: FedModel, counts: torch.Tensor, dist: torch.Tensor, lr: float) -> LossesFn:
        """The mini-batch loss function of this client update.

        Args:
            model: the client's model, with the objective's parts.
            counts: the client's examples per class, N_m.
            dist: its class distribution a_m.
            lr: the round's learning rate.

        Returns:
            A function of (images, labels) giving (the generic loss, the personalized loss or None); the step
            backpropagates their sum.
        """
        raise NotImplementedError

    def state(self) -> StateDict:
        """The client's objective state after the update, kept by the client and in checkpoints."""
        return {}
