"""The seam for personalization methods: what a client keeps, how it trains, how the server combines, and
how the generic model (GM) and each client's personalized model (PM) are read for G-FL and P-FL.

A method (``train.head``) is one module here, a ``Personalization`` subclass registered by name. Fed-RoD's
own heads (none, linear, hyper) are methods like the personalized-FL baselines (docs/method.md,
"Personalized-FL baselines"). A round, as the federation drives it:

1. ``messages``: what each sampled client receives besides the global weights (FedFOMO: other clients'
   models; pFedHN: its own model, generated from the server's state); the global weights and the generic
   rule's broadcast go to every client;
   Before that, ``messages`` may ask clients a question (``Ask``, answered by ``answer`` on the client:
   PeFLL's descriptor of the client's data, which the server's message is made from);
2. on the client, ``train`` runs the local update from the client's state and returns the result for the
   server, the personal state the client keeps (never sent) and the generic rule's client state;
3. the server averages the shared weights (``FedModel.shared_keys``) as the generic rule says, then
   ``server_update`` gives the new global weights and the method's server state from that average and each
   client's own result (pFedHN: its model, whose difference from the one it was sent the server
   back-propagates into its hypernetwork), asking clients again where it needs them (PeFLL: the
   gradient of each client's descriptor goes back to it, and the client's gradient of the embedding
   network comes back).

The method's client state is ``ClientState.personal`` (a flat ``StateDict`` whose keys it chooses: a head,
Ditto's personal model, pFedMe's theta~) and ``ClientState.local_model`` (its last upload); its server state
is a flat ``StateDict`` the checkpoint keeps under ``method/<name>/`` (which can be a whole server model:
pFedHN's hypernetwork, embeddings and optimiser state), made from a ``ServerContext`` (the model's initial
weights, the run's seed, the data's shape), and read by ``pm_job`` where the server makes the PMs. Every
hook's default is Fed-RoD's.

A client that never trained (a held-out new client) is personalized in two steps, both the method's:
before any training of its own, its zero-shot model (``new_client_needs`` says what it must give for it;
the server's ``new_client_message`` and the client's ``new_client_model`` make it, or, by default, it is
the PM's global reading of a client with no personal state); after, ``adapt``: E epochs of its own
adaptation from what it received (default: fine-tuning, ``finetune.fine_tune``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..client_update.local import ClientData, LocalResult, Outcome, RoundInput, UpdateContext
from ..models import FedModel
from ..server_math.aggregate import StateDict
from ..specs.rules import NoParams
from .finetune import fine_tune


@dataclass(frozen=True)
class ServerContext:
    """What the method's server state is made from before the first round."""

    num_clients: int  # the training clients
    initial: StateDict  # the model's initial weights (their shapes: a server model that generates them)
    seed: int  # the run's
    image_shape: tuple[int, int, int]  # C x H x W
    num_classes: int


# The server's question to some of the round's clients, within the round (``Personalization.answer``):
# ask(phase, common, questions) sends each client ``common`` and its own question (by client id) and gives
# back the answers of those that answered (a client that failed is logged and left out).
Ask = Callable[[str, StateDict, dict[int, StateDict]], dict[int, StateDict]]


