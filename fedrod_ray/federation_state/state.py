"""The federation's own state: what one run has learned after a round, and all a resume needs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..clients.client import ClientState
from ..config import ExperimentConfig
from ..server_math.aggregate import StateDict


@dataclass(frozen=True)
class Arrival:
    """A FedBuff client in flight (``rounds.mode: fedbuff``): sent out as the ``dispatch``-th send-out with
    model ``version``, arriving at virtual time ``arrives``. Once trained (``delta`` or ``error`` set), its
    update to that model, the state it will commit on arrival, and its losses. Frozen: the loop replaces an
    entry, so a snapshot's stays as it was taken."""

    client_id: int
    dispatch: int
    version: int
    arrives: float
    delta: StateDict | None = None  # its shared weights minus model ``version``'s
    state: ClientState | None = None
    num_samples: int = 0
    loss: float = 0.0
    personal_loss: float | None = None
    error: str | None = None  # its local update failed

    @property
    def trained(self) -> bool:
        return self.delta is not None or self.error is not None


@dataclass
class Snapshot:
    """A federation's full state after a round: what ``Federation.snapshot`` gives and ``restore`` takes,
    ``checkpoint`` saves and loads, and ``final`` exports."""

    rounds_done: int  # rounds completed: the next round's 0-based index, "round N" for users
    config: ExperimentConfig
    global_shared: StateDict
    server_state: StateDict  # owned by config.train.generic_rule (empty if it keeps none)
    # Every client's state: a federation's ``client_store.StoredClients`` (read from disk when asked for), or
    # states in memory.
    clients: Mapping[int, ClientState]
    # With eval.estimate_size: exact minus sample estimate of each estimated metric at the last exact
    # evaluation (``evaluation.estimate_offset``); empty before the first one.
    estimate_offset: dict[str, float] = field(default_factory=dict)
    method_state: StateDict = field(default_factory=dict)  # owned by config.train.head (empty if it keeps none)
    # Client-level DP's server state (``dp_rounds.ClientLevelDP``): adaptive clipping's clip norm (else empty).
    privacy_state: StateDict = field(default_factory=dict)
    # The virtual clock (``rounds``): simulated seconds the rounds so far took; with FedBuff, the send-outs so
    # far (what picks the next client) and the clients in flight, in send-out order.
    virtual_time: float = 0.0
    dispatches: int = 0
    in_flight: list[Arrival] = field(default_factory=list)
    # At sites (``data.dataset: sites``): each site's clients' state versions and sha256, by site name; the states
    # themselves stay at the sites (``executors.sites.SitesExecutor.kept_states``).
    sites: dict[str, dict] = field(default_factory=dict)
