"""Ratios of a source's step to the ideal's, and how far their median can be trusted.

The ideal is measured before and after each source. A source's ratio is over the mean of those
two: over the faster of them, a source exactly as fast as the ideal reads above 1, because one
sample is compared with the least of two. ``interval`` is the distribution-free confidence
interval of a median. It uses order statistics and assumes nothing about how the rounds
spread, so a verdict such as "at most 1.05" can be read off a handful of rounds.

The interval assumes independent rounds. Neighbouring rounds share the ideal measured between
them, so their ratios are correlated. Where the ideal's own noise dominates, the interval
covers the median less often than it says: 89 % instead of 96–97 % in a simulation with 6 and
12 rounds. Read it as approximate.
"""

import math


def adjacent(step, before, after):
    """``step`` over the mean of the ideals beside it (either may be None: the other alone)."""
    near = [t for t in (before, after) if t is not None]
    if not near:
        raise ValueError("no ideal beside the source")
    return step / (sum(near) / len(near))


def interval(xs, level=0.9):
    """``(low, high)``: the order statistics that hold the median of what ``xs`` were drawn from
    with probability at least ``level``. Returns the smallest and largest value where ``xs`` are
    too few for that, and ``(None, None)`` for no values.

    With n values sorted, the interval [x(k), x(n + 1 - k)] misses the median with probability
    2 P(B < k), B ~ Binomial(n, 1/2); k is the largest with that at most 1 - level.
    """
    xs = sorted(xs)
    n = len(xs)
    if n == 0:
        return None, None
    k, below = 1, 0.0
    # below = P(B <= j): k = j + 1 holds the level while 2 P(B <= j) <= 1 - level.
    for j in range(n):
        below += math.comb(n, j) / 2**n
        if 2 * below > 1 - level:
            break
        k = j + 1
    k = min(k, (n + 1) // 2)
    return xs[k - 1], xs[n - k]
