"""The Ray runtime against the in-process one: bitwise-equal training, actor sizing, failure handling
(a killed actor, a raising client, a lost node) and resume after a real SIGKILL.

Tests that use Ray in this process share the session's private local Ray (``ray_session`` in
conftest.py). Those that need a Ray of their own (the CLI's ``--mode ray``, a multi-node cluster) run it
in a subprocess with a private RAY_TMPDIR and check that none of its processes outlive it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from fedrod_ray.client_update.local import RoundInput
from fedrod_ray.clients import faults
from fedrod_ray.clients.client import ClientState
from fedrod_ray.config import config_from_dict, load_config
from fedrod_ray.drivers import ray_runtime
from fedrod_ray.drivers.runner import run_local
from fedrod_ray.executors.in_process import InProcessExecutor
from fedrod_ray.executors.ray import Layout, LostCall, RayExecutor, plan_layout
from fedrod_ray.executors.runtimes import RUNTIMES
from fedrod_ray.executors.shared_setup import DATASET_ARRAYS, PARTITION_ARRAYS, share
from fedrod_ray.federation_state.checkpoint import CheckpointWriter, load_checkpoint
from fedrod_ray.federation_state.setup import make_host, prepare
from fedrod_ray.federation_state.state import Snapshot
from fedrod_ray.lifecycle.coordinator import Coordinator
from fedrod_ray.lifecycle.run import RunLostError
from fedrod_ray.outputs.storage import RunStorage
from fedrod_ray.round_loop.federation import Federation, RoundFailedError
from fedrod_ray.server_math.privacy import clip_update, update_norm
from fedrod_ray.server_math.server import sample_clients

REPO = Path(__file__).resolve().parents[1]
TIME_FIELDS = ("seconds", "train_seconds")


def tiny_config(*overrides: str):
    """A few-second federation on generated data: 6 training clients (3 per round) and 1 new client."""
    base = {
        "name": "ray_runtime_test",
        "seed": 7,  # every round's first sampled client is its smallest: see the bitwise test
        "data": {"dataset": "synthetic", "num_clients": 6, "new_clients": 1, "alpha": 0.3,
                 "synthetic_train_per_class": 40, "synthetic_test_per_class": 20},
        "train": {"rounds": 3, "client_fraction": 0.5, "local_epochs": 1, "batch_size": 20},
        "eval": {"batch_size": 500},
        "runtime": {"torch_threads": 1},
    }
    return config_from_dict(base, list(overrides))


def ray_executor(ray, setup, log=lambda s: None) -> RayExecutor:
    layout = plan_layout(setup.cfg.runtime, len(setup.all_client_ids), ray.cluster_resources())
    return RayExecutor(setup, layout, log)


def run_rounds(fed: Federation, storage: RunStorage | None = None) -> list[dict]:
    """The remaining rounds, with a checkpoint after each when ``storage`` is given."""
    records = []
    writer = CheckpointWriter(storage) if storage is not None else None
    for r in range(fed.next_round, fed.cfg.train.rounds):
        records.append(fed.step(r))
        if writer is not None:
            writer.save(fed.snapshot())
    return records


def without_time(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIME_FIELDS} for r in records]


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(a) == sorted(b), what
    for k, va in a.items():
        assert va.dtype == b[k].dtype and torch.equal(va, b[k]), f"{what}: {k} differs"


def assert_same_states(a: dict[int, ClientState], b: dict[int, ClientState]) -> None:
    assert sorted(a) == sorted(b)
    for cid, sa in a.items():
        assert sa.rounds_trained == b[cid].rounds_trained, f"client {cid}"
        assert_same_tensors(sa.tensors(), b[cid].tensors(), f"client {cid} state")


# --- 1. the Ray runtime trains exactly what the in-process runtime trains -----------------------------

VARIANTS = {
    "linear": (),
    # Fine-tuning at the last evaluation runs on the actors too: new clients from the zero-shot head ...
    "hyper": ("train.head=hyper", "eval.finetune_epochs=1"),
    # ... and every client (the FT baseline).
    "fedavg_feddyn": ("train.head=none", "train.balanced_loss=ce", "train.generic_rule=feddyn",
                      "eval.finetune_epochs=1", "eval.finetune_train=true"),
    "hyper_scaffold": ("train.head=hyper", "train.generic_rule=scaffold"),
    # One actor per client: fewer clients, since every actor is a process of its own.
    "linear_small": ("data.num_clients=3", "train.client_fraction=1.0"),
    # The compiled step (every actor compiles its own; batch 10 as in tests/test_step.py, whose graph the
    # on-disk inductor cache then holds for whichever test compiles second).
    "linear_compiled": ("train.step=compiled", "train.batch_size=10"),
    # Every client's momentum buffers travel with its state to whichever actor trains it next.
    "linear_keep": ("train.momentum_buffers=keep",),
    # Personalized-FL baselines: per-client messages and the method's server state (FedFOMO), a personal
    # model beside the upload (Ditto), a PM made from the global model on the actors (Per-FedAvg).
    "fedfomo": ("train.head=fedfomo", "train.balanced_loss=ce"),
    "ditto_small": ("train.head=ditto", "train.balanced_loss=ce", "data.num_clients=3", "train.client_fraction=1.0"),
    "perfedavg": ("train.head=perfedavg", "train.balanced_loss=ce", "train.momentum=0", "train.weight_decay=0"),
    # FedBABU: the body trained under a frozen head, the PM fine-tuned from the GM on the actors, and the new
    # client's fine-tuning.
    "fedbabu": ("train.head=fedbabu", "train.balanced_loss=ce", "train.head_params={finetune_epochs: 1}",
                "eval.finetune_epochs=1"),
    # A server that generates each client's model from its hypernetwork and steps it on each client's Delta;
    # its new client's zero-shot model and adaptation (an embedding fitted with phi frozen) on the actors.
    "pfedhn": ("train.head=pfedhn", "train.balanced_loss=ce", "eval.finetune_epochs=1"),
    # ... and one that asks its clients questions within the round (their descriptors, their part of the
    # backward pass), on the actors.
    "pefll": ("train.head=pefll", "train.balanced_loss=ce", "eval.finetune_epochs=1"),
    # Methods whose model carries a readout of their own (GPFL's embeddings and CoV, FedCP's CPN): averaged,
    # kept and read on the actors; FedCP's Gumbel noise seeded there, in training and at evaluation.
    "gpfl": ("train.head=gpfl", "train.balanced_loss=ce", "eval.finetune_epochs=1"),
    "fedcp": ("train.head=fedcp", "train.balanced_loss=ce", "eval.finetune_epochs=1"),
    # FedALA: each client starts from its own last model blended with the global one (weights learned on the
    # actor), its PM that blend made there at evaluation. FedDBE: the initial period asked of every client on
    # the actors, a personal feature bias kept, the new client's fine-tuning with the client loss.
    "fedala": ("train.head=fedala", "train.balanced_loss=ce", "eval.finetune_epochs=1"),
    "feddbe": ("train.head=feddbe", "train.balanced_loss=ce", "train.head_params={kl_weight: 1}",
               "eval.finetune_epochs=1"),
}
_baselines: dict[str, tuple] = {}


def in_process_baseline(variant: str, tmp_root: Path):
    """The in-process run of a variant (computed once per test session)."""
    if variant not in _baselines:
        setup = prepare(tiny_config(*VARIANTS[variant]))
        fed = Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)
        records = run_rounds(fed)
        _baselines[variant] = (fed.global_shared, fed.server_state, records, fed.clients, fed.method_state)
    return _baselines[variant]


ONE_ACTOR_PER_CLIENT = ("runtime.clients_per_actor=1", "runtime.client_resources={num_cpus: 0.25}")


@pytest.mark.parametrize(
    "variant, layout_overrides",
    [("linear", ()), ("linear_small", ONE_ACTOR_PER_CLIENT), ("hyper", ()), ("fedavg_feddyn", ()),
     ("hyper_scaffold", ()), ("linear_compiled", ()), ("linear_keep", ()), ("fedfomo", ()),
     ("ditto_small", ONE_ACTOR_PER_CLIENT), ("perfedavg", ()), ("hyper", ("runtime.client_cache=1",)),
     ("fedbabu", ()), ("pfedhn", ()), ("pefll", ()), ("gpfl", ()), ("fedcp", ()),
     ("fedala", ()), ("feddbe", ())],
    ids=["linear", "linear-one_actor_per_client", "hyper", "fedavg_feddyn", "hyper_scaffold", "linear-compiled",
         "linear-keep", "fedfomo", "ditto-one_actor_per_client", "perfedavg", "hyper-client_cache_1", "fedbabu",
         "pfedhn", "pefll", "gpfl", "fedcp", "fedala", "feddbe"],
)
def test_ray_executor_is_bitwise_equal_to_in_process(ray_session, one_torch_thread, tmp_path_factory,
                                                     variant, layout_overrides):
    ray = ray_session
    tmp = tmp_path_factory.mktemp("bitwise")
    g_ref, h_ref, records_ref, states_ref, m_ref = in_process_baseline(variant, tmp_path_factory.getbasetemp())

    setup = prepare(tiny_config(*VARIANTS[variant], *layout_overrides))
    storage = RunStorage(str(tmp / "ray"))
    executor = ray_executor(ray, setup)
    arrivals: list[list[int]] = []
    train = executor.train

    def recording_train(round_idx, jobs, message):
        arrivals.append([])
        for slot, out in train(round_idx, jobs, message):
            arrivals[-1].append(slot)
            yield slot, out

    executor.train = recording_train
    try:
        n = len(setup.all_client_ids)
        if layout_overrides == ONE_ACTOR_PER_CLIENT:
            assert executor.layout.num_actors == n == len(executor.actors) == 4
            assert executor.layout.clients_per_actor == 1 and executor.layout.max_in_flight == 2
        else:
            assert executor.layout.pooled and len(executor.actors) == executor.layout.max_in_flight == 2
        fed = Federation(setup, executor, log=lambda s: None)
        records = run_rounds(fed, storage)
        states = fed.clients
    finally:
        executor.close()

    # Results arrived out of the sampled order, which the ordered average must not see: where the first
    # sampled client is the smallest, largest-first dispatch starts it last, so it cannot arrive first.
    sizes = setup.partition.sizes
    for r, order in enumerate(arrivals):
        ids = sample_clients(setup.cfg.seed, r, setup.num_clients, setup.cfg.train.client_fraction)
        assert sizes[ids[0]] < min(sizes[c] for c in ids[1:]) and len(ids) > executor.layout.max_in_flight
        assert sorted(order) == list(range(len(ids))) and order[0] != 0, (r, order)
    assert_same_tensors(g_ref, fed.global_shared, "global_shared")
    assert_same_tensors(h_ref, fed.server_state, "the rule's server state")
    assert bool(h_ref) == (variant in ("fedavg_feddyn", "hyper_scaffold"))
    assert_same_tensors(m_ref, fed.method_state, "the method's server state")
    assert bool(m_ref) == (variant in ("fedfomo", "pfedhn", "pefll", "feddbe"))  # FedDBE: its consensus mean
    assert_same_states(states_ref, states)
    assert len(records) == 3
    # As JSON: a reading the method has not is NaN in both, which == would call different.
    assert json.dumps(without_time(records)) == json.dumps(without_time(records_ref))
    for rec in records:
        assert {"gfl_gm", "pfl_gm", "pfl_pm", "pfl_pm_global", "pfl_gm_new", "pfl_new_before"} <= set(rec)
        assert rec["clients_failed"] == 0
    assert ("pfl_new_after" in records[-1]) == (variant in ("hyper", "fedavg_feddyn", "fedbabu", "pfedhn", "pefll",
                                                            "gpfl", "fedcp", "fedala", "feddbe"))
    assert ("pfl_ft" in records[-1]) == (variant == "fedavg_feddyn")
    assert any(st.momentum for st in states.values()) == (variant == "linear_keep")
    if variant == "linear_keep":  # and some client continued its buffers on an actor
        assert any(st.rounds_trained > 1 for st in states.values())
    # The checkpoint of the Ray run's snapshot holds the same weights and states.
    ckpt = load_checkpoint(storage)
    assert ckpt.rounds_done == 3
    assert_same_tensors(g_ref, ckpt.global_shared, "checkpointed global_shared")
    assert_same_tensors(h_ref, ckpt.server_state, "checkpointed server state")
    assert_same_tensors(m_ref, ckpt.method_state, "checkpointed method state")
    assert_same_states(states_ref, ckpt.clients)


@pytest.mark.parametrize("variant", ["pfedhn", "pefll"])
def test_a_server_model_method_resumed_on_ray_trains_on_to_the_in_process_bits(ray_session, one_torch_thread,
                                                                              tmp_path_factory, variant):
    """A method whose server holds a model of its own (pFedHN's hypernetwork, embeddings and their momentum;
    PeFLL's two networks, Adam's state and the descriptors, which it asks the actors for): checkpointed in
    process after two rounds and resumed on Ray actors, its last round is the uninterrupted in-process run's,
    bitwise: records, global weights, the method's server state, every client."""
    g_ref, _, records_ref, states_ref, m_ref = in_process_baseline(variant, tmp_path_factory.getbasetemp())
    storage = RunStorage(str(tmp_path_factory.mktemp("resume_on_ray")))
    setup = prepare(tiny_config(*VARIANTS[variant]))
    first = Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)
    run_rounds_until(first, 2)
    CheckpointWriter(storage).save(first.snapshot())
    setup = prepare(tiny_config(*VARIANTS[variant]))
    executor = ray_executor(ray_session, setup)
    try:
        fed = Federation(setup, executor, log=lambda s: None)
        fed.restore(load_checkpoint(storage))
        records = run_rounds(fed)
    finally:
        executor.close()
    assert json.dumps(without_time(records)) == json.dumps(without_time(records_ref[2:]))
    assert_same_tensors(g_ref, fed.global_shared, "global_shared")
    assert_same_tensors(m_ref, fed.method_state, "the method's server state")
    assert_same_states(states_ref, fed.clients)


