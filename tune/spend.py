"""What a private sweep spends: every trial trains on the same clients, so their privacy losses add up. The
trials' events are composed on one accountant (``accounting.composed_epsilon``) at the base config's delta:
after the sweep from the rounds each trial ran, and before it, for ``privacy_budget``, from the most that
its search space allows. The released epsilon of each trial covers its own model only; the selection
metric that picks the best trial is computed from un-noised local models and is not covered at all."""

from __future__ import annotations

import itertools
import math
from typing import Any

from fedrod_ray.config import ConfigError, ExperimentConfig
from fedrod_ray.federation_state.dp_rounds import ClientLevelDP
from fedrod_ray.server_math.accounting import Mechanism, composed_epsilon

from .space import SweepSpec, _check_dimension


def trial_mechanism(cfg: ExperimentConfig) -> Mechanism | None:
    """The mechanism of one round of a trial (sigma as it derives it); None: the trial is not private."""
    if not cfg.privacy.enabled:
        return None
    return ClientLevelDP(cfg, cfg.data.num_clients).mechanism


def spent(spec: SweepSpec, trials: list[tuple[dict[str, Any], int]]) -> float | None:
    """The sweep's total epsilon at its base's delta after ``trials`` (each one's searched values and the
    rounds it trained); None for a sweep whose base is not private. A trial that trained without privacy
    makes it infinite: its model was released without noise."""
    base = spec.experiment_config({})
    if not base.privacy.enabled:
        return None
    runs = []
    for params, rounds in trials:
        mechanism = trial_mechanism(spec.trial_config(params))
        if mechanism is None and rounds > 0:
            return math.inf
        if mechanism is not None:
            runs.append((mechanism, rounds))
    try:
        return composed_epsilon(runs, base.privacy.delta)
    except ValueError as e:
        raise ConfigError(f"search: {e}; a private sweep keeps privacy.sampling and privacy.accountant fixed") from None


def most_spent(spec: SweepSpec) -> float:
    """The most the sweep can spend: every trial of the grid (``num_samples`` times each) at all its
    rounds, at whichever extreme of the other dimensions spends the most."""
    grid = {k: v["grid"] for k, v in spec.search.items() if "grid" in v}
    others = {k: _check_dimension(k, v) for k, v in spec.search.items() if "grid" not in v}
    trials = []
    for values in itertools.product(*grid.values()):
        point = dict(zip(grid, values))
        corners = [{**point, **dict(zip(others, extreme))} for extreme in itertools.product(*others.values())]
        worst = max(corners, key=lambda c: spent(spec, [(c, spec.trial_config(c).train.rounds)]))
        trials += [(worst, spec.trial_config(worst).train.rounds)] * spec.num_samples
    return spent(spec, trials)


def check_budget(spec: SweepSpec) -> None:
    """Refuse, before any trial starts, a sweep that could spend more than its ``privacy_budget``."""
    if spec.privacy_budget is None:
        return
    most = most_spent(spec)
    if most > spec.privacy_budget:
        raise ConfigError(f"privacy_budget: the sweep's trials could spend epsilon {most:.4g} in all (every trial's "
                          f"rounds composed, at delta {spec.experiment_config({}).privacy.delta:g}), more than "
                          f"its budget of {spec.privacy_budget:g}; search fewer trials, fewer rounds or more noise")
