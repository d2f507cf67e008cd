"""A federation's evaluation where P-FL is computed where the clients are (an executor that
``evaluates_at_clients``: at sites, docs/sites.md): G-FL of the generic model on the server's test set, here;
P-FL of the GM and of the clients' personalized models where the clients are, on their own test sets or on the
server's test set re-weighted there by each client's class distribution. The server receives sums and divides;
the record says where each figure was computed (``gfl_at``, ``pfl_at``).
"""

from __future__ import annotations

from collections.abc import Callable

from ..executors.base import Executor
from ..federation_state.client_store import ClientStore
from ..federation_state.setup import Setup
from ..models import FedModel
from ..models.metrics import accuracy, class_correct, features_and_logits
from ..personalization import Personalization, generic_weights
from ..server_math.aggregate import StateDict


class RemoteEvaluation:
    """``evaluation.Evaluation``'s role for an executor that ``evaluates_at_clients`` (``Executor.pfl_sums``)."""

    def __init__(self, setup: Setup, model: FedModel, method: Personalization, initial: StateDict,
                 log: Callable[[str], None]):
        self.setup, self.cfg, self.model, self.method, self.initial, self.log = (
            setup, setup.cfg, model, method, initial, log)

    def clear(self) -> None:
        """Nothing is cached here (the runtime keeps its PMs' counts, by the state they came from)."""

    def evaluate(self, executor: Executor, global_shared: StateDict, clients: ClientStore, method_state: StateDict,
                 round_idx: int, final: bool = False) -> dict:
        """The metrics of the GM ``global_shared`` and of the clients' PMs after round ``round_idx`` (0-based)."""
        test = self.setup.test
        generic = generic_weights(self.method, self.model.personal_keys(), global_shared, clients, self.initial,
                                  self.setup.num_clients)
        self.model.load_partial(generic)
        _, logits = features_and_logits(self.model, test, self.cfg.eval.batch_size)
        correct, total = class_correct(logits.argmax(1), test.y, test.num_classes)
        versions = {cid: clients.rounds_trained(cid) for cid in self.setup.all_client_ids}
        remote = executor.pfl_sums(global_shared, method_state, round_idx + 1, versions)
        for cid, error in sorted(remote.failed.items()):
            self.log(f"client {cid}: personalized model not evaluated: {error}")
        out = {"gfl_gm": accuracy(correct, total)}
        for key, (value, count) in remote.sums.items():
            out[key] = value / count if count else float("nan")
        out["pm_eval_failed"] = len(remote.failed)
        out["pm_eval_unavailable"] = len(remote.unavailable)  # clients that are away: not in the P-FL means
        out.update(gfl_at="server: its test set", pfl_at=remote.where)
        return out
