"""labkit.viz.traffic_chart: the busiest rank's bytes, hub vs ring, and its arguments checked by name."""

import pytest

from labkit.plan.traffic import naive_allreduce_bytes, ring_allreduce_bytes
from labkit.viz import traffic_chart


def test_the_curves_are_the_formulas_in_megabytes():
    figure = traffic_chart(4e6, [2, 4, 8])
    hub, ring = figure.data[0], figure.data[1]
    assert list(hub.x) == [2, 4, 8] and list(hub.y) == [naive_allreduce_bytes(4e6, n) / 1e6 for n in (2, 4, 8)]
    assert list(ring.y) == [ring_allreduce_bytes(4e6, n) / 1e6 for n in (2, 4, 8)]


@pytest.mark.parametrize("world_sizes, error, message", [
    ([], ValueError, r"^world_sizes=\[\]: pass a list of world sizes, each a whole number >= 2, at least one\.$"),
    ([2, 1], ValueError, r"^world_sizes\[1\]=1: pass a whole number >= 2"),
    ([2, 3.5], ValueError, r"^world_sizes\[1\]=3\.5: pass a whole number >= 2"),  # once drawn at N = 3.5
    ([True, 4], ValueError, r"^world_sizes\[0\]=True: pass a whole number >= 2"),
    ("248", TypeError, r"^world_sizes='248': pass a list of world sizes"),  # once its characters
    (8, TypeError, r"^world_sizes=8: pass a list of world sizes, each a whole number >= 2, not an int\.$"),
])
def test_bad_world_sizes_are_refused_by_name(world_sizes, error, message):
    with pytest.raises(error, match=message):
        traffic_chart(1e6, world_sizes)
