"""Balanced risks (docs/method.md, "Losses") against hand computations on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedrod_ray.client_update.losses import (
    BALANCED_LOSSES,
    balanced_softmax,
    cdt,
    cross_entropy,
    get_loss,
    importance_reweighting,
    ldam,
)

LOGITS = [[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]]
LABELS = [0, 2]
COUNTS = [2, 5, 1]


def _tensors():
    return (torch.tensor(LOGITS, dtype=torch.float64), torch.tensor(LABELS),
            torch.tensor(COUNTS, dtype=torch.int64))


def _ce_by_hand(rows: list[list[float]], labels: list[int], weights: list[float] | None = None) -> float:
    """mean_i w_i * (-row_i[y_i] + log sum_c exp(row_i[c])), exp(-inf) = 0, in plain Python floats."""
    losses = []
    for row, y in zip(rows, labels, strict=True):
        lse = math.log(sum(math.exp(v) for v in row if v != -math.inf))
        losses.append(lse - row[y])
    weights = weights or [1.0] * len(losses)
    return sum(w * v for w, v in zip(weights, losses, strict=True)) / len(losses)


@pytest.mark.parametrize("gamma", [1.0, 0.5, 2.0])
def test_balanced_softmax_is_ce_on_logits_plus_gamma_log_counts(gamma):
    logits, labels, counts = _tensors()
    adjusted = [[g + gamma * math.log(n) for g, n in zip(row, COUNTS, strict=True)] for row in LOGITS]
    expected = _ce_by_hand(adjusted, LABELS)
    got = balanced_softmax(logits, labels, counts, gamma)
    assert got.item() == pytest.approx(expected, rel=1e-12)
    # and it really differs from plain CE here (the counts are imbalanced)
    assert abs(expected - _ce_by_hand(LOGITS, LABELS)) > 1e-3


def test_balanced_softmax_formula_as_written_in_the_spec():
    """-log( N_y^g e^{g_y} / sum_c N_c^g e^{g_c} ) for the first example, gamma = 1."""
    num = COUNTS[0] * math.exp(LOGITS[0][0])
    den = sum(n * math.exp(g) for n, g in zip(COUNTS, LOGITS[0], strict=True))
    first = -math.log(num / den)
    logits, labels, counts = _tensors()
    got = balanced_softmax(logits[:1], labels[:1], counts, 1.0)
    assert got.item() == pytest.approx(first, rel=1e-12)


def test_balanced_softmax_gamma_zero_is_cross_entropy():
    logits, labels, counts = _tensors()
    expected = _ce_by_hand(LOGITS, LABELS)
    assert balanced_softmax(logits, labels, counts, 0.0).item() == pytest.approx(expected, rel=1e-12)
    assert cross_entropy(logits, labels, counts, 1.0).item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_balanced_softmax_zero_count_class_is_finite_and_gets_no_mass(gamma):
    counts = torch.tensor([3, 0, 2])
    logits = torch.tensor(LOGITS, dtype=torch.float32, requires_grad=True)
    labels = torch.tensor([0, 2])
    loss = balanced_softmax(logits, labels, counts, gamma)
    (grad,) = torch.autograd.grad(loss, logits)

    assert torch.isfinite(loss)
    assert torch.isfinite(grad).all()
    # d loss / d g_c = (p_c - 1[c = y]) / B, so a zero gradient on the absent class means p_c == 0.
    assert torch.equal(grad[:, 1], torch.zeros(2))
    # The present classes' probabilities sum to one: the gradient rows sum to zero.
    assert grad.sum(1).abs().max().item() < 1e-6
    adjusted = [[g + gamma * math.log(n) if n > 0 else -math.inf for g, n in zip(row, [3, 0, 2], strict=True)]
                for row in LOGITS]
    assert loss.item() == pytest.approx(_ce_by_hand(adjusted, [0, 2]), rel=1e-5)


def test_importance_reweighting_is_mean_of_weighted_ce():
    logits, labels, counts = _tensors()
    total = sum(COUNTS)
    weights = [total / COUNTS[y] for y in LABELS]  # 8/2 = 4 and 8/1 = 8
    assert weights == [4.0, 8.0]
    expected = _ce_by_hand(LOGITS, LABELS, weights)
    got = importance_reweighting(logits, labels, counts, 1.0)
    assert got.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.7])
def test_ldam_subtracts_margin_from_true_logit_only(gamma):
    logits, labels, counts = _tensors()
    adjusted = [list(row) for row in LOGITS]
    for row, y in zip(adjusted, LABELS, strict=True):
        row[y] -= gamma * COUNTS[y] ** -0.25
    expected = _ce_by_hand(adjusted, LABELS)
    got = ldam(logits, labels, counts, gamma)
    assert got.item() == pytest.approx(expected, rel=1e-12)
    # Subtracting the margin from every logit would leave CE unchanged: the test can tell them apart.
    assert abs(expected - _ce_by_hand(LOGITS, LABELS)) > 1e-3


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_cdt_scales_each_logit_by_count_ratio_power(gamma):
    logits, labels, counts = _tensors()
    n_max = max(COUNTS)
    scaled = [[g * (n / n_max) ** gamma for g, n in zip(row, COUNTS, strict=True)] for row in LOGITS]
    expected = _ce_by_hand(scaled, LABELS)
    got = cdt(logits, labels, counts, gamma)
    assert got.item() == pytest.approx(expected, rel=1e-12)


def test_losses_return_batch_mean_and_match_float32():
    logits, labels, counts = _tensors()
    for name, fn in BALANCED_LOSSES.items():
        v64 = fn(logits, labels, counts, 1.0)
        v32 = fn(logits.float(), labels, counts, 1.0)
        assert v64.dim() == 0, name
        assert v32.item() == pytest.approx(v64.item(), rel=1e-5), name


def test_get_loss_names_and_unknown_name():
    assert get_loss("bsm") is balanced_softmax
    assert get_loss("ce") is cross_entropy
    assert get_loss("reweight") is importance_reweighting
    assert get_loss("ldam") is ldam
    assert get_loss("cdt") is cdt
    with pytest.raises(ValueError, match="focal"):
        get_loss("focal")


def test_cross_entropy_matches_torch():
    logits, labels, counts = _tensors()
    assert torch.equal(cross_entropy(logits, labels, counts, 3.0), F.cross_entropy(logits, labels))
