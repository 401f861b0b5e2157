"""``python/bench/ratios.py``: the ratio to the ideals beside a source, and the median's
distribution-free interval the benchmarks report (no GPU needed)."""

import math
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import ratios  # noqa: E402


def test_adjacent_is_over_the_mean_of_the_ideals_beside():
    assert ratios.adjacent(11.0, 10.0, 12.0) == pytest.approx(1.0)
    assert ratios.adjacent(11.0, None, 10.0) == pytest.approx(1.1)
    assert ratios.adjacent(11.0, 10.0, None) == pytest.approx(1.1)
    with pytest.raises(ValueError):
        ratios.adjacent(11.0, None, None)


def test_adjacent_of_the_ideal_itself_centres_on_one_where_the_faster_of_two_does_not():
    # Three draws of one distribution: the middle one over the mean of the outer two, and over
    # the faster of them (the old form), many times.
    rng = random.Random(7)
    mean_form, faster_form = [], []
    for _ in range(20000):
        a, x, b = (rng.gauss(15.0, 0.6) for _ in range(3))
        mean_form.append(ratios.adjacent(x, a, b))
        faster_form.append(x / min(a, b))
    mean_form.sort()
    faster_form.sort()
    assert abs(mean_form[len(mean_form) // 2] - 1.0) < 0.003
    assert faster_form[len(faster_form) // 2] > 1.015


@pytest.mark.parametrize("n,want", [(1, (0, 0)), (4, (0, 3)), (5, (0, 4)), (6, (0, 5)), (10, (1, 8)),
                                    (20, (5, 14))])
def test_interval_picks_the_order_statistics_of_the_binomial(n, want):
    assert ratios.interval(list(range(n))) == want
    assert ratios.interval(list(range(n))[::-1]) == want  # order of the rounds does not matter


def test_interval_is_as_wide_as_the_level_asks():
    n = 20
    k = ratios.interval(list(range(n)))[0] + 1  # 1-based order statistic
    miss = lambda k: 2 * sum(math.comb(n, j) for j in range(k)) / 2**n  # noqa: E731
    assert miss(k) <= 0.1 < miss(k + 1)


def test_interval_covers_the_median_as_often_as_it_says():
    rng = random.Random(11)
    for n in (6, 10, 20):
        misses = 0
        for _ in range(3000):
            lo, hi = ratios.interval([rng.expovariate(1.0) for _ in range(n)])
            misses += not (lo <= math.log(2) <= hi)
        assert misses / 3000 <= 0.12, (n, misses)


def test_interval_of_nothing():
    assert ratios.interval([]) == (None, None)
