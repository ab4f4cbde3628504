"""Group-relative advantages: hand-derived worked numbers and the properties they must satisfy."""

from __future__ import annotations

import pytest
import torch

from mmgrpo.errors import DataError
from mmgrpo.grpo.advantages import group_advantages, group_stats

# worked numbers: (rewards, advantages with std(N-1), advantages with std(N)); None = elided in the table.
TABLE = [
    (
        [1.0, 0.8, 0.8, 0.5, 0.5, 0.5, 0.2, 0.0],
        [1.4048, 0.7973, 0.7973, -0.1139, -0.1139, -0.1139, -1.0251, -1.6326],
        [1.5018, None, None, None, None, None, None, -1.7453],
    ),
    ([1.0, 0.0, 1.0, 0.0], [0.8660, -0.8660, 0.8660, -0.8660], [1.0, -1.0, 1.0, -1.0]),
    ([1.0, 0.0, 1.0, 0.5], [0.7833, -1.3056, 0.7833, -0.2611], [0.9045, -1.5076, 0.9045, -0.3015]),
    ([0.2, 0.2, 0.9, 0.1], [-0.4058, -0.4058, 1.4878, -0.6763], [-0.4685, -0.4685, 1.7179, -0.7809]),
]


def _check(actual: torch.Tensor, expected: list[float | None]) -> None:
    for a, e in zip(actual.tolist(), expected, strict=True):
        if e is not None:
            assert a == pytest.approx(e, abs=1e-4)


@pytest.mark.parametrize("rewards, unbiased, biased", TABLE)
def test_worked_numbers(rewards, unbiased, biased):
    r = torch.tensor(rewards)
    _check(group_advantages(r, len(rewards), scale="std_unbiased", eps=1e-8), unbiased)
    _check(group_advantages(r, len(rewards), scale="std_biased", eps=1e-8), biased)


def test_rloo_row():
    # Row 1 with the leave-one-out baseline and no std division (the RLOO paper): 1.0 - 3.3 / 7 = 0.5286, ...
    r = torch.tensor(TABLE[0][0])
    a = group_advantages(r, 8, baseline="rloo", scale="none")
    _check(a, [0.5286, 0.3, 0.3, -0.0429, -0.0429, -0.0429, -0.3857, -0.6143])


def test_dr_grpo_no_scale_is_centering():
    r = torch.tensor([1.0, 0.0, 1.0, 0.5])
    _check(group_advantages(r, 4, scale="none"), [0.375, -0.625, 0.375, -0.125])


@pytest.mark.parametrize("baseline", ["mean", "rloo"])
@pytest.mark.parametrize("scale", ["std_unbiased", "std_biased", "none"])
def test_shift_invariance_and_zero_sum(baseline, scale):
    r = torch.rand(4 * 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    a = group_advantages(r, 6, baseline=baseline, scale=scale)
    b = group_advantages(r + 3.7, 6, baseline=baseline, scale=scale)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a.view(4, 6).sum(dim=1), torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("baseline", ["mean", "rloo"])
@pytest.mark.parametrize("scale", ["std_unbiased", "std_biased"])
def test_positive_scale_invariance(baseline, scale):
    r = torch.rand(3 * 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    a = group_advantages(r, 5, baseline=baseline, scale=scale, eps=1e-12)
    b = group_advantages(r * 17.0, 5, baseline=baseline, scale=scale, eps=1e-12)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("baseline", ["mean", "rloo"])
@pytest.mark.parametrize("scale", ["std_unbiased", "std_biased", "none"])
@pytest.mark.parametrize("value", [0.0, 0.1, 1.0, -3.3])
def test_all_equal_group_gives_exact_zeros(baseline, scale, value):
    # 0.1 * 3 / 3 != 0.1 in float32: r - mean(r) would be rounding noise, divided by a ~0 std.
    r = torch.tensor([value] * 3 + [0.0, 1.0, 0.5])
    a = group_advantages(r, 3, baseline=baseline, scale=scale, eps=1e-8)
    assert not torch.isnan(a).any()
    assert a[:3].tolist() == [0.0, 0.0, 0.0]
    assert a[3:].abs().sum() > 0


def test_group_size_one_gives_zeros():
    a = group_advantages(torch.tensor([0.3, 1.0, -2.0]), 1)
    assert a.tolist() == [0.0, 0.0, 0.0]


def test_groups_are_normalised_independently():
    # Two groups with very different reward scales, concatenated: each must equal its own normalisation.
    g1 = torch.tensor([1.0, 0.0, 1.0, 0.5])
    g2 = torch.tensor([100.0, -50.0, 20.0, 7.0])
    both = group_advantages(torch.cat([g1, g2]), 4)
    torch.testing.assert_close(both[:4], group_advantages(g1, 4))
    torch.testing.assert_close(both[4:], group_advantages(g2, 4))
    _check(both[:4], TABLE[2][1])


def test_bad_n_raises_naming_group_size():
    with pytest.raises(DataError, match="group_size"):
        group_advantages(torch.zeros(7), 4)
    with pytest.raises(ValueError, match="group_size"):
        group_stats(torch.zeros(7), 4)


def test_integer_rewards_are_accepted():
    _check(group_advantages(torch.tensor([1, 0, 1, 0]), 4, eps=1e-8), TABLE[1][1])


def test_group_stats_hand_example():
    # Group 1 [1, 0, 1, 0]: unbiased std sqrt(1/3) = 0.57735; group 2 all 0.5: std 0 (zero-std group);
    # group 3 [0, 0, 0, 2]: mean 0.5, squared deviations 0.25 * 3 + 2.25 = 3, std sqrt(3/3) = 1.
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 2.0])
    stats = group_stats(r, 4)
    assert stats["reward_std_within_group"] == pytest.approx((0.57735 + 0.0 + 1.0) / 3, abs=1e-5)
    assert stats["frac_zero_std_groups"] == pytest.approx(1 / 3)
    assert group_stats(torch.tensor(TABLE[0][0]), 8)["reward_std_within_group"] == pytest.approx(
        0.329231, abs=1e-5
    )


def test_group_ids_make_row_order_irrelevant():
    # the first worked row, as one group, plus a second group; rows shuffled and labelled by task id
    first = [1.0, 0.8, 0.8, 0.5, 0.5, 0.5, 0.2, 0.0]
    second = [0.2, 0.2, 0.9, 0.1, 0.0, 1.0, 1.0, 0.0]
    rewards = torch.tensor(first + second)
    consecutive = group_advantages(rewards, 8)  # (16,)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    ids = [0] * 8 + [1] * 8
    shuffled = group_advantages(rewards[perm], 8, group_ids=[ids[i] for i in perm.tolist()])
    torch.testing.assert_close(shuffled, consecutive[perm])
    torch.testing.assert_close(
        consecutive[:8],
        torch.tensor([1.4048, 0.7973, 0.7973, -0.1139, -0.1139, -0.1139, -1.0251, -1.6326]),
        atol=1e-4,
        rtol=0,
    )


def test_group_ids_must_cover_whole_groups():
    with pytest.raises(DataError, match="exactly group_size=2"):
        group_advantages(torch.tensor([1.0, 0.0, 1.0]), 2, group_ids=[0, 0, 1])
