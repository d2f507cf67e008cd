"""Seeded client partitions: Dirichlet non-IID, IID, long tail, held-out new clients."""

from __future__ import annotations

import numpy as np
import pytest

from fedrod_ray.config import ConfigError, DataConfig, config_from_dict
from fedrod_ray.data import load_dataset
from fedrod_ray.data.partition import (
    Partition,
    class_counts,
    dirichlet_partition,
    format_partition,
    iid_partition,
    long_tail_indices,
    make_partition,
)


def labels_of(n=6000, classes=10, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, classes, n)


def assert_exact_cover(parts, n):
    for p in parts:
        assert p.dtype == np.int64 and np.all(np.diff(p) > 0)  # sorted, no duplicates within a client
    joined = np.concatenate(parts)
    assert len(joined) == n and np.array_equal(np.sort(joined), np.arange(n))


@pytest.mark.parametrize("alpha", [0.1, 1.0])
def test_dirichlet_deterministic_and_complete(alpha):
    y = labels_of()
    a = dirichlet_partition(y, 20, alpha, 10, seed=1)
    b = dirichlet_partition(y, 20, alpha, 10, seed=1)
    c = dirichlet_partition(y, 20, alpha, 10, seed=2)
    assert len(a) == 20 and all(np.array_equal(p, q) for p, q in zip(a, b))
    assert not all(np.array_equal(p, q) for p, q in zip(a, c))
    assert_exact_cover(a, len(y))


def test_dirichlet_min_per_client_with_tiny_alpha():
    y = labels_of(4000)
    plain = dirichlet_partition(y, 200, 0.01, 10, seed=0)
    assert min(map(len, plain)) < 15  # the constraint below has work to do
    parts = dirichlet_partition(y, 200, 0.01, 10, seed=0, min_per_client=15)
    assert min(map(len, parts)) >= 15
    assert_exact_cover(parts, len(y))
    # Top-ups come from one class of the donor at a time, so clients stay highly non-IID.
    assert (class_counts(y, parts, 10) > 0).sum(1).mean() < 3
    exact = dirichlet_partition(y, 200, 0.01, 10, seed=0, min_per_client=20)  # 200 * 20 == 4000
    assert all(len(p) == 20 for p in exact)
    with pytest.raises(ValueError, match="cannot give 200 clients 21"):
        dirichlet_partition(y, 200, 0.01, 10, seed=0, min_per_client=21)


def test_dirichlet_alpha_controls_heterogeneity():
    y = labels_of(20000)
    global_p = np.bincount(y, minlength=10) / len(y)
    near_iid = class_counts(y, dirichlet_partition(y, 10, 1000.0, 10, seed=0), 10)
    props = near_iid / near_iid.sum(1, keepdims=True)
    assert np.abs(props - global_p).max() < 0.03
    skewed = class_counts(y, dirichlet_partition(y, 10, 0.1, 10, seed=0), 10)
    skewed_props = skewed / np.maximum(skewed.sum(1, keepdims=True), 1)
    assert np.abs(skewed_props - global_p).max() > 0.3


def test_iid_sizes_equal_within_one():
    y = labels_of(1003)
    parts = iid_partition(y, 10, seed=0)
    assert {len(p) for p in parts} == {100, 101}
    assert_exact_cover(parts, len(y))
    assert all(np.array_equal(p, q) for p, q in zip(parts, iid_partition(y, 10, seed=0)))
    assert not np.array_equal(parts[0], iid_partition(y, 10, seed=1)[0])


@pytest.mark.parametrize("ratio", [10.0, 100.0])
def test_long_tail_counts_follow_formula(ratio):
    y = np.repeat(np.arange(10), 500)
    keep = long_tail_indices(y, 10, ratio, seed=0)
    expected = [int(np.floor(500 * ratio ** (-c / 9))) for c in range(10)]
    assert np.bincount(y[keep], minlength=10).tolist() == expected
    assert expected[0] == 500 and expected[-1] == int(500 / ratio)
    assert keep.dtype == np.int64 and np.all(np.diff(keep) > 0)
    assert np.array_equal(keep, long_tail_indices(y, 10, ratio, seed=0))
    assert not np.array_equal(keep, long_tail_indices(y, 10, ratio, seed=1))
    assert len(long_tail_indices(y, 10, 1.0, seed=0)) == len(y)


def test_class_counts():
    y = np.array([0, 1, 1, 2, 2, 2])
    counts = class_counts(y, [np.array([0, 1]), np.array([2, 3, 4, 5])], 4)
    assert counts.dtype == np.int64 and counts.tolist() == [[1, 1, 0, 0], [0, 1, 3, 0]]


