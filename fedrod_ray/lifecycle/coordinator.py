"""The coordinator actor: it holds a Ray run's ``run.Run`` (the same lifecycle as the in-process runtime)
on the cluster, its federation with the Ray executor (``fedrod_ray.executors.ray``), and so owns every
client's committed state and writes the run directory.
"""

from __future__ import annotations

import ray
import torch

from ..clients.site_store import SiteStateError
from ..config import ConfigError
from ..data import DatasetFormatError, DatasetNotFoundError
from ..executors.runtimes import runtime_of
from ..executors.shared_setup import SharedSetup
from ..federation_state.state import Snapshot
from ..outputs.storage import RunStorage
from ..round_loop.federation import Federation
from .run import Run

# What stops a run before it starts with a message of its own (at sites, what the sites' data or stores say):
# kept by the coordinator and raised by its first call, so that the driver can say it as the CLI says its own.
STARTUP_ERRORS = (ConfigError, DatasetFormatError, DatasetNotFoundError, SiteStateError)


class CoordinatorImpl:
    """Owns the run on the cluster. The driver hands it the prepared setup (its arrays in the object store,
    which this actor and the client actors map, and none holds a copy of), the run directory and (to resume)
    a snapshot, starts ``train``, and meanwhile asks, from a second thread (``max_concurrency=2``), for the
    progress of the round in hand and the records of the rounds done. A coordinator the driver starts again
    after the last one died is told which (``restart``: its number, the round the last one died in) and
    marks the records of the rounds it trains again (``Run.redo``)."""

    def __init__(self, shared: SharedSetup, storage_uri: str, snapshot: Snapshot | None = None,
                 restart: tuple[int, int] | None = None):
        cfg = shared.cfg
        torch.set_num_threads(max(1, cfg.runtime.torch_threads or 1))
        self.start_error: Exception | None = None
        try:  # at sites, the sites' actors report their clients, which make the whole setup
            setup, self.executor = runtime_of(cfg, on_ray=True).start(shared.setup(), shared=shared, log=print)
            self.layout = self.executor.layout
            self.run = Run(Federation(setup, self.executor, log=print), RunStorage(storage_uri), snapshot)
        except STARTUP_ERRORS as e:
            self.start_error = e
            return
        if restart is not None:
            self.run.redo(*restart)

    def info(self) -> dict:
        if self.start_error is not None:
            raise self.start_error
        return {"next_round": self.run.next_round, "rounds": self.run.rounds, "records": len(self.run.records),
                "num_actors": self.layout.num_actors,
                "clients_per_actor": self.layout.clients_per_actor, "max_in_flight": self.layout.max_in_flight}

    def train(self) -> list[dict]:
        """The whole run (``Run.train``); returns every round's record."""
        return self.run.train()

    def records(self, start: int) -> list[dict]:
        """The records from the ``start``-th on (those the driver has not printed yet)."""
        return self.run.records[start:]

    def progress(self) -> tuple[int, int, int]:
        """(round, clients finished, clients sampled) of the round in hand."""
        return self.run.federation.round_progress

    def stop(self) -> None:
        """The driver was stopped (Ctrl-C, SIGTERM): commit the save in flight before the actor goes."""
        self.run.stop()

    def close(self) -> None:
        if hasattr(self, "executor"):  # not where the sites' actors could not start
            self.executor.close()


Coordinator = ray.remote(CoordinatorImpl)
