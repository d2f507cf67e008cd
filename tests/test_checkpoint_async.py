"""Checkpoints saved off the round's critical path (``checkpoint.BackgroundSaves``, driven by
``run.Run``): a save returns at once and the next round trains while it is written, at most one is in
flight, its error is raised and never lost, and a run that ends or is interrupted first waits for it."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from test_checkpoint import _CrashAt, make_checkpoint
from test_federation import make_federation

from fedrod_ray.config import config_from_dict
from fedrod_ray.federation_state.checkpoint import (
    BackgroundSaves,
    CheckpointSaveError,
    CheckpointWriter,
    latest_checkpoint_name,
    load_checkpoint,
    save_checkpoint,
)
from fedrod_ray.lifecycle.run import Run
from fedrod_ray.outputs.storage import RunStorage


class _Gated(RunStorage):
    """Run storage whose checkpoint saves wait, before they read anything of the snapshot, until ``gate``
    is set, and then take ``delay`` seconds more."""

    def __init__(self, uri: str, delay: float = 0.0):
        super().__init__(uri)
        self.gate = threading.Event()
        self.delay = delay

    def list_dirs(self, rel: str) -> list[str]:
        if rel == "checkpoints":  # a save's first step
            assert self.gate.wait(120), "the gate was never opened"
            time.sleep(self.delay)
        return super().list_dirs(rel)


def _open(storage: _Gated) -> None:
    storage.gate.set()


def test_a_save_returns_at_once_and_the_next_one_waits_for_it(tmp_path):
    storage = _Gated(str(tmp_path / "run"))
    writer, saves = CheckpointWriter(storage), BackgroundSaves()
    saves.save(writer, make_checkpoint(8))  # returns with its save held at the gate
    assert latest_checkpoint_name(storage) is None
    second = threading.Thread(target=saves.save, args=(writer, make_checkpoint(9)))
    second.start()
    second.join(0.5)
    assert second.is_alive(), "a second save started while the first was in flight"
    _open(storage)
    second.join(120)
    assert saves.wait() == "round_000009"
    assert load_checkpoint(storage, "round_000008").rounds_done == 8
    assert latest_checkpoint_name(storage) == "round_000009"
    assert saves.wait() is None  # nothing in flight


def test_a_failed_save_is_raised_by_the_next_save_and_by_wait(tmp_path):
    root = str(tmp_path / "run")
    saves = BackgroundSaves()
    saves.save(CheckpointWriter(_CrashAt(root, "latest")), make_checkpoint(8))
    with pytest.raises(CheckpointSaveError, match=r"saving round 8's checkpoint into .*/run/checkpoints failed: "
                                                  r"OSError: killed after the folder was moved") as raised:
        saves.save(CheckpointWriter(RunStorage(root)), make_checkpoint(9))
    assert isinstance(raised.value.__cause__, OSError)
    # The failed save's successor was not started: what it reported on is reported once.
    assert saves.wait() is None
    saves.save(CheckpointWriter(_CrashAt(root, "latest")), make_checkpoint(10))
    with pytest.raises(CheckpointSaveError, match="round 10's checkpoint"):
        saves.wait()
    assert latest_checkpoint_name(RunStorage(root)) is None


def test_the_next_round_cannot_change_the_checkpoint_in_flight(tmp_path, one_torch_thread):
    """The snapshot is handed over uncopied: the round trained while it is written replaces the
    federation's state and writes into none of it, so the checkpoint holds the round it was taken after."""
    fed = make_federation("train.rounds=3", "train.momentum_buffers=keep")
    fed.step(0)
    snap = fed.snapshot()
    expected = copy.deepcopy(snap)
    storage = _Gated(str(tmp_path / "run"))
    saves = BackgroundSaves()
    saves.save(CheckpointWriter(storage), snap)
    fed.step(1)  # while round 1's save waits, before it has read a tensor
    _open(storage)
    assert saves.wait() == "round_000001"
    loaded = load_checkpoint(storage)
    assert loaded.rounds_done == 1
    changed = [k for k, v in fed.global_shared.items() if not torch.equal(v, expected.global_shared[k])]
    assert changed, "round 2 changed nothing: the test would prove nothing"
    for k, v in expected.global_shared.items():
        assert torch.equal(loaded.global_shared[k], v), k
    assert {c for c, st in fed.clients.items() if st.rounds_trained != expected.clients[c].rounds_trained}
    for cid, st in expected.clients.items():
        assert loaded.clients[cid].rounds_trained == st.rounds_trained
        got = loaded.clients[cid].tensors()
        assert sorted(got) == sorted(st.tensors()), cid
        assert all(torch.equal(got[k], v) for k, v in st.tensors().items()), cid


