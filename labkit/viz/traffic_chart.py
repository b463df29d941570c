"""Why the hub stops scaling: bytes through the busiest link as ranks are added, hub vs ring."""

from __future__ import annotations

import plotly.graph_objects as go

from labkit.checks import items, whole
from labkit.plan.traffic import naive_allreduce_bytes, ring_allreduce_bytes
from labkit.viz.style import BLUE, RED

__all__ = ["traffic_chart"]


def traffic_chart(nbytes: float, world_sizes=range(2, 17), measured: dict | None = None) -> go.Figure:
    """Bytes sent by the busiest rank in an AllReduce of `nbytes`: the hub's grows as (N-1) S, the ring's
    approaches 2 S. `measured` may add counted points: {"hub": {N: bytes}, "ring": {N: bytes}}."""
    wanted = "a list of world sizes, each a whole number >= 2"
    sizes = [whole(f"world_sizes[{i}]", n, minimum=2) for i, n in enumerate(items("world_sizes", world_sizes, wanted))]
    if not sizes:
        raise ValueError(f"world_sizes=[]: pass {wanted}, at least one.")
    megabytes = 1e6
    figure = go.Figure()
    figure.add_trace(go.Scatter(x=sizes, y=[naive_allreduce_bytes(nbytes, n) / megabytes for n in sizes],
                                name="naive hub: (N-1) S", mode="lines+markers", line={"color": RED}))
    figure.add_trace(go.Scatter(x=sizes, y=[ring_allreduce_bytes(nbytes, n) / megabytes for n in sizes],
                                name="ring, every rank: 2(N-1)/N S", mode="lines+markers", line={"color": BLUE}))
    figure.add_trace(go.Scatter(x=[sizes[0], sizes[-1]], y=[2 * nbytes / megabytes] * 2, name="2 S",
                                mode="lines", line={"color": BLUE, "dash": "dot"}))
    for name, color in (("hub", RED), ("ring", BLUE)):
        points = (measured or {}).get(name)
        if points:
            figure.add_trace(go.Scatter(x=list(points), y=[b / megabytes for b in points.values()],
                                        name=f"{name}, counted on real ranks", mode="markers",
                                        marker={"symbol": "x", "size": 11, "color": color}))
    figure.update_layout(title=f"Bytes sent by the busiest rank, AllReduce of S = {nbytes / megabytes:g} MB",
                         xaxis_title="ranks N", yaxis_title="bytes sent (MB)", height=420)
    return figure