def run_rounds_until(fed: Federation, rounds: int) -> None:
    for r in range(rounds):
        fed.step(r)


def test_ray_executor_makes_new_clients_zero_shot_models_as_in_process(ray_session, one_torch_thread):
    """The new-client hook's executor call (``zero_shot``): on the actors, each client's zero-shot model from
    the message and its data (hyper: the global weights, H(a; nu) from its class counts) scores as here."""
    setup = prepare(tiny_config("train.head=hyper", "data.new_clients=3"))
    host = make_host(setup)
    new = setup.all_client_ids[setup.num_clients:]
    jobs = [(cid, ClientState()) for cid in new]
    message = RoundInput({k: host.initial[k] for k in host.model.shared_keys()})
    here = host.zero_shot(jobs, message, 0)
    executor = ray_executor(ray_session, setup)
    try:
        there = executor.zero_shot(jobs, message, 0)
    finally:
        executor.close()
    assert not here.failed and not there.failed and sorted(there.correct) == new
    for cid in new:
        assert torch.equal(here.correct[cid], there.correct[cid]) and torch.equal(here.total[cid], there.total[cid])


def test_private_updates_leave_their_actor_clipped_and_train_as_in_process(ray_session, one_torch_thread):
    """Client-level DP on Ray: every update that reaches the server is the clip of the client's update, done in
    its actor (the same client trained here without clipping goes past the norm), the client keeps that
    clipped model, and the run (Poisson sampling, seeded noise) is the in-process one, bitwise."""
    clip = 0.05
    overrides = ("privacy.enabled=true", "privacy.noise_multiplier=1.0", f"privacy.clip_norm={clip}",
                 "privacy.noise_seed=0", "train.rounds=2", "eval.eval_every=2")
    setup = prepare(tiny_config(*overrides))
    executor = ray_executor(ray_session, setup)
    arrived = []
    train = executor.train

    def recording_train(round_idx, jobs, message):
        for slot, out in train(round_idx, jobs, message):
            arrived.append((round_idx, jobs[slot], message, out))
            yield slot, out

    executor.train = recording_train
    try:
        fed = Federation(setup, executor, log=lambda s: None)
        records = run_rounds(fed)
    finally:
        executor.close()

    host = make_host(prepare(tiny_config(*overrides)))
    assert arrived
    for r, (cid, state), message, (result, new_state) in arrived:
        assert message.clip_norm == clip
        own = host.train(cid, state, dataclasses.replace(message, clip_norm=None), r)[0].shared
        assert update_norm(own, message.weights) > clip  # clipping had work to do
        assert result.clipped and update_norm(result.shared, message.weights) <= clip
        assert_same_tensors(clip_update(own, message.weights, clip)[0], result.shared, f"client {cid}'s upload")
        assert_same_tensors(result.shared, new_state.local_model, f"client {cid}'s local model")
    reference = Federation(prepare(tiny_config(*overrides)), InProcessExecutor(host), log=lambda s: None)
    assert json.dumps(without_time(run_rounds(reference))) == json.dumps(without_time(records))
    assert_same_tensors(reference.global_shared, fed.global_shared, "global_shared")


