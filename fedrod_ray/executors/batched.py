"""The batched executor (``runtime.batched_clients``).

``BatchedExecutor`` trains a round's clients a group at a time with ``batched.batched_local_update``
(the math), and falls back to one client at a time when a pass fails.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

from ..client_update.batched import BatchJob, batched_local_update
from ..client_update.local import LocalTrainingError, RoundInput
from ..clients.client import ClientFailure, ClientHost, clipped
from .base import Job, TrainOutcome
from .in_process import InProcessExecutor


class BatchedExecutor(InProcessExecutor):
    """The in-process executor, training up to ``max_clients`` of a round's clients at a time in one
    batched pass (``batched_local_update``) on the host's device; evaluation is the host's, as ever.

    Clients are grouped by shard size, so that a group's clients run about as many steps. Should a pass
    raise (say, out of GPU memory), its clients are trained one at a time instead, so that an error fails
    only its own client.
    """

    def __init__(self, host: ClientHost, max_clients: int):
        if max_clients < 1:
            raise ValueError(f"max_clients must be >= 1, got {max_clients}")
        super().__init__(host)
        self.max_clients = max_clients

    def train(self, round_idx, jobs: list[Job], message: RoundInput) -> Iterator[tuple[int, TrainOutcome]]:
        host = self.host
        batch_jobs: dict[int, BatchJob] = {}
        for slot, (cid, state) in enumerate(jobs):
            try:
                batch_jobs[slot] = BatchJob(
                    cid, host.data(cid), state.personal, state.rule_state,
                    state.local_model if host.rule.starts_from_local_model else None, state.momentum)
            except Exception as e:  # noqa: BLE001 - as ClientHost.train: reported, never fatal to the round
                yield slot, ClientFailure.from_exception(cid, e)
        slots = sorted(batch_jobs, key=lambda slot: -len(batch_jobs[slot].data))
        for start in range(0, len(slots), self.max_clients):
            group = slots[start:start + self.max_clients]
            try:
                outcomes = batched_local_update(
                    host.model, message, [batch_jobs[slot] for slot in group], host.cfg.train, host.rule,
                    round_idx=round_idx, seed=host.cfg.seed, mean=host.mean, std=host.std, augment=host.augment,
                    device=host.device)
            except Exception as e:  # noqa: BLE001 - fall back to one client at a time
                warnings.warn(f"batched local update of {len(group)} clients failed ({type(e).__name__}: {e}); "
                              "training them one at a time", RuntimeWarning, stacklevel=2)
                for slot in group:
                    yield slot, host.train(*jobs[slot], message, round_idx)
                continue
            for slot, out in zip(group, outcomes):
                cid, state = jobs[slot]
                if not isinstance(out, Exception):
                    try:
                        out = clipped(out, message)
                    except LocalTrainingError as e:  # a non-finite update: as ClientHost.train, a failure
                        out = e
                yield slot, (ClientFailure.from_exception(cid, out) if isinstance(out, Exception)
                             else state.trained(out))

