"""G-FL / P-FL accuracy (docs/method.md, "Evaluation") against brute-force definitions."""

from __future__ import annotations

import pytest
import torch

from fedrod_ray.models import build_model
from fedrod_ray.models.metrics import TestSet as EvalSet  # aliased so pytest does not collect it
from fedrod_ray.models.metrics import (
    accuracy,
    class_correct,
    personal_class_correct,
    pfl_accuracy,
    predict,
    stratified_sample,
)


def test_class_correct_by_hand():
    preds = torch.tensor([0, 1, 1, 2, 2, 0, 3])
    labels = torch.tensor([0, 1, 2, 2, 1, 0, 0])
    correct, total = class_correct(preds, labels, 5)
    assert correct.dtype == torch.float64 and total.dtype == torch.float64
    assert correct.tolist() == [2.0, 1.0, 1.0, 0.0, 0.0]
    assert total.tolist() == [3.0, 2.0, 2.0, 0.0, 0.0]
    assert accuracy(correct, total) == pytest.approx(4 / 7)


def _brute_pfl(preds: torch.Tensor, labels: torch.Tensor, dist: torch.Tensor) -> float:
    num = den = 0.0
    for p, y in zip(preds.tolist(), labels.tolist(), strict=True):
        w = float(dist[y])
        num += w * (p == y)
        den += w
    return num / den


def _random_setup(seed=0, n=60, classes=5):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, classes, (n,), generator=g)
    dist = torch.rand(3, classes, generator=g)
    dist[0, 1] = 0.0
    dist[2, [0, 3]] = 0.0
    dist = dist / dist.sum(1, keepdim=True)
    return g, labels, dist


def test_pfl_accuracy_shared_model_matches_brute_force():
    g, labels, dist = _random_setup()
    preds = torch.where(torch.rand(60, generator=g) < 0.6, labels, torch.randint(0, 5, (60,), generator=g))
    correct, total = class_correct(preds, labels, 5)
    got = pfl_accuracy(correct, total, dist)
    assert got.shape == (3,)
    expected = [_brute_pfl(preds, labels, dist[m]) for m in range(3)]
    assert got.tolist() == pytest.approx(expected, rel=1e-12)
    # the clients really differ (the weighting matters)
    assert max(expected) - min(expected) > 1e-3


def test_pfl_accuracy_per_client_models_match_brute_force():
    g, labels, dist = _random_setup(seed=1)
    preds = [torch.where(torch.rand(60, generator=g) < q, labels, torch.randint(0, 5, (60,), generator=g))
             for q in (0.2, 0.5, 0.9)]
    counts = [class_correct(p, labels, 5) for p in preds]
    correct = torch.stack([c for c, _ in counts])
    total = torch.stack([t for _, t in counts])
    got = pfl_accuracy(correct, total, dist)
    expected = [_brute_pfl(preds[m], labels, dist[m]) for m in range(3)]
    assert got.tolist() == pytest.approx(expected, rel=1e-12)


def test_client_ignores_classes_it_lacks():
    labels = torch.tensor([0, 0, 1, 1, 2, 2])
    dist = torch.tensor([[0.5, 0.5, 0.0]])
    good = torch.tensor([0, 1, 1, 1, 2, 2])  # 3/4 right on classes 0 and 1
    bad_on_2 = torch.tensor([0, 1, 1, 1, 0, 0])  # differs only on class 2
    a = pfl_accuracy(*class_correct(good, labels, 3), dist)
    b = pfl_accuracy(*class_correct(bad_on_2, labels, 3), dist)
    assert a.item() == pytest.approx(0.75)
    assert b.item() == pytest.approx(0.75)