class Personalization:
    """Base class: hooks with Fed-RoD's behaviour; a method overrides what it changes."""

    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    # The model's personalized part (``FedModel.variant``): None, "linear" (phi_m) or "hyper" (H(a; nu)).
    variant: ClassVar[str | None] = None
    # The method's own readout of the features (``models.readouts``: GPFL's, FedCP's), whose modules the model
    # carries on every runtime; its shared entries are averaged like the extractor, its ``personal`` ones kept.
    readout: ClassVar[str | None] = None
    # The PM's global reading (``pfl_pm_global``): "model", the global weights with the client's personal
    # part (``reading_heads``); None, no such reading (NaN), a client that never trained then reads the GM.
    global_reading: ClassVar[str | None] = "model"
    # The PM is made on the server at evaluation (``pm_job``), from the global model or the method's server
    # state: it changes every round.
    pm_from_global: ClassVar[bool] = False
    # A client's calls carry its last local model (``ClientState.for_training``).
    starts_from_local_model: ClassVar[bool] = False
    # The server's step (``messages``, ``server_update``) reads each client's own result or last upload, not only
    # the round's average: the method cannot run where the server learns only sums (secure aggregation).
    server_reads_clients: ClassVar[bool] = False
    # What a client that never trained gives for its zero-shot model (one of ``specs.methods.NEW_CLIENT_NEEDS``).
    new_client_needs: ClassVar[str] = "none"
    # The zero-shot model is the PM's global reading of a client with no personal state (``reading_heads``),
    # which the evaluation scores in its one pass of the global model; False: the executor makes it
    # (``new_client_model``, from ``new_client_message``) and scores it.
    zero_shot_is_reading: ClassVar[bool] = True

    def __init__(self, params=None):
        self.params = params if params is not None else self.Params()

    # --- the model ------------------------------------------------------------------------------------

    def personal_keys(self, model: FedModel) -> list[str]:
        """Parameters besides the personalized head that every client keeps and never sends."""
        return []

    # --- client ---------------------------------------------------------------------------------------

    # size: the seam's hook: what a client keeps (personal part, local model, rule, objective and momentum state)
    # is passed part by part, as each method reads a different few
    def train(self, model: FedModel, message: RoundInput, data: ClientData, personal: StateDict | None,
              local_model: StateDict | None, rule_state: StateDict, objectives: dict[str, StateDict],
              momentum: StateDict, ctx: UpdateContext) -> Outcome:
        """One local update: (the result for the server, the personal state the client keeps, the rule's
        client state). ``model`` is left holding the client's model."""
        raise NotImplementedError

    def load_pm(self, model: FedModel, state, data: Callable[[], ClientData], ctx: UpdateContext) -> None:
        """Load the PM of the client whose ``ClientState`` is ``state`` (after ``pm_job``) into ``model``;
        ``ctx.round_idx`` is its last round."""
        model.load_partial(state.local_model)
        if state.personal is not None:
            model.load_partial(state.personal)

    def new_client_model(self, model: FedModel, message: RoundInput, data: ClientData,
                         ctx: UpdateContext) -> FedModel:
        """The zero-shot model of client ``ctx.client_id``, which never trained, from what it received
        (``message.weights`` and its ``message.per_client`` entry, ``new_client_message``) and, as
        ``new_client_needs`` says, its ``data``: the model to score (``model``, loaded, by default: the
        global weights with the initial personal part)."""
        model.load_partial(message.weights)
        model.load_partial({k: ctx.initial[k] for k in model.personal_keys()})
        return model

    def adapt(self, model: FedModel, message: RoundInput, data: ClientData, personal: StateDict | None,
              epochs: int, ctx: UpdateContext) -> FedModel:
        """The model to score after ``epochs`` epochs of the client's own adaptation on ``data``, from what it
        received (``message``; a client that never trained: with its ``new_client_message`` entry) and its
        ``personal`` state (None: it never trained): a new client's "after" and, with
        ``eval.finetune_train``, a training client's fine-tuned P-FL. Default: ``fine_tune`` of the whole
        one-head model from the global weights."""
        fine_tune(model, message.weights, data, None, epochs, ctx)
        return model

    # --- server ---------------------------------------------------------------------------------------

    def messages(self, server_state: StateDict, ids: list[int], uploads: dict[int, StateDict | None],
                 round_idx: int, seed: int, ask: Ask) -> dict[int, StateDict]:
        """What each of the round's clients ``ids`` receives besides the global weights; ``uploads`` is every
        client's last upload (None: it never trained); ``ask`` puts a question to clients first (PeFLL: each
        sampled client's descriptor, from which the server makes the model it sends)."""
        return {}

    def new_client_message(self, server_state: StateDict, global_shared: StateDict) -> StateDict:
        """What a client that never trained receives besides the global weights, for its zero-shot model and
        its adaptation (its ``RoundInput.per_client`` entry): nothing by default."""
        return {}

    def init_server_state(self, ctx: ServerContext) -> StateDict:
        """The server state before the first round (drawn from ``ctx.seed`` where it is random)."""
        return {}

    def server_update(self, averaged: StateDict, results: dict[int, LocalResult],
                      uploads: dict[int, StateDict | None], server_state: StateDict, initial: StateDict,
                      num_clients: int, ask: Ask) -> tuple[StateDict, StateDict]:
        """(new global weights, new server state) from the participants' averaged shared weights, their
        ``results`` and every client's last upload (``uploads``, the round's included); ``ask`` puts a
        question to clients within the round (PeFLL: each client's part of the backward pass)."""
        return averaged, server_state

    def answer(self, phase: str, model: FedModel, common: StateDict, question: StateDict, data: ClientData,
               ctx: UpdateContext) -> StateDict:
        """A client's answer to the server's question of ``phase`` within a round (``Ask``), from its data;
        ``model`` is the host's, free to use. It keeps nothing: the answer is all that leaves."""
        raise NotImplementedError(f"method {self.name!r} asks its clients no {phase!r} question")

    def generic_model(self, global_shared: StateDict, pms: Callable[[], Iterable[StateDict]]) -> StateDict:
        """The GM's weights (G-FL, P-FL (GM), ``final/``): the global weights, or (a method without a global
        model) the mean of the training clients' PMs, which ``pms`` gives, one at a time."""
        return global_shared

    # The PM's global reading replaces the global model's head by ``reading_heads`` instead of adding them.
    reading_replaces_head: ClassVar[bool] = False

    def reading_heads(self, model: FedModel, personal: list[StateDict | None], class_dists: torch.Tensor,
                      initial: StateDict) -> torch.Tensor | None:
        """The heads (clients x classes x features) that the PM's global reading adds to the global model's
        logits on its features, for clients with these personal states (None: never trained) and class
        distributions; None: the reading is the global model itself."""
        return None

    def pm_job(self, state, global_shared: StateDict, rounds_done: int, server_state: StateDict, client_id: int):
        """The ``ClientState`` that client ``client_id``'s PM is evaluated from (``load_pm``) after ``rounds_done``
        rounds: its own (with ``pm_from_global``: one made on the server, of the global weights or of the
        method's ``server_state``)."""
        return state


def on_latest_global(state, global_shared: StateDict, rounds_done: int):
    """A PM made of the latest global weights and the client's own parts (``state.personal``), for a method whose
    client keeps only those (``pm_job``); a client that never trained keeps its state, and its PM is the GM."""
    if state.personal is None:
        return state
    return dataclasses.replace(state, local_model=global_shared, rounds_trained=rounds_done)


def mean_state(states: Iterable[StateDict]) -> StateDict:
    """The plain (unweighted) mean of state dicts, key by key, folded in order in float64. ``states`` is read
    once, one at a time: a generator of states read from the client store holds one in memory, not all."""
    states = iter(states)
    first = next(states)
    out = {k: v.to(torch.float64).clone() for k, v in first.items()}
    count = 1
    for state in states:
        count += 1
        for k, v in state.items():
            out[k].add_(v.to(torch.float64))
    return {k: (v / count).to(first[k].dtype) for k, v in out.items()}
