"""G-FL and P-FL accuracy (docs/method.md, "Evaluation").

Everything reduces to per-class (correct, total) counts on the test set. P-FL for client m is

    sum_i P_m(y_i) 1[pred_i = y_i] / sum_i P_m(y_i) = (a_m . correct) / (a_m . total),

so the generic model needs one pass over the test set for all clients, and a personalized model only
needs the test examples of the classes its client has (a_m[c] = 0 contributes nothing).

Natural clients may have test sets of their own (``TestSet.clients``): client m's P-FL is then its plain
accuracy on them, which is the same formula with per-client counts of its own examples and weights
a_m = 1 (``pfl_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import FedModel


@dataclass
class TestSet:
    x: torch.Tensor  # normalised float32, N x C x H x W
    y: torch.Tensor  # int64
    num_classes: int
    # Natural clients' own test sets: each example's client id (int64); None: the test set is every client's.
    clients: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # Kept sorted by label so that one class's examples are a contiguous slice: views, not copies,
        # which matters when many actors share one read-only copy from the object store.
        if len(self.y) > 1 and not bool((self.y[1:] >= self.y[:-1]).all()):
            order = torch.argsort(self.y, stable=True)
            self.x, self.y = self.x[order], self.y[order]
            if self.clients is not None:
                self.clients = self.clients[order]
        bounds = torch.bincount(self.y, minlength=self.num_classes).cumsum(0)
        self._starts = torch.cat([torch.zeros(1, dtype=torch.long), bounds[:-1]]).tolist()
        self._ends = bounds.tolist()
        self._rows: dict[int, torch.Tensor] = {}

    def rows(self, client: int) -> torch.Tensor:
        """The indices of client ``client``'s own test examples (``clients`` must be set)."""
        if self.clients is None:
            raise ValueError("this test set has no per-client test sets")
        if not self._rows:
            order = torch.argsort(self.clients, stable=True)
            sizes = torch.bincount(self.clients).tolist()
            self._rows = dict(enumerate(torch.split(order, sizes)))
        return self._rows.get(client, torch.empty(0, dtype=torch.long))

    def pfl_weights(self, class_dists: torch.Tensor) -> torch.Tensor:
        """The weights P-FL gives each client's per-class counts (``pfl_accuracy``): its class distribution on
        the shared test set, ones on its own test set (plain accuracy)."""
        return class_dists if self.clients is None else torch.ones_like(class_dists)

    def classes(self, classes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The test examples whose label is in ``classes`` (contiguous slices, no copy for one class)."""
        xs = [self.x[self._starts[c]:self._ends[c]] for c in classes]
        ys = [self.y[self._starts[c]:self._ends[c]] for c in classes]
        if len(classes) == 1:
            return xs[0], ys[0]
        return torch.cat(xs), torch.cat(ys)


def stratified_sample(labels: torch.Tensor, num_classes: int, size: int, seed: int) -> torch.Tensor:
    """Sorted indices of ``size`` examples, as many of each class as can be (the first ``size % C``
    classes one more), drawn without replacement by a generator seeded with ``seed``: the same sample on
    every machine and at every round. Class-balanced, so that its per-class counts estimate the test
    set's per-class accuracy evenly, which is all P-FL reads."""
    per_class, extra = divmod(size, num_classes)
    have = torch.bincount(labels, minlength=num_classes)
    want = torch.tensor([per_class + (c < extra) for c in range(num_classes)])
    short = torch.nonzero(want > have).flatten().tolist()
    if short:
        c = short[0]
        raise ValueError(f"eval.estimate_size={size} asks for {int(want[c])} test images of class {c}, which has "
                         f"only {int(have[c])}; at most {num_classes * int(have.min())} fit every class evenly")
    gen = torch.Generator().manual_seed(seed)
    picked = []
    for c in range(num_classes):
        rows = torch.nonzero(labels == c).flatten()
        picked.append(rows[torch.randperm(len(rows), generator=gen)[:int(want[c])]])
    return torch.sort(torch.cat(picked)).values


def class_correct(preds: torch.Tensor, labels: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class number of correct predictions and of examples (both float64, length C)."""
    labels = labels.to(preds.device)
    total = torch.bincount(labels, minlength=num_classes)
    correct = torch.bincount(labels[preds == labels], minlength=num_classes)
    return correct.to(torch.float64).cpu(), total.to(torch.float64).cpu()


def accuracy(correct: torch.Tensor, total: torch.Tensor) -> float:
    """Plain accuracy from per-class counts (G-FL when the counts come from the balanced test set)."""
    return float(correct.sum() / total.sum().clamp_min(1))


def pfl_accuracy(correct: torch.Tensor, total: torch.Tensor, class_dist: torch.Tensor) -> torch.Tensor:
    """P-FL accuracy of each client: (a_m . correct) / (a_m . total).

    ``correct`` and ``total`` are (C,) for one model shared by all clients, or (M, C) for one model per
    client; ``class_dist`` is (M, C). Returns (M,).
    """
    dist = class_dist.to(torch.float64)
    return (dist * correct).sum(-1) / (dist * total).sum(-1).clamp_min(1e-12)


@torch.inference_mode()
def predict(model: FedModel, x: torch.Tensor, batch_size: int, personal: bool = False,
            class_dist: torch.Tensor | None = None) -> torch.Tensor:
    """Argmax predictions of the generic (or personalized) logits, in batches."""
    model.eval()
    device = next(model.parameters()).device
    own = personal and model.readout is not None  # the method's readout makes the PM's logits
    phi = (model.personal_weight(class_dist.to(device) if class_dist is not None else None)
           if personal and not own else None)
    preds = []
    for start in range(0, len(x), batch_size):
        xb = x[start:start + batch_size].to(device).contiguous(memory_format=torch.channels_last)
        z = model.features(xb)
        logits = model.readout.personal_logits(model, z) if own else model.generic_logits(z)
        if phi is not None:
            logits = logits + z @ phi.T
        preds.append(logits.argmax(1))
    return torch.cat(preds) if preds else torch.empty(0, dtype=torch.long, device=device)


@torch.inference_mode()
def features_and_logits(model: FedModel, test: TestSet, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Features z = f(x; theta) and generic logits h_G(z) of the whole test set, on CPU."""
    model.eval()
    device = next(model.parameters()).device
    zs, logits = [], []
    for start in range(0, len(test.x), batch_size):
        xb = test.x[start:start + batch_size].to(device).contiguous(memory_format=torch.channels_last)
        z = model.features(xb)
        zs.append(z.cpu())
        logits.append(model.generic_logits(z).cpu())
    return torch.cat(zs), torch.cat(logits)


def personal_class_correct(model: FedModel, test: TestSet, class_dist: torch.Tensor, batch_size: int,
                           personal: bool, client: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-class counts of a client's own model: on its own test examples where the test set has per-client
    ones (``client``: its id), else on the test classes that client has."""
    if test.clients is not None:
        if client is None:
            raise ValueError("a test set with per-client test sets needs the client's id")
        rows = test.rows(client)
        x, y = test.x[rows], test.y[rows]
    else:
        classes = torch.nonzero(class_dist > 0).flatten().tolist()
        if not classes:
            zeros = torch.zeros(test.num_classes, dtype=torch.float64)
            return zeros, zeros.clone()
        x, y = test.classes(classes)
    return class_correct(predict(model, x, batch_size, personal, class_dist), y, test.num_classes)


def clients_class_correct(preds: torch.Tensor, test: TestSet, clients: list[int]
                          ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Per-class counts of ``preds`` (one per test example) on each of ``clients``' own test examples."""
    correct, total = {}, {}
    for cid in clients:
        rows = test.rows(cid)
        correct[cid], total[cid] = class_correct(preds[rows], test.y[rows], test.num_classes)
    return correct, total