# --- 2. sizing the actor pool from the cluster ----------------------------------------------------


def runtime(*overrides: str):
    return tiny_config(*overrides).runtime


def test_plan_layout_default_one_pooled_actor_per_core():
    layout = plan_layout(runtime(), 100, {"CPU": 2.0})
    assert layout == Layout(num_actors=2, clients_per_actor=0, max_in_flight=2, actor_resources={"num_cpus": 1.0})
    assert layout.pooled


def test_plan_layout_pinned_blocks():
    layout = plan_layout(runtime("runtime.clients_per_actor=25"), 100, {"CPU": 2.0})
    # Four actors share the two cores (half a CPU each in Ray's books); two train at once.
    assert layout == Layout(num_actors=4, clients_per_actor=25, max_in_flight=2, actor_resources={"num_cpus": 0.5})
    assert [len(b) for b in layout.assignment(list(range(100)))] == [25, 25, 25, 25]
    assert layout.assignment(list(range(100)))[1][0] == 25


def test_plan_layout_one_client_per_actor():
    layout = plan_layout(runtime("runtime.clients_per_actor=1"), 100, {"CPU": 2.0})
    assert layout == Layout(num_actors=100, clients_per_actor=1, max_in_flight=2,
                            actor_resources={"num_cpus": 0.02})


def test_plan_layout_counts_a_cpu_fraction_as_a_whole_core():
    layout = plan_layout(runtime("runtime.client_resources={num_cpus: 0.25}"), 100, {"CPU": 2.0})
    assert layout.max_in_flight == 2 and layout.num_actors == 2
    assert layout.actor_resources == {"num_cpus": 0.25}


def test_plan_layout_gpu_share_is_the_unit():
    rt = runtime("runtime.client_resources={num_cpus: 1, num_gpus: 0.25}")
    layout = plan_layout(rt, 100, {"CPU": 16.0, "GPU": 1.0})
    assert layout == Layout(num_actors=4, clients_per_actor=0, max_in_flight=4,
                            actor_resources={"num_cpus": 1.0, "num_gpus": 0.25})


def test_plan_layout_custom_resource_limits_slots():
    rt = runtime("runtime.client_resources={num_cpus: 0.5, client_slot: 1}", "runtime.clients_per_actor=2")
    layout = plan_layout(rt, 7, {"CPU": 8.0, "client_slot": 3.0})
    assert layout == Layout(num_actors=4, clients_per_actor=2, max_in_flight=3,
                            actor_resources={"num_cpus": 0.375, "client_slot": 0.75})
    assert [len(b) for b in layout.assignment(list(range(7)))] == [2, 2, 2, 1]


def test_plan_layout_fewer_clients_than_slots():
    layout = plan_layout(runtime(), 3, {"CPU": 16.0})
    assert layout == Layout(num_actors=3, clients_per_actor=0, max_in_flight=3, actor_resources={"num_cpus": 1.0})


@pytest.mark.parametrize("resources, cluster", [
    ("{num_cpus: 4}", {"CPU": 2.0}),
    ("{num_cpus: 1, num_gpus: 1}", {"CPU": 16.0}),
    ("{num_cpus: 1, client_slot: 1}", {"CPU": 16.0}),
])
def test_plan_layout_rejects_what_the_cluster_cannot_fit(resources, cluster):
    with pytest.raises(RuntimeError, match="cannot fit one client"):
        plan_layout(runtime(f"runtime.client_resources={resources}"), 10, cluster)


# --- 3. an actor killed in the middle of a call -------------------------------------------------------
# The call is made to hang by the fault hook (fedrod_ray.clients.faults), so the kill lands while exactly that
# call runs; the executor's ``lost_calls`` then says which call died with its actor.


def arm_fault(monkeypatch, marker: Path, call: str, client: int, round_idx: int | None = None) -> None:
    """Make ``call`` of ``client`` (train: in round ``round_idx``, 0-based) hang on whichever actor runs it,
    in the actors of the executors started from now on."""
    spec = {"call": call, "client": client, "marker": str(marker)}
    if round_idx is not None:
        spec["round_idx"] = round_idx
    monkeypatch.setenv(faults.ENV, json.dumps(spec))


