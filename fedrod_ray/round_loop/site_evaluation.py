"""A federation's evaluation at sites (``data.dataset: sites``, docs/sites.md): G-FL of the generic model on
the server's test set, here; P-FL of the GM and of the clients' personalized models where the clients are,
on their own test sets or on the server's test set re-weighted there by each client's class distribution
(``clients.site_actor.SiteActorImpl.evaluate``). The server receives each site's sums and adds them up; the
record says where each figure was computed (``gfl_at``, ``pfl_at``).
"""

from __future__ import annotations

from collections.abc import Callable

from ..federation_state.client_store import ClientStore
from ..federation_state.site_setup import SiteSetup
from ..models import FedModel
from ..models.metrics import accuracy, class_correct, features_and_logits
from ..personalization import Personalization, generic_weights
from ..server_math.aggregate import StateDict


class SiteEvaluation:
    """``evaluation.Evaluation``'s role for a federation at sites (its executor a ``SitesExecutor``)."""

    def __init__(self, setup: SiteSetup, model: FedModel, method: Personalization, initial: StateDict,
                 log: Callable[[str], None]):
        self.setup, self.cfg, self.model, self.method, self.initial, self.log = (
            setup, setup.cfg, model, method, initial, log)
        own = {s.index.own_tests for s in setup.sites}
        mixed = "own test sets at some, the server's test set at others"
        where = {frozenset({True}): "own test sets", frozenset({False}): "the server's test set, re-weighted"}
        self.pfl_at = "sites: " + where.get(frozenset(own), mixed)

    def clear(self) -> None:
        """Nothing is cached here (each site keeps its PMs' counts, by the state they came from)."""

    def evaluate(self, executor, global_shared: StateDict, clients: ClientStore, method_state: StateDict,
                 round_idx: int, final: bool = False) -> dict:
        """The metrics of the GM ``global_shared`` and of the clients' PMs after round ``round_idx`` (0-based)."""
        test = self.setup.test
        generic = generic_weights(self.method, self.model.personal_keys(), global_shared, clients, self.initial,
                                  self.setup.num_clients)
        self.model.load_partial(generic)
        _, logits = features_and_logits(self.model, test, self.cfg.eval.batch_size)
        correct, total = class_correct(logits.argmax(1), test.y, test.num_classes)
        versions = {cid: clients.rounds_trained(cid) for cid in self.setup.all_client_ids}
        site = executor.site_evaluate(global_shared, method_state, round_idx + 1, versions)
        for cid, error in sorted(site["failed"].items()):
            self.log(f"client {cid}: personalized model not evaluated: {error}")
        out = {"gfl_gm": accuracy(correct, total)}
        for key, (value, count) in site["sums"].items():
            out[key] = value / count if count else float("nan")
        out["pm_eval_failed"] = len(site["failed"])
        out["pm_eval_unavailable"] = len(site["unavailable"])  # at sites that are away: not in the P-FL means
        out.update(gfl_at="server: its test set", pfl_at=self.pfl_at)
        return out
