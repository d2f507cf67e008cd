"""A training run's ``final/``: the served model (``export``'s format) from a federation's snapshot.

``export`` stays the serving side's module (it imports no training code); this one knows where a run's
metadata comes from (the setup's dataset and config) and which of the federation's state is served.
"""

from __future__ import annotations

import torch

from ..models import resolve_arch
from ..models.export import GENERIC_MODELS, ModelMeta, save_final
from ..objectives import model_parts
from ..outputs.metric_schema import EVALUATED
from ..outputs.storage import RunStorage
from ..personalization import METHODS, build_method, generic_weights
from ..server_math.aggregate import StateDict
from ..specs.methods import HEADS
from .dp_rounds import ClientLevelDP, shared_dim
from .setup import Setup
from .state import Snapshot


def model_meta(setup: Setup, rounds_done: int, metrics: dict[str, float], variant: str | None) -> ModelMeta:
    ds, cfg = setup.dataset, setup.cfg
    has_global = HEADS[cfg.train.head].global_model
    return ModelMeta(
        dataset=ds.name, class_names=ds.class_names, image_shape=list(ds.image_shape),
        mean=list(ds.mean), std=list(ds.std), arch=resolve_arch(cfg.model.arch, ds.image_shape),
        head=variant or "none", hyper_hidden=cfg.hyper_hidden, rule=cfg.train.generic_rule,
        balanced_loss=cfg.train.balanced_loss, round=rounds_done, metrics=metrics, method=cfg.train.head,
        generic_model=GENERIC_MODELS[0] if has_global else GENERIC_MODELS[1],
        new_client=METHODS[cfg.train.head].new_client_needs,
        privacy=private_guarantee(setup, rounds_done) if cfg.privacy.enabled else None,
    )


def private_guarantee(setup: Setup, rounds_done: int):
    """The guarantee of a private run after ``rounds_done`` rounds (the distributed mechanism's depends on the
    number of shared weights: the model is built to count them)."""
    dim = 0
    if setup.cfg.privacy.mechanism != "central":
        model = setup.build_model()
        dim = shared_dim({k: v for k, v in model.state_dict().items() if k in set(model.shared_keys())})
    return ClientLevelDP(setup.cfg, setup.num_clients, dim).guarantee(rounds_done)


def final_model(setup: Setup, snap: Snapshot,
                metrics: dict) -> tuple[ModelMeta, StateDict, dict[int, torch.Tensor] | None]:
    """What ``export.save_final`` writes: the metadata with the last evaluation's ``metrics``, the GM's
    weights (``personalization.generic_weights``: the global ones, or the mean of the clients' PMs) and
    (linear) every client's phi_m (zeros for a client that never trained: its PM is the GM; none at sites)."""
    model = setup.build_model()
    t = snap.config.train
    method = build_method(t.head, t.head_params)
    weights = generic_weights(method, model.personal_keys(), snap.global_shared, snap.clients,
                              model.state_dict(), setup.num_clients)
    heads = None
    if model.variant == "linear" and setup.at_sites:
        heads = {}  # each phi_m stays at its site (docs/sites.md): final/ serves no client's head
    elif model.variant == "linear":
        # phi_m has the generic head's shape (classes x features): both are bias-free heads on the features.
        shape = snap.global_shared["generic_head.weight"].shape
        heads = {cid: st.personal["personal_head.weight"] if st.personal else torch.zeros(shape)
                 for cid, st in sorted(snap.clients.items())}
    meta = model_meta(setup, snap.rounds_done, {k: v for k, v in metrics.items() if k in EVALUATED}, model.variant)
    # A local objective's model parts (Meta-BSM's Meta-Weight-Net) only train: the served model has none.
    parts = tuple(f"{name}." for name in model_parts(snap.config.train))
    served = set(model.shared_keys()) | set(model.kept)
    return meta, {k: v for k, v in weights.items() if k in served and not k.startswith(parts)}, heads


def write_final(storage: RunStorage, setup: Setup, snap: Snapshot, metrics: dict) -> str:
    """Write the run's ``final/`` from ``snap``; returns its version id."""
    return save_final(storage, *final_model(setup, snap, metrics))
