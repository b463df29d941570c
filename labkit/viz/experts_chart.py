"""How evenly a mixture-of-experts layer spreads its tokens, over training: Switch's load-balancing loss per step
for runs with and without it in the loss (Fedus et al. 2021, section 2.2: 1 when the router spreads tokens evenly,
up to the number of experts when it sends them all to one)."""

from __future__ import annotations

import plotly.graph_objects as go

from labkit.viz.style import DARK_GREY, GREY, PALETTE, WHITE, clear_of_toolbar

__all__ = ["expert_balance_chart"]


def expert_balance_chart(runs: dict[str, list[float]], experts: int) -> go.Figure:
    """One line per run (name -> the load-balancing loss at each step), a dashed line at 1 (every expert its share)
    and one at `experts` (every token to one expert)."""
    figure = go.Figure()
    for i, (name, values) in enumerate(runs.items()):
        figure.add_trace(go.Scatter(x=list(range(len(values))), y=values, mode="lines", name=name,
                                    line={"color": PALETTE[i % len(PALETTE)], "width": 2}))
    for level, text in ((1, "balanced: 1"), (experts, f"all to one expert: {experts}")):
        figure.add_hline(y=level, line={"color": GREY, "dash": "dash"}, annotation_text=text,
                         annotation_position="top left")
    figure.update_layout(title_text="How evenly the router spreads tokens<br><sup>Switch's load-balancing loss, "
                                    "E x sum of (share of tokens) x (mean probability), at each training step</sup>",
                         xaxis_title="training step", yaxis_title="load-balancing loss", width=760, height=420,
                         plot_bgcolor=WHITE, font={"color": DARK_GREY}, yaxis={"range": [0, experts + 0.5]})
    return clear_of_toolbar(figure)
