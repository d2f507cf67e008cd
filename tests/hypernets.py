"""Checks that pFedHN's and PeFLL's tests (test_pfedhn.py, test_pefll.py) share: both methods keep their whole
server (a hypernetwork and what it is fed) in the method state, make each client's PM from it and have no
personal state on the clients."""

from __future__ import annotations

import math

import pytest
import torch
from test_federation import _same, make_federation
from test_personalization import untimed

from fedrod_ray.config import ConfigError, config_from_dict
from fedrod_ray.federation_state.checkpoint import load_checkpoint, save_checkpoint
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.personalization import mean_state


def assert_config_error_names(overrides: tuple[str, ...], field: str) -> None:
    """The config ``overrides`` give is refused with an error that starts with the dotted ``field``."""
    with pytest.raises(ConfigError) as e:
        config_from_dict({}, list(overrides))
    assert str(e.value).startswith(field), str(e.value)


def assert_pms_and_gm(fed, pms: list[dict]) -> None:
    """After one round of ``fed``: its global model is the mean of the clients' PMs ``pms``, and the
    evaluation's PM of a client (one that trained or not) is its own, with no personal state."""
    assert _same(fed.global_shared, mean_state(pms))
    for cid in (0, fed.setup.num_clients - 1):
        state = fed.evaluation._pm_state(fed.clients, cid, fed.global_shared, 1, fed.method_state)
        assert _same(state.local_model, pms[cid]) and state.rounds_trained == 1 and state.personal is None


def assert_trains_and_resumes_bitwise(overrides: tuple[str, ...], tmp_path, parts: set[str]) -> None:
    """Two rounds of a federation with ``overrides``, a checkpoint of it, whose method state holds every part
    (its keys' first components are ``parts``), and a federation restored from it that trains on to the bits of
    the uninterrupted one: global model, method state, every client's state and the records."""
    extra = (*overrides, "train.rounds=4")
    a = make_federation(*extra)
    before = dict(a.method_state)
    for r in (0, 1):
        record = a.step(r)
    assert record["clients_failed"] == 0 and math.isfinite(record["train_loss"]) and 0 <= record["pfl_pm"] <= 1
    assert all(not torch.equal(before[k], a.method_state[k]) for k in a.method_state)  # every part has moved
    storage = RunStorage(str(tmp_path))
    save_checkpoint(storage, a.snapshot())
    snap = load_checkpoint(storage)
    assert _same(snap.method_state, a.method_state)
    assert {k.split("/")[0] for k in snap.method_state} == parts
    b = make_federation(*extra)
    b.restore(snap)
    for r in (2, 3):
        assert untimed(a.step(r)) == untimed(b.step(r))
    assert _same(a.global_shared, b.global_shared) and _same(a.method_state, b.method_state)
    for cid, st in a.clients.items():
        assert st.rounds_trained == b.clients[cid].rounds_trained
        assert _same(st.tensors(), b.clients[cid].tensors()), cid
