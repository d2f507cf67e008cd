"""One training run, from its setup to ``final/``: the object that owns a federation and its run directory.

``Federation.step`` only computes; a ``Run`` decides what is written, and when. Its lifecycle:

    run = Run(federation, storage, snapshot)   # setup: resume from the snapshot, config.yaml, the
                                               # metrics log, the trackers, the checkpoint writer
    run.train(on_record)                       # for each round: step, record, checkpoint when due;
                                               # after the last: final/

A checkpoint is started every ``runtime.checkpoint_every`` rounds and after the last, and is saved while
the next round trains (``checkpoint.BackgroundSaves``). A run lives where its federation does: in this
process (``runner.run_local``), in a Ray run's coordinator actor (``coordinator``; the driver asks it for
progress and records), and in a Tune trial (``tune/trial.py``), whose run directory is the trial's folder.
"""

from __future__ import annotations

from collections.abc import Callable

from ..config import dump_config
from ..federation_state.checkpoint import BackgroundSaves, CheckpointWriter
from ..federation_state.final import write_final
from ..federation_state.state import Snapshot
from ..outputs.results import MetricsLog
from ..outputs.storage import RunStorage
from ..outputs.tracking import final_metrics, open_trackers
from ..round_loop.federation import Federation


class RunLostError(RuntimeError):
    """The process that held the run died and was not started again (on Ray: the coordinator actor, past
    ``runtime.coordinator_restarts``): the run stops, and ``--resume`` goes on from its last checkpoint."""


def last_evaluation(records: list[dict]) -> dict:
    """The record of the last evaluated round ({} before the first evaluation)."""
    evaluated = [r for r in records if "gfl_gm" in r]
    return evaluated[-1] if evaluated else {}


class Run:
    """A federation and everything its run writes: ``config.yaml``, the metrics files (``results.MetricsLog``)
    and trackers (``tracking``) after every round, its checkpoints, and ``final/``.

    Args:
        federation: the round loop, with the executor of wherever the run trains; the run owns it from here.
        storage: the run directory.
        snapshot: a checkpoint to resume from: rounds go on after it, and the metrics files keep exactly
            the rounds it holds.
        track: open ``tracking.loggers``' trackers. A Tune trial does not: Tune's own logger callbacks
            track its reports (``tune/sweep.py``).
    """

    def __init__(self, federation: Federation, storage: RunStorage, snapshot: Snapshot | None = None,
                 track: bool = True):
        # The client store writes the states its cache cannot hold into the run directory, where the
        # checkpoints name them.
        federation.clients.attach(storage)
        if snapshot is not None:
            federation.restore(snapshot)
        self.federation, self.storage = federation, storage
        cfg = federation.cfg
        self.checkpoint_every = cfg.runtime.checkpoint_every
        storage.write_bytes("config.yaml", dump_config(cfg).encode())
        self.metrics = MetricsLog.resume(storage, federation.next_round)
        self.trackers = open_trackers(cfg, storage, federation.next_round) if track else []
        self.writer, self.saves = CheckpointWriter(storage), BackgroundSaves()
        self.redone = (0, 0)  # (restart, the last round it trains again): see ``redo``

    @property
    def next_round(self) -> int:
        return self.federation.next_round

    @property
    def rounds(self) -> int:
        """The rounds this run trains (``Federation.rounds``: ``train.rounds``, or fewer where a privacy
        budget runs out first)."""
        return self.federation.rounds

    @property
    def records(self) -> list[dict]:
        """Every round's record, earlier runs' too when resumed."""
        return self.metrics.records

    def train(self, on_record: Callable[[dict], None] = lambda record: None, last_after_final: bool = False,
              ) -> list[dict]:
        """Train every round left, then write ``final/``; returns every round's record.

        ``on_record(record)`` is called as soon as each round is recorded (a console line shows the last round
        while its checkpoint is saved); with ``last_after_final``, the last round's once ``final/`` is written
        (a Tune trial: its last report may end its process). Stopped early (an exception: Ctrl-C, SIGTERM, a
        failed round or save), the save in flight is committed first (``stop``).
        """
        try:
            if self.next_round == self.rounds:
                self.finish()  # resumed from its last round's checkpoint, with final/ perhaps not written
            while self.next_round < self.rounds:
                record = self.round()
                last = self.next_round == self.rounds
                if not (last and last_after_final):
                    on_record(record)
                if last:
                    self.finish()
                    if last_after_final:
                        on_record(record)
        except BaseException:
            self.stop()
            raise
        return self.records

    def redo(self, restart: int, through_round: int) -> None:
        """This run is the ``restart``-th start again of one whose process died in round ``through_round``
        (counted from 1; on Ray, the coordinator actor): the records of the rounds it trains again, from its
        snapshot's up to that one, say so (``coordinator_restart``: ``restart``)."""
        self.redone = (restart, through_round)

    def round(self) -> dict:
        """Train the next round and record it; when a checkpoint is due, start saving it. Returns its record."""
        record = self.federation.step(self.next_round)
        if record["round"] <= self.redone[1]:
            record["coordinator_restart"] = self.redone[0]
        self.metrics.append(record)
        for tracker in self.trackers:
            tracker.log_round(record)
        if self.next_round % self.checkpoint_every == 0 or self.next_round == self.rounds:
            self.saves.save(self.writer, self.federation.snapshot())
        return record

    def finish(self) -> None:
        """Wait for the save in flight (raising its error), write ``final/`` with the last evaluation's
        metrics, and close the trackers."""
        self.saves.wait()
        last = last_evaluation(self.records)
        write_final(self.storage, self.federation.setup, self.federation.snapshot(), last)
        for tracker in self.trackers:
            tracker.finish(final_metrics(last), self.storage)

    def stop(self) -> None:
        """End the run early: the save in flight still commits, so that a resume starts from it. If it
        fails, that is said, not raised: the error that stopped the run is the one that goes on up."""
        try:
            self.saves.wait()
        except Exception as failed:  # noqa: BLE001 - said here, the run's own error is the one raised
            self.federation.log(f"the checkpoint save in flight failed too: {failed}")

    def committed(self) -> str | None:
        """Wait for the save in flight (raising its error); the name of the newest checkpoint this run has
        committed (None: none yet), which a resume from this run directory can load by name."""
        self.saves.wait()
        return self.saves.committed
