"""Seeded splits of a training set over federated clients: Dirichlet non-IID, IID, natural (the clients the
data names), long-tailed, held-out."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from fedrod_ray.config import ConfigError

if TYPE_CHECKING:
    from fedrod_ray.config import DataConfig


def _subseed(seed: int, purpose: int) -> int:
    # Independent streams per step, so changing e.g. new_clients leaves the long-tail subset unchanged.
    return int(np.random.SeedSequence([seed, purpose]).generate_state(1)[0])


def _finish(parts: list[np.ndarray]) -> list[np.ndarray]:
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def dirichlet_partition(
    labels: np.ndarray, num_clients: int, alpha: float, num_classes: int, seed: int, min_per_client: int = 0
) -> list[np.ndarray]:
    """Per class c, q_c ~ Dir(alpha * 1_M); client m gets the fraction q_c[m] of class c's examples.

    Clients left below ``min_per_client`` are then topped up from the largest clients, taking from
    the donor's most frequent class, which keeps the split non-IID and needs no resampling loop.
    """
    labels = np.asarray(labels)
    if num_clients < 1:
        raise ValueError(f"num_clients must be >= 1, got {num_clients}")
    if num_clients * min_per_client > len(labels):
        raise ValueError(
            f"cannot give {num_clients} clients {min_per_client} examples each from {len(labels)} examples"
        )
    rng = np.random.default_rng(seed)
    # chunks[m][c]: client m's examples of class c
    chunks: list[dict[int, np.ndarray]] = [{} for _ in range(num_clients)]
    for c in range(num_classes):
        idx = np.flatnonzero(labels == c)
        rng.shuffle(idx)
        q = rng.dirichlet(np.full(num_clients, alpha))
        if not np.all(np.isfinite(q)) or q.sum() <= 0:
            # Very small alpha can underflow every gamma draw; the limit of Dir(alpha) is then one client.
            q = np.eye(num_clients)[rng.integers(num_clients)]
        cuts = np.round(np.cumsum(q)[:-1] * len(idx)).astype(np.int64)
        for m, part in enumerate(np.split(idx, cuts)):
            if len(part):
                chunks[m][c] = part
    _top_up(chunks, min_per_client)
    return _finish([np.concatenate(list(ch.values())) if ch else np.empty(0, np.int64) for ch in chunks])


def _top_up(chunks: list[dict[int, np.ndarray]], minimum: int) -> None:
    sizes = np.array([sum(len(p) for p in ch.values()) for ch in chunks], dtype=np.int64)
    # Each step moves at least one example into a client that needs it, so this ends after at most
    # num_clients * minimum steps; a donor always exists because the total covers every minimum.
    for r in np.argsort(sizes, kind="stable"):
        while sizes[r] < minimum:
            donor = int(np.argmax(sizes))
            c = max(chunks[donor], key=lambda k: (len(chunks[donor][k]), -k))
            k = int(min(minimum - sizes[r], sizes[donor] - minimum, len(chunks[donor][c])))
            moved, kept = chunks[donor][c][:k], chunks[donor][c][k:]
            if len(kept):
                chunks[donor][c] = kept
            else:
                del chunks[donor][c]
            chunks[r][c] = np.concatenate([chunks[r].get(c, np.empty(0, np.int64)), moved])
            sizes[donor] -= k
            sizes[r] += k


def iid_partition(labels: np.ndarray, num_clients: int, seed: int) -> list[np.ndarray]:
    """Uniformly random split into ``num_clients`` parts whose sizes differ by at most one."""
    perm = np.random.default_rng(seed).permutation(len(labels))
    return _finish(np.array_split(perm, num_clients))


def natural_partition(owners: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Client k's examples are exactly those ``owners`` assigns to k (0..num_clients-1)."""
    owners = np.asarray(owners)
    order = np.argsort(owners, kind="stable")
    cuts = np.cumsum(np.bincount(owners, minlength=num_clients))[:-1]
    return _finish(np.split(order, cuts))


def long_tail_indices(labels: np.ndarray, num_classes: int, imbalance_ratio: float, seed: int) -> np.ndarray:
    """Sorted indices of a random subset where class c keeps floor(n_max * ratio^(-c / (C - 1))).

    n_max is the largest class count; a class that already has fewer examples keeps all of them.
    """
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    counts = np.bincount(labels, minlength=num_classes)
    n_max = counts.max() if len(counts) else 0
    keep = []
    for c in range(num_classes):
        idx = np.flatnonzero(labels == c)
        exponent = -c / (num_classes - 1) if num_classes > 1 else 0.0
        target = min(len(idx), int(np.floor(n_max * imbalance_ratio**exponent)))
        keep.append(rng.choice(idx, size=target, replace=False))
    return np.sort(np.concatenate(keep).astype(np.int64)) if keep else np.empty(0, np.int64)


