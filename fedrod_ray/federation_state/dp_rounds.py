"""Client-level DP in a federation (``privacy``; docs/privacy.md): which clients a round samples, the clip norm
it sends them, the noised aggregate of their clipped updates, and the epsilon spent so far.

The math is ``fedrod_ray.server_math.privacy``'s and the accounting ``fedrod_ray.server_math.accounting``'s.
This holds what a run derives from its config before it starts (sigma from a target epsilon, the rounds a
budget lasts, the updates' noise multiplier under adaptive clipping) and reads and writes the one piece of
server state client-level DP keeps: adaptive clipping's clip norm (``Snapshot.privacy_state``). The noise and
the sampling come from the OS's CSPRNG, so that no seed replays them; with ``privacy.noise_seed`` (experiments)
round r's noise comes from a generator seeded by (noise_seed, r) and its clients from (seed, r), so a
resumed run draws what the uninterrupted one drew.
"""

from __future__ import annotations

import math

import torch

from ..client_update.local import derived_seed
from ..config import ConfigError, ExperimentConfig
from ..models.export import Privacy
from ..server_math import distributed_accounting
from ..server_math.accounting import Mechanism, epsilon, noise_for_epsilon, rounds_within
from ..server_math.aggregate import StateDict
from ..server_math.distributed_dp import DistributedRound, Encoding
from ..server_math.privacy import (
    SecureNoise,
    SeededNoise,
    adapted_clip_norm,
    noised_mean,
    update_noise_multiplier,
)
from ..server_math.server import (
    clients_per_round,
    poisson_sample,
    sample_clients,
    secure_poisson_sample,
    secure_sample,
)

NOISE_TAG = 7  # seeds a round's noise apart from everything else the run draws
ROTATION_TAG = 8  # seeds a round's random rotation (distributed_dgauss; public: every party derives it)
DEFAULT_BITS = 16  # privacy.bits when unset
CLIP_NORM = "clip_norm"  # adaptive clipping's server state: the clip norm of the next round (float64)
# Andrew et al. (2021): the count's noise std, by default, is the expected number of clients per round over this.
COUNT_NOISE_DIVISOR = 20


def check_shared(shared: StateDict) -> None:
    """Client-level DP clips and noises every shared tensor: a model whose shared state holds integers (batch
    norm's batch counters) cannot be trained privately."""
    integral = [k for k, v in shared.items() if not v.is_floating_point()]
    if integral:
        raise ConfigError(f"model.arch: its shared state holds integer tensors ({', '.join(integral[:3])}), which "
                          "client-level DP can neither clip nor noise; use a model without batch-norm counters")


def shared_dim(shared: StateDict) -> int:
    """The number of shared weights: the length of the vector the distributed mechanism encodes."""
    return sum(v.numel() for v in shared.values())


