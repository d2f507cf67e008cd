"""Local-only training (the paper's "local only" baseline): no communication at all.

Every client trains alone: its first update starts from the initial weights (the server's, which never
change) and every later one from its own last local model. The server keeps the initial weights, so the
generic model is the untrained one and only the personalized models (each client's own model) mean
anything. A client still trains only in the rounds it is sampled, so local-only spends the same local
computation as the federated rows it is compared with.
"""

from __future__ import annotations

from .base import GenericRule
from .registry import register


@register
class LocalOnly(GenericRule):
    name = "local"
    starts_from_local_model = True

    def server_update(self, previous, averaged, uploads, num_participants, num_clients, server_state):
        return previous, server_state
