"""Plotly figures for the course: the ring animation, the traffic chart, collective before/after grids."""

from labkit.viz.collectives import before_after
from labkit.viz.ring import contributions_by_step, ring_animation
from labkit.viz.traffic import traffic_chart

__all__ = ["before_after", "contributions_by_step", "ring_animation", "traffic_chart"]