class ClientLevelDP:
    """What one run's client-level DP derives from its config, and its server step."""

    def __init__(self, cfg: ExperimentConfig, num_clients: int, dim: int = 0):
        """``dim``: the number of shared weights (the distributed mechanism's vector; unused by the central)."""
        p, t = cfg.privacy, cfg.train
        self.config, self.seed, self.num_clients = p, cfg.seed, num_clients
        # Poisson: each client at rate q = train.client_fraction, q * clients expected; fixed: that many, rounded.
        # The sum of the clipped updates is divided by this number.
        if p.sampling == "poisson":
            self.rate, self.expected = t.client_fraction, t.client_fraction * num_clients
        else:
            self.expected = float(clients_per_round(num_clients, t.client_fraction))
            self.rate = self.expected / num_clients
        self.distributed = p.mechanism == "distributed_dgauss"
        if self.distributed and dim <= 0:
            raise ConfigError("privacy.mechanism: distributed_dgauss is accounted for a federation's model (its number "
                              "of shared weights), on Flower's SecAgg+ only: not in a Tune sweep or without a model")
        if self.distributed:
            mechanism = distributed_accounting.DistributedMechanism(
                p.noise_multiplier or 0.0, p.clip_norm, self.rate, self.expected, p.min_participants,
                p.max_participants or p.min_participants, p.bits or DEFAULT_BITS, dim)
            self._spent, calibrate = distributed_accounting.epsilon, distributed_accounting.noise_for_epsilon
        else:
            mechanism = Mechanism(p.noise_multiplier or 0.0, p.sampling, num_clients, self.rate, p.accountant)
            self._spent, calibrate = epsilon, noise_for_epsilon
        self.rounds = t.rounds  # the rounds this run trains: fewer where the budget runs out first
        if p.noise_multiplier is None:
            try:
                mechanism = mechanism.with_noise(calibrate(mechanism, p.target_epsilon, p.delta, t.rounds))
            except ValueError as e:
                raise ConfigError(f"privacy.target_epsilon: {e}") from None
        elif p.target_epsilon is not None:
            self.rounds = rounds_within(mechanism, p.target_epsilon, p.delta, t.rounds, self._spent)
            if self.rounds == 0:
                raise ConfigError(f"privacy.target_epsilon: one round at privacy.noise_multiplier="
                                  f"{p.noise_multiplier:g} already spends {self._spent(mechanism, 1, p.delta):.4g}")
        self.encoding: Encoding | None = None  # the distributed mechanism's grid and ring
        if self.distributed:
            try:
                self.encoding = mechanism.encoding()
            except ValueError as e:
                raise ConfigError(f"privacy.bits: {e}") from None
        self.mechanism = mechanism
        self.noise_multiplier = mechanism.noise_multiplier  # sigma, as set or derived
        self.update_noise = self.noise_multiplier  # the updates' own: more under adaptive clipping
        self.count_noise = 0.0
        if p.adaptive_clip is not None:
            self.count_noise = p.adaptive_clip.count_noise or self.expected / COUNT_NOISE_DIVISOR
            try:
                self.update_noise = update_noise_multiplier(self.noise_multiplier, self.count_noise)
            except ValueError as e:
                raise ConfigError(f"privacy.adaptive_clip.count_noise: {e}; raise it, or lower the noise "
                                  "multiplier") from None
        self.seeded = p.noise_seed is not None
        self.secure_noise = None if self.seeded else SecureNoise()

    def epsilon(self, rounds: int) -> float:
        """Epsilon at ``privacy.delta`` after ``rounds`` rounds."""
        return self._spent(self.mechanism, rounds, self.config.delta)

    def distributed_round(self, round_idx: int) -> DistributedRound:
        """What the participants of round ``round_idx`` of the distributed mechanism need: the grid and ring, the
        rotation's seed (public, from the run's seed) and, with ``privacy.noise_seed``, the seed their noise is
        derived from (None: each draws from the OS's CSPRNG)."""
        noise = None if not self.seeded else derived_seed(self.config.noise_seed, round_idx, NOISE_TAG)
        return DistributedRound(self.encoding, derived_seed(self.seed, round_idx, ROTATION_TAG), noise)

    def sample(self, round_idx: int) -> list[int]:
        """The round's clients, drawn as the accountant assumes: from the OS's CSPRNG, or seeded by (seed, round)
        with ``privacy.noise_seed``."""
        poisson = self.config.sampling == "poisson"
        if self.seeded:
            draw = poisson_sample if poisson else sample_clients
            return draw(self.seed, round_idx, self.num_clients, self.rate)
        if poisson:
            return secure_poisson_sample(self.num_clients, self.rate)
        return secure_sample(self.num_clients, round(self.expected))

    def init_state(self) -> StateDict:
        if self.config.adaptive_clip is None:
            return {}
        return {CLIP_NORM: torch.tensor(self.config.clip_norm, dtype=torch.float64)}

    def clip_norm(self, state: StateDict) -> float:
        """The clip norm of the round that ``state`` (the server's DP state) starts."""
        return float(state[CLIP_NORM]) if self.config.adaptive_clip is not None else self.config.clip_norm

    def aggregate(self, total: StateDict | None, count: int, unclipped: int, anchor: StateDict, state: StateDict,
                  round_idx: int) -> tuple[StateDict, StateDict]:
        """(the new shared weights, the new DP state) from the float64 sum ``total`` of the ``count`` clipped
        uploads of round ``round_idx``, ``unclipped`` of which were within the clip norm, and the round's
        global weights ``anchor``: ``privacy.noised_mean``, then adaptive clipping's next clip norm, both
        with this round's noise."""
        noise = self.secure_noise or SeededNoise(derived_seed(self.config.noise_seed, round_idx, NOISE_TAG))
        clip = self.clip_norm(state)
        # Without noise, S may be infinite; under the distributed mechanism the participants added it.
        std = self.update_noise * clip if self.update_noise and not self.distributed else 0.0
        weights = noised_mean(total, count, anchor, self.expected, std, noise)
        a = self.config.adaptive_clip
        if a is None:
            return weights, state
        new = adapted_clip_norm(clip, unclipped, count, self.expected, a.target_quantile, a.learning_rate,
                                self.count_noise, noise)
        return weights, {CLIP_NORM: torch.tensor(new, dtype=torch.float64)}

    def guarantee(self, rounds: int) -> Privacy:
        """The guarantee of a model after ``rounds`` rounds, as ``final/meta.json`` states it."""
        p, eps = self.config, self.epsilon(rounds)
        return Privacy(epsilon=eps if math.isfinite(eps) else None, delta=p.delta,
                       noise_multiplier=self.noise_multiplier,
                       clip_norm=p.clip_norm if math.isfinite(p.clip_norm) else None,
                       adaptive_clip=p.adaptive_clip is not None, sampling=p.sampling,
                       sampling_rate=self.rate, accountant=p.accountant,
                       noise="seeded" if self.seeded else "secure")