def meta_set_indices(labels: np.ndarray, num_classes: int, per_class: int, seed: int) -> np.ndarray:
    """Sorted indices of a balanced random subset: ``per_class`` examples of every class (a meta set)."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    picked = []
    for c in range(num_classes):
        idx = np.flatnonzero(labels == c)
        if len(idx) < per_class:
            raise ValueError(f"train.meta_bsm.meta_per_class={per_class}: class {c} has only {len(idx)} "
                             "training examples")
        picked.append(rng.choice(idx, size=per_class, replace=False))
    return np.sort(np.concatenate(picked).astype(np.int64))


def class_counts(labels: np.ndarray, client_indices: list[np.ndarray], num_classes: int) -> np.ndarray:
    """M x C int64 matrix of how many examples of each class each client holds."""
    labels = np.asarray(labels)
    out = np.zeros((len(client_indices), num_classes), dtype=np.int64)
    for m, idx in enumerate(client_indices):
        out[m] = np.bincount(labels[idx], minlength=num_classes)[:num_classes]
    return out


@dataclass
class Partition:
    client_indices: list[np.ndarray]  # into the training set; training clients first, then new clients
    counts: np.ndarray  # (num_train_clients + new clients) x C
    num_train_clients: int
    # Natural clients: client m's name in the data (its folder or client_train id); else empty.
    client_names: tuple[str, ...] = ()
    # The balanced meta set a local objective learns against (``fedrod_ray.objectives``), held by the server:
    # training-set rows that no client holds.
    meta_indices: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    # Natural clients with test sets of their own: each test example's client (its id here), and each client's
    # test class counts (clients x C); else None.
    test_clients: np.ndarray | None = None
    test_counts: np.ndarray | None = None

    @property
    def num_clients(self) -> int:
        return len(self.client_indices)

    @property
    def train_client_ids(self) -> list[int]:
        return list(range(self.num_train_clients))

    @property
    def new_client_ids(self) -> list[int]:
        return list(range(self.num_train_clients, self.num_clients))

    @property
    def sizes(self) -> np.ndarray:
        return self.counts.sum(axis=1)


# size: each argument is a source of the split (labels, owners, test owners, the meta set), all optional but the
# labels
def make_partition(cfg: DataConfig, train_labels: np.ndarray, num_classes: int, seed: int,
                   meta_per_class: int = 0, owners: np.ndarray | None = None,
                   owner_names: tuple[str, ...] = (), test_labels: np.ndarray | None = None,
                   test_owners: np.ndarray | None = None) -> Partition:
    """Take out the meta set (``meta_per_class`` > 0: a local objective's, e.g. Meta-BSM), long-tail (if ``cfg.imbalance_ratio > 1``),
    split over ``num_clients + new_clients``, hold some out.

    Which clients are held out is a seeded random choice, so new clients are not systematically the
    last (or first) pieces of the split. The meta set is balanced whatever the long tail does to the rest;
    without one, the partition is exactly what it would be without this step.

    ``data.partition: natural`` takes the clients from ``owners`` (each example's client, an index into
    ``owner_names``), whole: the held-out new clients are natural clients too. With ``test_owners`` (each
    test example's client, likewise), each client, held out or not, also keeps its own test examples (with
    ``test_labels``, their labels). Other partitions make clients of their own, for which the data's test
    owners mean nothing, as its training owners do not.
    """
    labels = np.asarray(train_labels)
    total = cfg.num_clients + cfg.new_clients
    if cfg.partition == "natural":
        part = _natural(cfg, labels, num_classes, seed, owners, owner_names)
        if test_owners is not None:
            # Client m of the partition is the data's client order[m]: its test examples go with it.
            index = {name: k for k, name in enumerate(owner_names)}
            order = np.array([index[name] for name in part.client_names], dtype=np.int64)
            position = np.empty_like(order)
            position[order] = np.arange(len(order))
            part.test_clients = position[np.asarray(test_owners)]
            part.test_counts = class_counts(np.asarray(test_labels), natural_partition(part.test_clients, total),
                                            num_classes)
        return part
    pool = np.arange(len(labels), dtype=np.int64)
    meta = np.empty(0, np.int64)
    if meta_per_class > 0:
        meta = meta_set_indices(labels, num_classes, meta_per_class, _subseed(seed, 3))
        pool = np.setdiff1d(pool, meta)
    if cfg.imbalance_ratio > 1:
        pool = pool[long_tail_indices(labels[pool], num_classes, cfg.imbalance_ratio, _subseed(seed, 0))]
    if cfg.partition == "dirichlet":
        parts = dirichlet_partition(
            labels[pool], total, cfg.alpha, num_classes, _subseed(seed, 1), cfg.min_per_client
        )
    elif cfg.partition == "iid":
        parts = iid_partition(labels[pool], total, _subseed(seed, 1))
    else:
        raise ValueError(f"unknown partition {cfg.partition!r}; choose dirichlet or iid")
    order = _train_then_new(total, cfg.new_clients, seed)
    client_indices = [pool[parts[m]] for m in order]
    empty = [m for m, idx in enumerate(client_indices) if len(idx) == 0]
    if empty:
        # Its class distribution, its P-FL weights and its aggregation weight would all be 0/0.
        raise ConfigError(f"data.min_per_client: this split leaves client(s) {empty[:10]} with no examples; "
                          "set data.min_per_client to at least 1 (or use another seed or data.alpha)")
    return Partition(client_indices, class_counts(labels, client_indices, num_classes), cfg.num_clients,
                     meta_indices=meta)


def _train_then_new(total: int, new_clients: int, seed: int) -> np.ndarray:
    """The split's pieces reordered: training clients first, then the seeded random choice of new ones."""
    held_out = np.random.default_rng(_subseed(seed, 2)).permutation(total)[:new_clients]
    is_new = np.zeros(total, dtype=bool)
    is_new[held_out] = True
    return np.concatenate([np.flatnonzero(~is_new), np.flatnonzero(is_new)])


def _natural(cfg: DataConfig, labels: np.ndarray, num_classes: int, seed: int, owners: np.ndarray | None,
             names: tuple[str, ...]) -> Partition:
    if owners is None:
        raise ConfigError(f"data.partition: natural needs data that names its clients (data.dataset=folder with "
                          f"clients/<client>/<class>/, or arrays with client_train), not {cfg.dataset}")
    total = len(names)
    if cfg.num_clients + cfg.new_clients != total:
        raise ConfigError(f"data.num_clients: the data holds {total} natural clients, so data.num_clients + "
                          f"data.new_clients must be {total}, not {cfg.num_clients} + {cfg.new_clients}")
    parts = natural_partition(owners, total)
    empty = [names[k] for k, p in enumerate(parts) if len(p) == 0]
    if empty:
        raise ConfigError(f"data.path: natural client(s) {empty[:10]} hold no training examples")
    order = _train_then_new(total, cfg.new_clients, seed)
    client_indices = [parts[k] for k in order]
    return Partition(client_indices, class_counts(labels, client_indices, num_classes), cfg.num_clients,
                     tuple(names[k] for k in order))


def format_partition(p: Partition) -> str:
    """Per-client class-count table and a summary, for ``fedrod-ray partition``."""
    num_classes = p.counts.shape[1]
    sizes = p.sizes
    width = max(4, len(str(int(p.counts.max(initial=0)))) + 1)
    # Natural clients also show the name the data gives them.
    names = [f" {n:>{max(4, *map(len, p.client_names))}}" for n in p.client_names] or [""] * p.num_clients
    name_head = f" {'name':>{len(names[0]) - 1}}" if p.client_names else ""
    # Clients with test sets of their own: each one's number of test examples beside its training examples.
    own_tests = p.test_counts is not None
    tests = [f" {int(n):>6}" for n in p.test_counts.sum(axis=1)] if own_tests else [""] * p.num_clients
    test_head = f" {'test':>6}" if own_tests else ""
    header = (f"{'client':>8}{name_head} {'kind':>5} {'n':>7}{test_head} "
              + "".join(f"{f'c{c}':>{width}}" for c in range(num_classes)))
    lines = [header]
    for m in range(p.num_clients):
        kind = "new" if m >= p.num_train_clients else "train"
        row = "".join(f"{int(v):>{width}}" for v in p.counts[m])
        lines.append(f"{m:>8}{names[m]} {kind:>5} {int(sizes[m]):>7}{tests[m]} {row}")
    classes_per_client = (p.counts > 0).sum(axis=1)
    new = p.new_client_ids
    lines += [
        "",
        f"clients: {p.num_clients} ({p.num_train_clients} train, {len(new)} new)",
        (
            f"examples: {int(sizes.sum())} total; per client min {int(sizes.min())}, "
            f"median {float(np.median(sizes)):g}, max {int(sizes.max())}"
        ),
        f"classes per client: mean {classes_per_client.mean():.2f} of {num_classes}",
        f"global class counts: {' '.join(str(int(v)) for v in p.counts.sum(axis=0))}",
        f"new clients: {', '.join(map(str, new)) if new else 'none'}",
    ]
    if own_tests:
        test_sizes = p.test_counts.sum(axis=1)
        lines.append(f"own test sets: {int(test_sizes.sum())} examples; per client min {int(test_sizes.min())}, "
                     f"median {float(np.median(test_sizes)):g}, max {int(test_sizes.max())} (P-FL: each client's "
                     "accuracy on its own)")
    if len(p.meta_indices):
        lines.append(f"meta set (held by the server): {len(p.meta_indices)} examples, "
                     f"{len(p.meta_indices) // num_classes} per class")
    return "\n".join(lines)