def test_testset_classes_returns_exactly_those_examples():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (40,), generator=g)
    y[y == 2] = 1  # class 2 absent
    x = torch.arange(40, dtype=torch.float32).view(40, 1, 1, 1)  # x identifies the example
    test = EvalSet(x, y, 5)
    for classes in ([1, 3], [0], [3, 0, 1], [2], [2, 4], [0, 1, 2, 3, 4]):
        xs, ys = test.classes(classes)
        ids = sorted(int(v) for v in xs.flatten())
        expected = sorted(i for i in range(40) if int(y[i]) in classes)
        assert ids == expected, classes
        assert torch.equal(ys, y[xs.flatten().long()])


def _linear_model_with_heads(variant):
    model = build_model("mnist_cnn", 10, (1, 28, 28), variant, seed=0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        if variant == "linear":
            model.personal_head.weight.normal_(0, 1.0, generator=gen)
        else:
            model.hypernet.net[2].weight.normal_(0, 1.0, generator=gen)
    return model


@pytest.mark.parametrize("variant", ["linear", "hyper"])
def test_predict_personal_is_argmax_of_generic_plus_personal(variant):
    model = _linear_model_with_heads(variant)
    x = torch.randn(13, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    dist = torch.tensor([0.5, 0.0, 0.2, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0, 0.0])
    with torch.no_grad():
        model.eval()
        z = model.body(x)
        generic = z @ model.generic_head.weight.T
        phi = model.personal_head.weight if variant == "linear" else model.hypernet(dist)
        manual = (generic + z @ phi.T).argmax(1)
    got = predict(model, x, batch_size=4, personal=True, class_dist=dist)
    assert torch.equal(got, manual)
    assert torch.equal(predict(model, x, batch_size=5), generic.argmax(1))
    # the personal head matters here, so the two predictions differ
    assert not torch.equal(manual, generic.argmax(1))


def test_personal_class_correct_uses_only_the_clients_classes():
    model = _linear_model_with_heads("linear")
    g = torch.Generator().manual_seed(3)
    y = torch.arange(30) % 10
    x = torch.randn(30, 1, 28, 28, generator=g)
    test = EvalSet(x, y, 10)
    dist = torch.zeros(10)
    dist[[2, 7]] = 0.5
    correct, total = personal_class_correct(model, test, dist, batch_size=8, personal=True)
    assert total.tolist() == [0, 0, 3, 0, 0, 0, 0, 3, 0, 0]
    preds = predict(model, x, 30, personal=True, class_dist=dist)
    ok = (preds == y).double()
    expected = torch.zeros(10, dtype=torch.float64)
    for c in (2, 7):
        expected[c] = ok[y == c].sum()
    assert torch.equal(correct, expected)

    none_correct, none_total = personal_class_correct(model, test, torch.zeros(10), 8, True)
    assert none_total.sum() == 0 and none_correct.sum() == 0


def test_stratified_sample_is_class_balanced_seed_fixed_and_sorted():
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2])
    idx = stratified_sample(labels, 3, 7, seed=5)
    # 7 = 3 classes x 2 + 1: the first class gets the one left over.
    assert torch.bincount(labels[idx], minlength=3).tolist() == [3, 2, 2]
    assert idx.tolist() == sorted(set(idx.tolist()))
    assert torch.equal(idx, stratified_sample(labels, 3, 7, seed=5))
    assert any(not torch.equal(idx, stratified_sample(labels, 3, 7, seed=s)) for s in range(6, 12))
    # As many of a class as it has: all of them.
    assert stratified_sample(torch.tensor([0, 0, 1, 1, 2, 2]), 3, 6, seed=0).tolist() == [0, 1, 2, 3, 4, 5]
    nine = stratified_sample(labels, 3, 9, seed=0).tolist()
    assert len(nine) == 9 and {4, 5, 6} <= set(nine)  # class 1 has exactly three


def test_stratified_sample_larger_than_a_class_names_the_setting():
    labels = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2, 2])
    with pytest.raises(ValueError, match=r"eval.estimate_size=11 asks for 4 test images of class 1, which has only 3"):
        stratified_sample(labels, 3, 11, seed=0)