class _Rounds:
    """What a ``Run`` asks of its federation, with nothing behind it: ``step(r)`` calls ``on_step(r)`` and
    returns a record; ``snapshot()`` is a stub checkpoint of the rounds done."""

    def __init__(self, rounds: int, on_step=lambda r: None, log=lambda line: None):
        self.cfg = config_from_dict({"name": "run_test", "data": {"dataset": "synthetic"}},
                                    [f"train.rounds={rounds}", "runtime.checkpoint_every=1"])
        self.rounds, self.next_round, self.on_step, self.log = rounds, 0, on_step, log
        self.setup = None

    def step(self, r: int) -> dict:
        self.on_step(r)
        self.next_round = r + 1
        return {"round": r + 1, "seconds": 0.0, "lr": 0.1, "clients": 1, "clients_done": 1, "clients_failed": 0,
                "train_loss": 0.5}

    def snapshot(self):
        return make_checkpoint(self.next_round)

    def restore(self, snap) -> None:
        self.next_round = snap.rounds_done


@pytest.fixture
def finals(monkeypatch) -> list:
    """Each ``final/`` a run writes, as the checkpoint that ``latest`` names at that moment."""
    written = []
    monkeypatch.setattr("fedrod_ray.lifecycle.run.write_final",
                        lambda storage, setup, snap, metrics: written.append(latest_checkpoint_name(storage)))
    return written


def test_a_run_saves_while_the_next_round_runs_and_waits_before_final(tmp_path, finals):
    """Round r+1 starts with round r's save in flight; the last save is committed before ``final/``."""
    storage = _Gated(str(tmp_path / "run"), delay=0.3)
    seen = []

    def step(r: int) -> None:
        seen.append((r, latest_checkpoint_name(storage)))
        if r == 1:
            _open(storage)  # round 0's save was held until round 1 ran

    records = Run(_Rounds(3, step), storage).train()
    assert seen[:2] == [(0, None), (1, None)]
    assert finals == ["round_000003"]
    assert [r["round"] for r in records] == [1, 2, 3]


def test_a_run_tells_each_record_at_once_or_its_last_after_final(tmp_path, finals):
    """A console shows the last round while its checkpoint is saved; a Tune trial's last report may end its
    process, so with ``last_after_final`` ``final/`` is written before it."""
    told = []
    Run(_Rounds(2), RunStorage(str(tmp_path / "a"))).train(lambda record: told.append((record["round"], len(finals))))
    assert told == [(1, 0), (2, 0)]
    told.clear()
    Run(_Rounds(2), RunStorage(str(tmp_path / "b"))).train(lambda record: told.append((record["round"], len(finals))),
                                                           last_after_final=True)
    assert told == [(1, 1), (2, 2)]


def test_a_run_resumed_after_its_last_round_writes_final(tmp_path, finals):
    """Killed between its last checkpoint and ``final/``: resumed, it trains nothing and writes ``final/``."""
    storage = RunStorage(str(tmp_path / "run"))
    save_checkpoint(storage, make_checkpoint(2))
    assert Run(_Rounds(2), storage, load_checkpoint(storage)).train() == []
    assert finals == ["round_000002"]


def test_an_interrupted_run_first_commits_the_save_in_flight(tmp_path, finals):
    """Ctrl-C (or SIGTERM, which the CLI turns into the same exception) in round 3: round 2's save, still
    being written, is committed before the interruption goes on up, so a resume continues after round 2."""
    storage = _Gated(str(tmp_path / "run"), delay=0.5)
    _open(storage)

    def step(r: int) -> None:
        if r == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Run(_Rounds(4, step), storage).train()
    assert latest_checkpoint_name(storage) == "round_000002"
    assert finals == [], "final/ written by an interrupted run"


def test_a_failed_save_stops_the_run_before_final_and_is_said_on_an_interruption(tmp_path, finals):
    root = str(tmp_path / "run")
    with pytest.raises(CheckpointSaveError, match="round 1's checkpoint"):
        Run(_Rounds(1), _CrashAt(root, "latest")).train()
    assert finals == [], "final/ written after a failed save"

    def interrupted(r: int) -> None:
        if r == 1:
            raise KeyboardInterrupt

    said = []
    with pytest.raises(KeyboardInterrupt):
        Run(_Rounds(3, interrupted, said.append), _CrashAt(root, "latest")).train()
    assert said[-1] == (f"the checkpoint save in flight failed too: saving round 1's checkpoint into {root}/"
                        "checkpoints failed: OSError: killed after the folder was moved, before `latest` was")
