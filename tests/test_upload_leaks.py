"""What a hyper client's upload tells whoever receives it (issue 60), from the attacker's side.

The hypernetwork's first layer is a bias-free linear map of the client's class distribution a_m, which is
the same at every local step, so each step's gradient of that layer is (something) x a_m^T and the client's
whole change to it is rank one with a_m as its row: the top right singular vector, scaled to sum to one and
times the upload's ``num_samples``, gives the client's exact class counts. Clipping (client-level DP)
only rescales the change. A sum over clients with different distributions is not rank one, and its top
singular vector is no client's distribution; but its row space is still the span of the summed clients'
distributions (which classes they hold, between them): docs/privacy.md says what hides what.
"""

from __future__ import annotations

import pytest
import torch
from test_federation import make_federation

from fedrod_ray.client_update.local import RoundInput
from fedrod_ray.clients.client import ClientState

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FIRST_LAYER = "hypernet.net.0.weight"  # (hidden, classes): h = W1 a, no bias


def recover_counts(change: torch.Tensor, num_samples: int) -> list[int]:
    """The attack: the class counts behind a change ``change`` to the hypernetwork's first layer, read as
    rank one (u a^T): a is the top right singular vector, signed and scaled to sum to one, times
    ``num_samples`` (sent with every upload), rounded."""
    _, _, vh = torch.linalg.svd(change.double(), full_matrices=False)
    v = vh[0]
    a = v / v.sum()  # the sign and the scale at once
    return [round(x) for x in (a * num_samples).tolist()]


def rank_one_share(change: torch.Tensor) -> float:
    """The share of ``change``'s energy in its top singular value: 1 for a rank-one matrix."""
    s = torch.linalg.svdvals(change.double())
    return float(s[0] ** 2 / (s ** 2).sum())


def test_recovery_by_hand():
    """The attack on matrices made by hand: u a^T gives back a's counts whatever u's sign and size. A sum of
    two such matrices of comparable size gives back neither's; one far larger than the other still gives
    back the larger one's: a sum hides a client only among contributions of its own size."""
    counts = torch.tensor([6.0, 0.0, 3.0, 1.0])
    change = torch.tensor([[0.5], [-2.0], [0.1]]) * (counts / counts.sum())
    assert recover_counts(change, 10) == [6, 0, 3, 1]
    assert recover_counts(-3 * change, 10) == [6, 0, 3, 1]
    other = torch.tensor([[2.0], [0.5], [0.3]]) * torch.tensor([0.0, 0.5, 0.0, 0.5])
    assert recover_counts(change + other, 10) not in ([6, 0, 3, 1], [0, 5, 0, 5])
    assert recover_counts(change + 0.01 * other, 10) == [6, 0, 3, 1]


@pytest.fixture(scope="module")
def uploads():
    """Real uploads of three of the in-process runtime's clients, hyper head, each client's true class counts,
    and the global weights they started from: the initial ones, but for the hypernetwork's output layer,
    which starts at zero (and so would the first layer's gradients) and is set as a round of training
    would have left it."""
    fed = make_federation("train.head=hyper", "train.local_epochs=2")
    start = {k: v.clone() for k, v in fed.global_shared.items()}
    start["hypernet.net.2.weight"].normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
    host = fed.executor.host
    out = {}
    for cid in range(3):
        result, _ = host.train(cid, ClientState(), RoundInput(start), 1)
        out[cid] = (result, host.data(cid).counts.tolist())
    return start, out


def _change(start, result):
    return result.shared[FIRST_LAYER].double() - start[FIRST_LAYER].double()


def test_one_clients_upload_gives_its_exact_class_counts(uploads):
    """The leak: from each client's upload alone, its exact class counts."""
    start, out = uploads
    for cid, (result, counts) in out.items():
        change = _change(start, result)
        assert rank_one_share(change) > 0.999, cid
        assert recover_counts(change, result.num_samples) == counts, cid


def test_a_sum_of_two_clients_gives_neither_clients_counts(uploads):
    """What a per-site sum (or SecAgg+'s total) of two clients with different distributions hides from this
    attack: the sum is not rank one, and what the attack reads from it is neither client's counts, at either
    client's sample count or the total. What it still shows: the sum's row space holds both distributions
    (which classes the pair holds), and its top singular vector is near the pair's pooled counts (for one
    pair here, exactly): the clients' changes share most of their direction, each about as long as its
    sample count. So a sum reveals the pooled counts, and whoever knows one client's counts (the other client
    of a pair) learns the other's: docs/privacy.md."""
    start, out = uploads
    pairs = [(i, j) for i in out for j in out if i < j and out[i][1] != out[j][1]]
    assert pairs
    for i, j in pairs:
        (ri, ci), (rj, cj) = out[i], out[j]
        total = _change(start, ri) + _change(start, rj)
        assert rank_one_share(total) < 0.999, (i, j)
        for n in (ri.num_samples, rj.num_samples, ri.num_samples + rj.num_samples):
            assert recover_counts(total, n) not in (ci, cj), (i, j, n)
        # The residual leak: each distribution lies in the sum's top-2 row space (but for weight decay's
        # own small change, which is not rank one).
        _, _, vh = torch.linalg.svd(total, full_matrices=False)
        basis = vh[:2]
        for counts in (ci, cj):
            a = torch.tensor(counts, dtype=torch.float64)
            a = a / a.norm()
            assert (a - basis.T @ (basis @ a)).norm() < 0.02, (i, j)