class Background:
    """``fn`` running in a thread; ``result`` fails (instead of hanging the suite) if it does not end in time."""

    def __init__(self, fn):
        self.out: dict = {}

        def target():
            try:
                self.out["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller
                self.out["error"] = e

        self.thread = threading.Thread(target=target, daemon=True)
        self.thread.start()

    def result(self, seconds: float):
        self.thread.join(seconds)
        assert not self.thread.is_alive(), f"still running after {seconds}s"
        if "error" in self.out:
            raise self.out["error"]
        return self.out["value"]


def run_with_timeout(fn, seconds: float):
    return Background(fn).result(seconds)


def kill_the_hung_actor(ray, executor: RayExecutor, fed: Federation, round_idx: int,
                        marker: Path) -> tuple[Background, int, dict]:
    """Run round ``round_idx`` in the background, wait for the armed call to reach the fault (its marker),
    then kill the actor it hangs on, which Ray restarts; (the running round, that actor's index, the
    marker: the call, its clients, its round and the actor's pid)."""
    pids = actor_pids(ray, executor)
    running = Background(lambda: fed.step(round_idx))
    deadline = time.monotonic() + 120
    while not marker.exists():
        if not running.thread.is_alive():
            running.result(0)
            pytest.fail("the federation went on without ever making the armed call")
        assert time.monotonic() < deadline, "the armed call was not made within 120 s"
        time.sleep(0.02)
    hit = json.loads(marker.read_text())
    assert hit["pid"] in pids, (hit, pids)
    # The call hangs until killed: the caller is still waiting on it, whatever the timing.
    assert running.thread.is_alive()
    a = pids[hit["pid"]]
    ray.kill(executor.actors[a], no_restart=False)
    return running, a, hit


def actor_pids(ray, executor: RayExecutor) -> dict[int, int]:
    """pid -> actor index. Asked between rounds: an actor answers one call at a time."""
    return {ray.get(actor.ready.remote())["pid"]: a for a, actor in enumerate(executor.actors)}


def started_last(setup, round_idx: int) -> int:
    """The client of round ``round_idx`` that largest-first dispatch starts last: its smallest (of equals,
    the last sampled)."""
    ids = sample_clients(setup.cfg.seed, round_idx, setup.num_clients, setup.cfg.train.client_fraction)
    return min(reversed(ids), key=lambda c: setup.partition.sizes[c])


KILL_CASES = {
    # Pooled: 2 actors take 8 clients a round; the victim is the smallest, started last, so its actor has
    # finished clients of this round before it.
    "pooled": ("data.num_clients=8", "train.client_fraction=1.0"),
    # One actor per client: the victim's client finished in the rounds before; no checkpoint is ever
    # written, so its state can only come from the coordinator's committed copy.
    "one_actor_per_client": ("data.num_clients=4", "train.client_fraction=1.0", *ONE_ACTOR_PER_CLIENT),
    # A personalized-FL baseline whose clients keep whole models and receive each other's: the lost client
    # keeps its model, the others train on what they would have received without the fault.
    "pooled_fedfomo": ("data.num_clients=8", "train.client_fraction=1.0", "train.head=fedfomo",
                       "train.balanced_loss=ce"),
}


@pytest.mark.parametrize("layout", list(KILL_CASES))
def test_actor_killed_mid_round_loses_only_its_call_in_flight(ray_session, one_torch_thread, layout, tmp_path,
                                                              monkeypatch):
    """An actor killed while it trains a given client: that call, and no other, is lost; after that round
    every client but that one has bitwise the state of a run without the fault, and the run goes on."""
    ray = ray_session
    overrides = ("data.new_clients=0", "train.rounds=4", "runtime.min_clients_per_round=1",
                 "runtime.max_failed_fraction=0.9", "runtime.checkpoint_every=100", *KILL_CASES[layout])
    setup = prepare(tiny_config(*overrides))
    # The run without the fault: every client's state after rounds 2 and 3 (states are replaced, never
    # written into, so a shallow copy keeps them).
    ref = Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None)
    ref_states = []
    for r in range(3):
        ref.step(r)
        ref_states.append(dict(ref.clients))

    victim, marker = started_last(setup, 2), tmp_path / "fault"
    arm_fault(monkeypatch, marker, "train", victim, round_idx=2)
    logs: list[str] = []
    executor = ray_executor(ray, setup, log=logs.append)
    try:
        fed = Federation(setup, executor, log=logs.append)
        for r in range(2):
            fed.step(r)
        assert not marker.exists() and executor.lost_calls == []
        before = list(executor.calls_done)
        running, a, hit = kill_the_hung_actor(ray, executor, fed, 2, marker)
        done_before_kill = executor.calls_done[a] - before[a]
        rec = running.result(180)

        assert hit == {"call": "train", "clients": [victim], "round_idx": 2, "pid": hit["pid"]}
        if executor.layout.pooled:
            assert done_before_kill >= 1, "the victim's actor had trained no other client of this round"
        # Exactly the hung call was lost, and not sent again; every other client of the round trained.
        assert executor.lost_calls == [LostCall("train", a, (victim,), retried=False)]
        assert f"actor {a} died during train of client(s) {victim}; not sent again" in logs
        assert rec["failed_ids"] == [victim] and rec["clients_failed"] == 1
        assert rec["clients_done"] == rec["clients"] - 1
        assert any(f"client {victim} failed" in line and "actor died" in line for line in logs), logs
        for cid, state in fed.clients.items():
            # The lost client keeps what it had committed before the round; everyone else is untouched.
            expected = (ref_states[1] if cid == victim else ref_states[2])[cid]
            assert state.rounds_trained == expected.rounds_trained, cid
            assert_same_tensors(state.tensors(), expected.tensors(), f"client {cid}")

        # The actor came back (a new process), attached again, and the run goes on to the end; the fault
        # fired once, so nothing else is lost.
        info = ray.get(executor.actors[a].ready.remote())
        assert info["attached"] and info["pid"] != hit["pid"]
        last = run_with_timeout(lambda: fed.step(3), 180)
        assert last["clients_failed"] == 0 and last["clients_done"] == last["clients"]
        assert len(executor.lost_calls) == 1
        assert victim in sample_clients(setup.cfg.seed, 3, setup.num_clients, 1.0)
        assert fed.clients[victim].rounds_trained == ref_states[1][victim].rounds_trained + 1
        assert all(torch.isfinite(v).all() for v in fed.global_shared.values())
    finally:
        executor.close()


def test_an_actor_dying_during_evaluation_changes_no_metric(ray_session, one_torch_thread, tmp_path, monkeypatch):
    """Evaluation calls are safe to repeat: the chunk whose actor died is evaluated again once the actor is
    back, and the record is bitwise the one of a run without the fault."""
    ray = ray_session
    setup = prepare(tiny_config("data.num_clients=8", "train.client_fraction=1.0", "train.rounds=1"))
    ref = Federation(setup, InProcessExecutor(make_host(setup)), log=lambda s: None).step(0)
    victim, marker = 3, tmp_path / "fault"
    arm_fault(monkeypatch, marker, "evaluate", victim)
    logs: list[str] = []
    executor = ray_executor(ray, setup, log=logs.append)
    try:
        fed = Federation(setup, executor, log=logs.append)
        running, a, hit = kill_the_hung_actor(ray, executor, fed, 0, marker)
        rec = running.result(180)

        chunk = tuple(hit["clients"])
        assert hit["call"] == "evaluate" and victim in chunk
        # 8 clients over 2 actors: 4 chunks of 2. Exactly the hung chunk was lost and sent again.
        assert len(chunk) == 2
        assert executor.lost_calls == [LostCall("evaluate", a, chunk, retried=True)]
        assert f"actor {a} died during evaluate of client(s) {', '.join(map(str, chunk))}; sent again" in logs
        # 8 training calls and 4 evaluation calls completed: the lost chunk once, when it was sent again.
        assert sum(executor.calls_done) == 8 + 4
        assert rec["clients_failed"] == 0 and rec["pm_eval_failed"] == 0
        assert without_time([rec]) == without_time([ref])
        assert ray.get(executor.actors[a].ready.remote())["pid"] != hit["pid"]
    finally:
        executor.close()


