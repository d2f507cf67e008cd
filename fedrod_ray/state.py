"""The federation's own state: what one run has learned after a round, and all a resume needs."""

from __future__ import annotations

from dataclasses import dataclass, field

from .aggregate import StateDict
from .client import ClientState
from .config import ExperimentConfig


@dataclass
class Snapshot:
    """A federation's full state after a round: what ``Federation.snapshot`` gives and ``restore`` takes,
    ``checkpoint`` saves and loads, and ``final`` exports."""

    rounds_done: int  # rounds completed: the next round's 0-based index, "round N" for users
    config: ExperimentConfig
    global_shared: StateDict
    server_state: StateDict  # owned by config.train.generic_rule (empty if it keeps none)
    clients: dict[int, ClientState]
    # With eval.estimate_size: exact minus sample estimate of each estimated metric at the last exact
    # evaluation (``evaluation.estimate_offset``); empty before the first one.
    estimate_offset: dict[str, float] = field(default_factory=dict)
    method_state: StateDict = field(default_factory=dict)  # owned by config.train.head (empty if it keeps none)
    # Client-level DP's server state (``dp_rounds.ClientLevelDP``): adaptive clipping's clip norm (else empty).
    privacy_state: StateDict = field(default_factory=dict)