def test_make_partition_new_clients():
    y = labels_of(5000)
    cfg = DataConfig(num_clients=12, new_clients=3, alpha=0.3, min_per_client=10)
    p = make_partition(cfg, y, 10, seed=0)
    assert isinstance(p, Partition) and p.num_clients == 15 and p.num_train_clients == 12
    assert p.train_client_ids == list(range(12)) and p.new_client_ids == [12, 13, 14]
    assert p.counts.shape == (15, 10) and np.array_equal(p.counts, class_counts(y, p.client_indices, 10))
    assert p.sizes.min() >= 10
    assert_exact_cover(p.client_indices, len(y))
    again = make_partition(cfg, y, 10, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(p.client_indices, again.client_indices))
    # Which clients are held out is drawn from the seed, so other seeds hold out other pieces.
    new_sets = []
    for seed in range(4):
        q = make_partition(cfg, y, 10, seed=seed)
        new_sets.append(frozenset(tuple(q.client_indices[m]) for m in q.new_client_ids))
    assert new_sets[0] == {tuple(p.client_indices[m]) for m in p.new_client_ids}
    assert len(set(new_sets)) == 4


def test_make_partition_iid_and_long_tail():
    y = np.repeat(np.arange(10), 300)
    p = make_partition(DataConfig(num_clients=7, partition="iid"), y, 10, seed=0)
    assert max(p.sizes) - min(p.sizes) <= 1 and p.new_client_ids == []
    assert_exact_cover(p.client_indices, len(y))
    lt = make_partition(DataConfig(num_clients=5, alpha=0.5, min_per_client=0, imbalance_ratio=10), y, 10, 0)
    totals = lt.counts.sum(0)
    assert totals.tolist() == [int(np.floor(300 * 10 ** (-c / 9))) for c in range(10)]
    joined = np.concatenate(lt.client_indices)
    assert len(np.unique(joined)) == len(joined) == totals.sum()


def test_make_partition_rejects_unknown_scheme():
    with pytest.raises(ValueError, match="unknown partition"):
        make_partition(DataConfig(num_clients=2, partition="shards"), labels_of(100), 10, 0)


def test_format_partition_table_and_summary():
    y = labels_of(2000)
    p = make_partition(DataConfig(num_clients=5, new_clients=2, alpha=0.5, min_per_client=5), y, 10, 0)
    text = format_partition(p)
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["client", "kind", "n", "c0"] and lines[0].split()[-1] == "c9"
    rows = [line.split() for line in lines[1:8]]
    assert [r[1] for r in rows] == ["train"] * 5 + ["new"] * 2
    assert [int(r[2]) for r in rows] == p.sizes.tolist()
    assert [list(map(int, r[3:])) for r in rows] == p.counts.tolist()
    sizes = p.sizes
    assert "clients: 7 (5 train, 2 new)" in text
    assert f"min {sizes.min()}, median {float(np.median(sizes)):g}, max {sizes.max()}" in text
    assert f"classes per client: mean {(p.counts > 0).sum(1).mean():.2f} of 10" in text
    assert "new clients: 5, 6" in text


def test_an_empty_client_is_an_error_naming_min_per_client():
    y = np.repeat(np.arange(10), 5)
    with pytest.raises(ConfigError, match=r"data.min_per_client: this split leaves client\(s\) \[.*\] with no examples"):
        make_partition(DataConfig(num_clients=40, alpha=0.05), y, 10, 0)
    assert make_partition(DataConfig(num_clients=40, alpha=0.05, min_per_client=1), y, 10, 0).sizes.min() == 1


def test_min_per_client_has_no_effect_with_iid():
    with pytest.raises(ConfigError, match="data.min_per_client: has no effect with data.partition=iid"):
        config_from_dict({"data": {"partition": "iid", "min_per_client": 5}})


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fmnist_dir03_splits_never_need_the_top_up(shared_data_dir, seed):
    """The protocol audit's claim: on Fashion-MNIST under Dir(0.3) (100 clients, or 50 + 50 new, with or
    without Meta-BSM's meta set) every client already has >= 10 examples, so data.min_per_client 0 (the
    paper's) and 10 (earlier versions') give the same split, and the main and new-client tables need no run
    under both."""
    labels = load_dataset(DataConfig(dataset="fmnist", data_dir=str(shared_data_dir), download=False)).train_y.numpy()
    for clients, new in ((100, 0), (50, 50)):
        for meta in (0, 10):
            parts = [make_partition(DataConfig(dataset="fmnist", num_clients=clients, new_clients=new, alpha=0.3,
                                               min_per_client=k), labels, 10, seed, meta) for k in (0, 10)]
            assert all(np.array_equal(a, b) for a, b in zip(parts[0].client_indices, parts[1].client_indices))