def test_an_actor_out_of_restarts_is_given_up_and_the_rest_carry_on(ray_session, one_torch_thread, tmp_path,
                                                                    monkeypatch):
    ray = ray_session
    setup = prepare(tiny_config("data.num_clients=8", "data.new_clients=0", "train.client_fraction=1.0",
                                "train.rounds=2", "runtime.mode=ray", "runtime.max_restarts=0",
                                "runtime.max_failed_fraction=0.5"))
    victim, marker = 0, tmp_path / "fault"
    arm_fault(monkeypatch, marker, "train", victim, round_idx=0)
    logs: list[str] = []
    executor = ray_executor(ray, setup, log=logs.append)
    try:
        fed = Federation(setup, executor, log=logs.append)
        running, a, _ = kill_the_hung_actor(ray, executor, fed, 0, marker)
        # Given up at once, not after waiting for a restart that cannot come (the restart timeout is 120 s):
        # timed from the kill to the executor's verdict, apart from the round's remaining training.
        killed_at = time.monotonic()
        while not executor.dead and time.monotonic() - killed_at < 120:
            time.sleep(0.02)
        assert executor.dead == {a} and time.monotonic() - killed_at < 20
        rec = running.result(180)
        # Only its call in flight was lost.
        assert executor.lost_calls == [LostCall("train", a, (victim,), retried=False)]
        assert rec["failed_ids"] == [victim] and rec["clients_done"] == 7 and rec["pm_eval_failed"] == 0
        assert any("ActorDiedError (actor died)" in line for line in logs), logs
        # The next round runs every client on the actor that is left.
        calls = list(executor.calls_done)
        rec2 = run_with_timeout(lambda: fed.step(1), 180)
        assert rec2["clients_failed"] == 0 and rec2["clients_done"] == 8
        other = 1 - a
        assert executor.calls_done[a] == calls[a] and executor.calls_done[other] > calls[other] + 8
    finally:
        executor.close()


# --- 4. a client whose training raises ---------------------------------------------------------------


def nan_head(setup) -> ClientState:
    """A stored P-head of the right shape full of NaN: local training stops with a non-finite loss."""
    shape = setup.build_model().state_dict()["personal_head.weight"].shape
    return ClientState(personal={"personal_head.weight": torch.full(shape, float("nan"))})


def test_raising_client_is_reported_not_fatal(ray_session, tmp_path):
    ray = ray_session
    cfg = tiny_config("data.new_clients=0")
    setup = prepare(cfg)
    executor = ray_executor(ray, setup)
    logs: list[str] = []
    try:
        ids = sample_clients(cfg.seed, 0, setup.num_clients, cfg.train.client_fraction)
        cid = ids[1]
        fed = Federation(setup, executor, log=logs.append)
        fed.clients[cid] = nan_head(setup)
        rec = run_with_timeout(lambda: fed.step(0), 120)
        assert rec["clients_failed"] == 1 and rec["failed_ids"] == [cid]
        assert rec["clients_done"] == 2
        # Its hand-made state has a head but no local model: its PM cannot be evaluated, and says so.
        assert {"gfl_gm", "pfl_gm", "pfl_pm"} <= set(rec) and rec["pm_eval_failed"] == 1
        assert any(f"client {cid}: personalized model not evaluated: ValueError" in line for line in logs)
        failure_lines = [line for line in logs if " failed: " in line]
        assert len(failure_lines) == 1
        msg = failure_lines[0]
        assert f"client {cid} failed: LocalTrainingError" in msg
        assert "Traceback (most recent call last)" in msg and "local_update" in msg
        assert all(torch.isfinite(v).all() for v in fed.global_shared.values())
        # The failed update left the client's state as it was.
        assert torch.isnan(fed.clients[cid].personal["personal_head.weight"]).all()

        # The same failure with no tolerance stops the round and names the client and the limit.
        strict = dataclasses.replace(setup, cfg=tiny_config("data.new_clients=0", "runtime.max_failed_fraction=0"))
        fed2 = Federation(strict, executor, log=lambda s: None)
        fed2.clients[cid] = nan_head(setup)
        with pytest.raises(RoundFailedError) as err:
            run_with_timeout(lambda: fed2.step(0), 120)
        text = str(err.value)
        assert f"clients {cid}" in text and "runtime.max_failed_fraction=0.0" in text
        assert "LocalTrainingError" in text
        assert fed2.next_round == 0

        # A stored state of the wrong shape: its training fails, and so does its PM's evaluation (on the
        # actor), which is reported and left out of P-FL (PM) instead of breaking the round.
        fed.clients[cid] = ClientState()
        ids1 = sample_clients(cfg.seed, 1, setup.num_clients, cfg.train.client_fraction)
        bad = next(c for c in ids1 if c != cid)
        fed.clients[bad] = ClientState(personal={"personal_head.weight": torch.zeros(1, 1)})
        logs.clear()
        rec1 = run_with_timeout(lambda: fed.step(1), 120)
        assert rec1["failed_ids"] == [bad] and rec1["clients_done"] == 2
        assert rec1["pm_eval_failed"] == 1 and 0.0 <= rec1["pfl_pm"] <= 1.0
        assert any(f"client {bad} failed: ValueError: personal_head.weight: shape (1, 1)" in line for line in logs)
        assert any(f"client {bad}: personalized model not evaluated" in line for line in logs), logs
    finally:
        executor.close()


# --- 5. resume after a real SIGKILL equals the uninterrupted run ---------------------------------------

CLI = [sys.executable, "-m", "fedrod_ray.cli", "train"]
# SCAFFOLD: server and per-client rule state, besides phi_m and the local models, must all resume exactly.
RESUME_SETS = ["--set", "train.rounds=4", "--set", "train.local_epochs=2", "--set", "runtime.torch_threads=1",
               "--set", "train.generic_rule=scaffold"]


def train_cmd(run_dir: Path, *extra: str) -> list[str]:
    return [*CLI, "--config", "configs/synthetic_tiny.yaml", "--run-dir", str(run_dir), *RESUME_SETS, *extra]


