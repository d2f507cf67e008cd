"""Sample-count-weighted averaging, order-independent to the bit."""

from __future__ import annotations

import itertools

import pytest
import torch

from fedrod_ray.server_math.aggregate import OrderedAverager, weighted_average


def test_weighted_average_of_state_dicts_by_hand():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([[0.0, 4.0]])}
    b = {"w": torch.tensor([5.0, 6.0]), "b": torch.tensor([[4.0, -4.0]])}
    out = weighted_average([a, b], [1, 3])
    # (1*1 + 3*5)/4 = 4, (2 + 18)/4 = 5, (0 + 12)/4 = 3, (4 - 12)/4 = -2
    assert torch.equal(out["w"], torch.tensor([4.0, 5.0]))
    assert torch.equal(out["b"], torch.tensor([[3.0, -2.0]]))
    assert set(out) == {"w", "b"}


def test_weighted_average_of_flat_vectors():
    out = weighted_average([torch.tensor([1.0, 0.0, -2.0]), torch.tensor([3.0, 8.0, 2.0])], [3.0, 1.0])
    assert isinstance(out, torch.Tensor)
    assert torch.equal(out, torch.tensor([1.5, 2.0, -1.0]))


def test_weighted_average_does_not_modify_inputs():
    a = {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    b = {"w": torch.tensor([5.0, 6.0], dtype=torch.float64)}
    weighted_average([a, b], [1, 3])
    assert torch.equal(a["w"], torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert torch.equal(b["w"], torch.tensor([5.0, 6.0], dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_dtype_preserved(dtype):
    a = {"w": torch.tensor([1.0, 2.0], dtype=dtype)}
    b = {"w": torch.tensor([3.0, 4.0], dtype=dtype)}
    out = weighted_average([a, b], [1, 1])
    assert out["w"].dtype == dtype
    assert torch.equal(out["w"], torch.tensor([2.0, 3.0], dtype=dtype))


def test_weight_length_mismatch_raises():
    with pytest.raises(ValueError):
        weighted_average([torch.ones(2), torch.ones(2)], [1.0])


def _states(n=4):
    g = torch.Generator().manual_seed(0)
    states = []
    for i in range(n):
        # component 0 is catastrophic-cancellation-prone: a naive fold's result depends on the order
        w = torch.randn(5, generator=g) * 10.0 ** (i - 1)
        w[0] = [1e17, 1.0, -1e17, 3.0][i % 4]
        states.append({"w": w, "v": torch.randn(2, 3, generator=g)})
    return states, [1.0, 1.0, 1.0, 1.0][:n]


def test_ordered_averager_is_bitwise_order_independent():
    states, weights = _states()
    reference = weighted_average(states, weights)
    # ((1e17 + 1) - 1e17 + 3) / 4 folded in slot order: the 1 is absorbed, giving 0.75 in float64
    assert reference["w"][0].item() == 0.75
    # folding naively in another order does give a different answer, so the check below has teeth
    naive = torch.zeros((), dtype=torch.float64)
    for i in (0, 2, 1, 3):
        naive += states[i]["w"][0].double()
    assert (naive / 4).item() == 1.0

    for perm in itertools.permutations(range(4)):
        avg = OrderedAverager(4)
        for slot in perm:
            avg.add(slot, states[slot], weights[slot])
        out = avg.result()
        assert avg.done and avg.count == 4 and avg.total_weight == 4.0
        for k in reference:
            assert torch.equal(out[k], reference[k]), (perm, k)


def test_skip_drops_a_slot():
    states, _ = _states()
    weights = [1.0, 2.0, 3.0, 4.0]
    expected = weighted_average([states[0], states[2], states[3]], [1.0, 3.0, 4.0])
    for order in ([3, 1, 0, 2], [1, 0, 2, 3], [2, 3, 0, 1]):
        avg = OrderedAverager(4)
        for slot in order:
            if slot == 1:
                avg.skip(slot)
            else:
                avg.add(slot, states[slot], weights[slot])
        out = avg.result()
        assert avg.count == 3
        assert avg.total_weight == 8.0
        for k in expected:
            assert torch.equal(out[k], expected[k])


def test_double_add_raises():
    states, _ = _states()
    avg = OrderedAverager(3)
    avg.add(0, states[0], 1.0)  # folded immediately
    with pytest.raises(ValueError):
        avg.add(0, states[0], 1.0)
    avg.add(2, states[2], 1.0)  # pending
    with pytest.raises(ValueError):
        avg.add(2, states[2], 1.0)
    with pytest.raises(ValueError):
        avg.skip(2)
    with pytest.raises(IndexError):
        avg.add(3, states[0], 1.0)
    with pytest.raises(IndexError):
        avg.add(-1, states[0], 1.0)


def test_non_positive_weight_raises():
    with pytest.raises(ValueError):
        OrderedAverager(1).add(0, {"w": torch.ones(1)}, 0)


def test_result_before_all_slots_raises():
    states, _ = _states()
    avg = OrderedAverager(3)
    avg.add(0, states[0], 1.0)
    avg.add(2, states[2], 1.0)
    assert not avg.done
    with pytest.raises(RuntimeError):
        avg.result()
    avg.add(1, states[1], 1.0)
    assert avg.done
    avg.result()


def test_all_skipped_raises():
    avg = OrderedAverager(2)
    avg.skip(1)
    avg.skip(0)
    assert avg.done
    with pytest.raises(RuntimeError):
        avg.result()


def test_mismatched_keys_raise():
    avg = OrderedAverager(2)
    avg.add(0, {"a": torch.ones(1)}, 1.0)
    with pytest.raises(KeyError):
        avg.add(1, {"b": torch.ones(1)}, 1.0)