def run_cli(cmd: list[str], env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def uninterrupted_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("resume") / "A"
    run_cli(train_cmd(run_dir))
    return run_dir


def kill_after_two_rounds(cmd: list[str], run_dir: Path, env: dict | None = None) -> None:
    """Start a training run and SIGKILL it as soon as its round-2 checkpoint is published."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 180
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if latest.is_file() and latest.read_text().strip() >= "round_000002":
                break
            time.sleep(0.02)
        assert proc.poll() is None, f"the run ended before it could be killed:\n{proc.communicate()[0]}"
        assert time.monotonic() < deadline, "no round-2 checkpoint within 180 s"
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "final").exists()
    assert latest.read_text().strip() in ("round_000002", "round_000003")


def assert_same_run(a: Path, b: Path, restarted: dict[int, int] | None = None) -> None:
    """Same final model, every client's persisted state, the rule's server state and the metrics; ``b``'s
    records of the rounds in ``restarted`` say that a restarted coordinator trained them again (round ->
    restart), and no others do."""
    for rel in ("final/model.safetensors", "final/personal.safetensors", "checkpoints/round_000004/global.safetensors"):
        assert_same_tensors(load_file(a / rel), load_file(b / rel), rel)
    clients = load_checkpoint(RunStorage(str(b))).clients
    assert_same_states(load_checkpoint(RunStorage(str(a))).clients, clients)
    assert any(st.rule_state for st in clients.values()) and any(st.personal for st in clients.values())
    ra = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rb] == [1, 2, 3, 4]
    assert {r["round"]: r.pop("coordinator_restart") for r in rb if "coordinator_restart" in r} == (restarted or {})
    assert without_time(ra) == without_time(rb)
    assert json.loads((a / "final" / "meta.json").read_text()) == json.loads((b / "final" / "meta.json").read_text())


def assert_resumed_after_latest(stdout: str, run_dir: Path, latest: str) -> None:
    """The resumed run started after the round its last checkpoint holds, and ran (and printed) no round
    up to it again: a resume that silently restarted from round 0 would train to the same bits."""
    done = int(latest[len("round_"):])
    assert f"resuming {run_dir} after round {done}\n" in stdout, stdout
    rounds = [int(m) for m in re.findall(r"^\[round\s+(\d+)/\d+\]", stdout, re.MULTILINE)]
    assert rounds and min(rounds) == done + 1, (done, rounds)


@pytest.mark.slow
def test_resume_after_sigkill_equals_uninterrupted_run(uninterrupted_run, tmp_path):
    b = tmp_path / "B"
    kill_after_two_rounds(train_cmd(b), b)
    latest = (b / "checkpoints" / "latest").read_text().strip()
    proc = run_cli([*CLI, "--resume", str(b), "--set", "runtime.torch_threads=1"])
    assert_resumed_after_latest(proc.stdout, b, latest)
    assert_same_run(uninterrupted_run, b)


@pytest.mark.slow
def test_ray_resume_after_sigkill_equals_uninterrupted_run(uninterrupted_run, tmp_path, private_ray_env):
    """The same on Ray (its own local instance), compared with the in-process run: same bits. Resumed with
    two client states in memory: the coordinator reads the others from the checkpoint's files."""
    b = tmp_path / "B"
    ray_args = ("--mode", "ray", "--set", "runtime.address=local")
    kill_after_two_rounds(train_cmd(b, *ray_args), b, env=private_ray_env)
    private_ray_env.reap_after_killed_driver()
    latest = (b / "checkpoints" / "latest").read_text().strip()
    proc = run_cli([*CLI, "--resume", str(b), "--set", "runtime.torch_threads=1", "--set", "runtime.client_cache=2"],
                   env=private_ray_env)
    assert re.search(r"ray: \d+ client actor\(s\)", proc.stdout), proc.stdout
    assert_resumed_after_latest(proc.stdout, b, latest)
    assert_same_run(uninterrupted_run, b)


@pytest.mark.slow
def test_ray_sigterm_stops_the_run_like_ctrl_c(tmp_path, private_ray_env):
    """SIGTERM to a Ray run's driver: one line naming --resume, exit 143, and its private Ray shut down (the
    fixture fails the test if any of its processes outlives the driver). Ray's own driver handler would
    exit silently with status 15."""
    run_dir = tmp_path / "T"
    proc = subprocess.Popen(train_cmd(run_dir, "--mode", "ray", "--set", "runtime.address=local",
                                      "--set", "train.rounds=500"),
                            cwd=REPO, env=private_ray_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 180
    try:
        while not latest.is_file() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert latest.is_file() and proc.poll() is None, "no checkpoint while the run lasted"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err
    said = [line for line in err.splitlines() if line.startswith("fedrod-ray:")]
    assert said == [f"fedrod-ray: stopped by SIGTERM; continue it with: fedrod-ray train --resume {run_dir}"], err
    assert "Traceback" not in err


# --- 6. the coordinator actor killed mid-round -----------------------------------------------------------

RAY_ARGS = ("--mode", "ray", "--set", "runtime.address=local")


@pytest.mark.parametrize(("done", "died_in", "start", "again"), [
    (None, 1, "the start", "round 1 is trained again"),
    (2, 3, "the checkpoint after round 2", "round 3 is trained again"),
    (1, 3, "the checkpoint after round 1", "rounds 2-3 are trained again"),  # round 2's save was in flight
    (4, 4, "the checkpoint after round 4", "no round is trained again"),  # it died writing final/
])
def test_a_restart_says_where_it_starts_and_which_rounds_it_trains_again(done, died_in, start, again):
    snapshot = None if done is None else Snapshot(done, tiny_config(), {}, {}, {})
    assert ray_runtime.restarted(snapshot, 2, died_in, 3) == (
        f"started again from {start} (restart 2 of 3, runtime.coordinator_restarts): {again}")


def kill_the_coordinator_in_round_3(cmd: list[str], run_dir: Path, env: dict,
                                    tmp_path: Path) -> subprocess.Popen:
    """Start a Ray run (``env``: the ``private_ray_env`` fixture) whose round 3 hangs in a client's training
    (the fault hook, in the actors of its private Ray), wait until round 2's checkpoint is committed, and
    SIGKILL the coordinator actor's process from outside: it dies in the middle of round 3, whatever the
    timing. Returns the still running driver."""
    cfg = load_config(REPO / "configs" / "synthetic_tiny.yaml")
    client = sample_clients(cfg.seed, 2, cfg.data.num_clients, cfg.train.client_fraction)[0]
    marker = tmp_path / "fault"
    fault = json.dumps({"call": "train", "client": int(client), "round_idx": 2, "marker": str(marker)})
    proc = subprocess.Popen(cmd, cwd=REPO, env={**env, faults.ENV: fault}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    latest = run_dir / "checkpoints" / "latest"
    deadline = time.monotonic() + 180
    try:
        while not (marker.exists() and latest.is_file() and latest.read_text().strip() == "round_000002"):
            assert proc.poll() is None, f"the run ended before its coordinator was killed:\n{proc.communicate()}"
            assert time.monotonic() < deadline, "round 3 did not hang after round 2's checkpoint within 180 s"
            time.sleep(0.02)
        [pid] = [pid for pid, cmdline in env.processes() if cmdline.startswith("ray::CoordinatorImpl")]
        os.kill(pid, signal.SIGKILL)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return proc


def run_ray_until_round_3_hangs(cfg, run_dir: Path, tmp_path: Path, monkeypatch) -> tuple[Background, list[str]]:
    """``run_ray`` in the background (this process's Ray), its round 3 hanging in a client's training (the
    fault hook), returned once round 2's checkpoint is committed: (the run, its console lines)."""
    victim = sample_clients(cfg.seed, 2, cfg.data.num_clients, cfg.train.client_fraction)[0]
    marker = tmp_path / "fault"
    arm_fault(monkeypatch, marker, "train", int(victim), round_idx=2)
    logs: list[str] = []
    running = Background(lambda: ray_runtime.run_ray(cfg, RunStorage(str(run_dir)), log=logs.append))
    latest, deadline = run_dir / "checkpoints" / "latest", time.monotonic() + 180
    while not (marker.exists() and latest.is_file() and latest.read_text().strip() == "round_000002"):
        if not running.thread.is_alive():
            running.result(0)
            pytest.fail("the run ended before its coordinator was killed")
        assert time.monotonic() < deadline, "round 3 did not hang after round 2's checkpoint within 180 s"
        time.sleep(0.02)
    return running, logs


def coordinators(ray, run_dir: Path) -> list[str]:
    """The names of the coordinators of the run in ``run_dir`` that Ray knows."""
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("fedrod-ray coordinator ") and a["name"].endswith(f" of {run_dir}")]


def test_a_coordinator_ended_by_ray_kill_is_restarted_and_trains_as_in_process(ray_session, one_torch_thread,
                                                                               tmp_path, monkeypatch):
    """``ray.kill`` of the coordinator (found by its name, from outside the driver's code) while round 3
    hangs: ``run_ray`` starts another from round 2's checkpoint, which trains round 3 again, and returns
    what an uninterrupted in-process run records, its final weights bitwise the same."""
    ray = ray_session
    cfg = tiny_config("train.rounds=4")
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_records = run_local(cfg, RunStorage(str(ref_dir)), log=lambda line: None)
    running, logs = run_ray_until_round_3_hangs(cfg, run_dir, tmp_path, monkeypatch)
    [name] = coordinators(ray, run_dir)
    ray.kill(ray.get_actor(name))
    records = running.result(300)

    assert ("ray: the coordinator actor died in round 3; started again from the checkpoint after round 2 "
            "(restart 1 of 3, runtime.coordinator_restarts): round 3 is trained again") in logs, logs
    assert [r.pop("coordinator_restart", None) for r in records] == [None, None, 1, None]
    assert without_time(records) == without_time(ref_records)
    for rel in ("final/model.safetensors", "final/personal.safetensors"):
        assert_same_tensors(load_file(ref_dir / rel), load_file(run_dir / rel), rel)


def test_a_coordinator_dying_past_its_restarts_stops_the_run(ray_session, one_torch_thread, tmp_path, monkeypatch):
    """With ``runtime.coordinator_restarts: 1``, the restarted coordinator killed too: ``run_ray`` raises
    ``RunLostError`` naming the round and the restarts, and the checkpoint a resume needs is there."""
    ray = ray_session
    run_dir = tmp_path / "run"
    running, logs = run_ray_until_round_3_hangs(tiny_config("train.rounds=4", "runtime.mode=ray", "runtime.coordinator_restarts=1"),
                                                run_dir, tmp_path, monkeypatch)
    [first] = coordinators(ray, run_dir)
    ray.kill(ray.get_actor(first))
    deadline = time.monotonic() + 120
    while not (second := [name for name in coordinators(ray, run_dir) if name != first]):
        assert running.thread.is_alive() and time.monotonic() < deadline, "no second coordinator within 120 s"
        time.sleep(0.02)
    restarted = ray.get_actor(second[0])
    ray.get(restarted.info.remote())  # set up, training round 3 again
    ray.kill(restarted)
    with pytest.raises(RunLostError) as lost:
        running.result(300)
    assert re.fullmatch(r"the coordinator actor died in round [34] after 1 restart\(s\) "
                        r"\(runtime\.coordinator_restarts\)", str(lost.value)), lost.value
    assert sum("started again" in line for line in logs) == 1, logs
    assert load_checkpoint(RunStorage(str(run_dir))).rounds_done >= 2


@pytest.mark.slow
def test_a_killed_coordinator_is_restarted_and_the_run_trains_as_uninterrupted(uninterrupted_run, tmp_path,
                                                                               private_ray_env):
    """The coordinator's process SIGKILLed in round 3: the driver starts a new coordinator from round 2's
    checkpoint, which trains round 3 again, says so on the console and in its record, and the run ends with
    bitwise the uninterrupted run's weights, client states and metrics."""
    b = tmp_path / "B"
    proc = kill_the_coordinator_in_round_3(train_cmd(b, *RAY_ARGS), b, private_ray_env, tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"{out}\n{err}"
    assert ("ray: the coordinator actor died in round 3; started again from the checkpoint after round 2 "
            "(restart 1 of 3, runtime.coordinator_restarts): round 3 is trained again\n") in out, out
    rounds = re.findall(r"^\[round\s+(\d+)/4\].*$", out, re.MULTILINE)
    assert rounds == ["1", "2", "3", "4"], out
    [line] = [ln for ln in out.splitlines() if ln.startswith("[round   3/4]")]
    assert line.endswith("|  trained again (coordinator restart 1)"), line
    assert "Traceback" not in err, err
    assert_same_run(uninterrupted_run, b, restarted={3: 1})


@pytest.mark.slow
def test_a_dead_coordinator_without_restarts_stops_with_one_line_naming_resume(uninterrupted_run, tmp_path,
                                                                               private_ray_env):
    """With ``runtime.coordinator_restarts: 0`` the same death stops the run: one line saying what died and
    the exact --resume command, exit 1, no traceback, its private Ray shut down; that command then reaches
    the uninterrupted run's bits."""
    b = tmp_path / "B"
    cmd = train_cmd(b, *RAY_ARGS, "--set", "runtime.coordinator_restarts=0")
    proc = kill_the_coordinator_in_round_3(cmd, b, private_ray_env, tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, f"{out}\n{err}"
    said = [line for line in err.splitlines() if line.startswith("fedrod-ray:")]
    assert said == [("fedrod-ray: the coordinator actor died in round 3 (runtime.coordinator_restarts is 0); "
                     f"continue it with: fedrod-ray train --resume {b}")], err
    assert "Traceback" not in err, err
    assert "started again" not in out
    proc = run_cli([*CLI, "--resume", str(b), "--set", "runtime.torch_threads=1"], env=private_ray_env)
    assert_resumed_after_latest(proc.stdout, b, "round_000002")
    assert_same_run(uninterrupted_run, b)


# --- 7. a node lost from a multi-node cluster ------------------------------------------------------

NODE_LOSS_SCRIPT = textwrap.dedent("""
    import json, threading, time
    import ray, torch
    from ray.cluster_utils import Cluster
    from ray.util.state import list_actors
    from fedrod_ray.config import config_from_dict, load_config
    from fedrod_ray.executors.ray import RayExecutor, plan_layout
    from fedrod_ray.round_loop.federation import Federation
    from fedrod_ray.federation_state.setup import prepare

    def is_training(pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().startswith(b"ray::ClientActorImpl.train")

    torch.set_num_threads(1)
    # Spread the actors over the nodes (Ray's default packs a node up to half its CPUs first).
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "_system_config": {"scheduler_spread_threshold": 0.0}})
    try:
        workers = [cluster.add_node(num_cpus=1, resources={"client_slot": 2}) for _ in range(2)]
        ray.init(address=cluster.address, log_to_driver=False)
        cfg = config_from_dict({
            "name": "node_loss", "seed": 0,
            "data": {"dataset": "synthetic", "num_clients": 4, "new_clients": 0,
                     "synthetic_train_per_class": 40, "synthetic_test_per_class": 20},
            "train": {"rounds": 3, "client_fraction": 1.0, "local_epochs": 20, "batch_size": 20},
            "runtime": {"torch_threads": 1, "client_resources": {"num_cpus": 0.5, "client_slot": 1},
                        "min_clients_per_round": 1, "max_failed_fraction": 0.9}})
        setup = prepare(cfg)
        layout = plan_layout(cfg.runtime, len(setup.all_client_ids), ray.cluster_resources())
        executor = RayExecutor(setup, layout)
        index = {a._actor_id.hex(): i for i, a in enumerate(executor.actors)}

        def placement():
            return {index[s.actor_id]: [s.node_id, s.state]
                    for s in list_actors(filters=[("class_name", "=", "ClientActorImpl")], detail=False)
                    if s.actor_id in index and s.state != "DEAD"}

        before = placement()
        pid = ray.get(executor.actors[0].ready.remote())["pid"]
        fed = Federation(setup, executor, log=lambda s: print(s, flush=True))
        records = [fed.step(0)]
        # Round 2 runs in a thread; the node of actor 0 goes while that actor trains a client.
        th = threading.Thread(target=lambda: records.append(fed.step(1)))
        th.start()
        deadline = time.monotonic() + 60
        while not is_training(pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert is_training(pid), "actor 0 was never seen training in round 2"
        victim = next(w for w in workers if w.node_id == before[0][0])
        cluster.remove_node(victim)
        th.join(240)
        assert not th.is_alive(), "round 2 did not end within 240 s of the node's loss"
        records.append(fed.step(2))
        after = placement()
        info = ray.get(executor.actors[0].ready.remote())
        finite = all(bool(torch.isfinite(v).all()) for v in fed.global_shared.values())
        executor.close()
        print("RESULT " + json.dumps({
            "layout": [layout.num_actors, layout.clients_per_actor],
            "workers": [w.node_id for w in workers], "removed": victim.node_id,
            "before": before, "after": after, "attached": info["attached"], "finite": finite,
            "records": [{k: r[k] for k in ("round", "clients", "clients_done", "clients_failed")}
                        for r in records], "gfl_gm": records[-1]["gfl_gm"]}), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
""")


@pytest.mark.slow
def test_node_lost_from_cluster(tmp_path, private_ray_env):
    script = tmp_path / "node_loss.py"
    script.write_text(NODE_LOSS_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], check=False, cwd=REPO,
                          env=private_ray_env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    res = json.loads(line[len("RESULT "):])

    assert res["layout"] == [2, 0]  # two pooled actors
    nodes = res["workers"]
    # One actor on each worker node (never the CPU-less head).
    assert sorted(node for node, _ in res["before"].values()) == sorted(nodes), res["before"]
    survivor = next(n for n in nodes if n != res["removed"])
    # Both actors alive afterwards, the restarted one on the surviving node and attached to the data again.
    assert res["after"] == {"0": [survivor, "ALIVE"], "1": [survivor, "ALIVE"]}, res["after"]
    assert res["attached"] is True
    r0, r1, r2 = res["records"]
    assert r0["clients_failed"] == 0
    # Only the client in training on the lost node is lost; the others ran on the survivor.
    assert r1 == {"round": 2, "clients": 4, "clients_done": 3, "clients_failed": 1}
    assert r2 == {"round": 3, "clients": 4, "clients_done": 4, "clients_failed": 0}
    assert res["finite"] is True
    assert math.isfinite(res["gfl_gm"])


# --- 8. the data held once, in the object store -------------------------------------------------------


def test_the_coordinator_maps_the_shared_data_and_hands_its_actors_the_same_references(ray_session, tmp_path):
    """The coordinator is handed references, not data: it maps each array from the object store (its memory is
    the store's) and attaches the client actors to those same objects, not to copies put again."""
    ray = ray_session
    setup = prepare(tiny_config())
    shared = share(setup)
    assert all(getattr(shared.dataset, f) is None for f in DATASET_ARRAYS)
    assert all(getattr(shared.partition, f) is None for f in PARTITION_ARRAYS)
    assert all(isinstance(ref, ray.ObjectRef) for ref in shared.refs.values())
    # Back from the store, the setup is the one that was shared.
    back = shared.setup()
    for a, b in ((back.dataset.train_x, setup.dataset.train_x), (back.dataset.train_y, setup.dataset.train_y),
                 (back.test.x, setup.test.x), (back.test.y, setup.test.y)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert all(map(np.array_equal, back.partition.client_indices, setup.partition.client_indices))
    assert np.array_equal(back.partition.counts, setup.partition.counts)
    assert back.num_clients == setup.num_clients and back.augment == setup.augment

    def inspect(coordinator) -> tuple[dict[str, bool], list[str]]:
        """In the coordinator: whether each array's memory lies in a mapping of the object store (a plasma
        file), and the references its executor attaches the client actors with. Defined in the test so
        that Ray sends it by value."""
        spans = []
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                spans.append((lo, hi, "plasma" in line))

        def in_store(address: int) -> bool:
            return any(lo <= address < hi and store for lo, hi, store in spans)

        s = coordinator.run.federation.setup
        arrays = {"dataset.train_x": s.dataset.train_x.numpy(), "dataset.train_y": s.dataset.train_y.numpy(),
                  "test.x": s.test.x.numpy(), "test.y": s.test.y.numpy(), "partition.counts": s.partition.counts,
                  "partition.client_indices": s.partition.client_indices[0]}
        mapped = {k: in_store(v.__array_interface__["data"][0]) for k, v in arrays.items()}
        attached = [r.hex() for r in coordinator.executor._attach_args[0] if isinstance(r, ray.ObjectRef)]
        return mapped, attached

    coordinator = Coordinator.options(num_cpus=0).remote(shared, str(tmp_path / "run"))
    try:
        mapped, attached = ray.get(coordinator.__ray_call__.remote(inspect))
    finally:
        ray.get(coordinator.close.remote())
        ray.kill(coordinator)
    assert mapped == dict.fromkeys(mapped, True)
    refs = {k: ref.hex() for k, ref in shared.refs.items()}
    assert attached == [refs[k] for k in ("dataset.train_x", "dataset.train_y", "partition.client_indices",
                                          "partition.counts", "test.x", "test.y", "partition.meta_indices")]


def test_a_ray_run_keeps_no_setup_in_the_driver_and_trains_as_in_process(ray_session, one_torch_thread, tmp_path,
                                                                         tmp_path_factory, monkeypatch):
    """``run_ray`` prepares the setup in the driver (a missing dataset fails there) but lets it go once its
    arrays are in the object store: by the time the coordinator reports, nothing in the driver holds it. The
    coordinator then trains what the in-process runtime trains."""
    prepared: list[weakref.ref] = []

    def prepare_and_watch(cfg):
        setup = prepare(cfg)
        prepared.extend(weakref.ref(x) for x in (setup, setup.dataset, setup.dataset.train_x, setup.test.x))
        return setup

    alive_when_ready: list[int] = []

    def log(line: str) -> None:
        if line.startswith("ray: "):
            alive_when_ready.append(sum(ref() is not None for ref in prepared))

    monkeypatch.setitem(RUNTIMES, "ray", dataclasses.replace(RUNTIMES["ray"], prepare=prepare_and_watch))
    records = ray_runtime.run_ray(tiny_config(), RunStorage(str(tmp_path / "run")), log=log)
    assert len(prepared) == 4 and alive_when_ready == [0]
    _, _, records_ref, _, _ = in_process_baseline("linear", tmp_path_factory.getbasetemp())
    assert without_time(records) == without_time(records_ref)
