"""The mesh as a grid: which global rank sits where on the axes dp, pp and tp, and which groups one rank is in.

Each dp block (one copy of the model) is drawn as pp rows (pipeline stages) of tp columns (tensor-parallel
shards), blocks side by side and wrapped onto further rows of blocks past 12 columns, so that a mesh of up to 64
ranks stays readable at 1280 px. The layout is `labkit.parallel.mesh_layout`'s, the one torch's DeviceMesh
builds: a rank's tp group is its row within its block, its pp group its column within its block, and its dp
group the cell at its place in every block.
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from labkit.checks import shown, whole
from labkit.parallel.mesh import AXES, MeshPlace, mesh_layout
from labkit.viz.style import BLUE, DARK_GREY, GREEN, GREY, ORANGE, PURPLE, WHITE, tint

__all__ = ["MAX_GRID_COLUMNS", "MAX_GRID_RANKS", "mesh_grid"]

MAX_GRID_RANKS = 64  # every cell labelled with its rank and coordinate
MAX_GRID_COLUMNS = 12  # cells across: 12 x CELL_WIDTH_PX plus margins fits 1280 px
CELL_WIDTH_PX, CELL_HEIGHT_PX = 92, 60  # one cell's pitch; "dp1 pp0 tp1" at 12 px fits its 0.8
MIN_WIDTH_PX = 760  # room for the title and the legend over a small mesh
CELL_HALF = 0.4  # a cell's rectangle reaches this far from its centre, in cells
BLOCK_GAP = 0.5  # between dp blocks side by side, in cells
BLOCK_ROW_GAP = 0.8  # between rows of dp blocks, in cells: room for the blocks' "dp i" titles
MARGIN_PX = {"l": 10, "r": 10, "b": 10}
TITLE_PX, LEGEND_LINE_PX = 56, 22  # the title's two lines; one legend entry per line above the grid
GROUP_STYLE = {  # how each axis's group of the highlighted rank is drawn
    "tp": {"mode": "lines", "line": {"color": ORANGE, "width": 3}},
    "pp": {"mode": "lines", "line": {"color": GREEN, "width": 3, "dash": "dash"}},
    "dp": {"mode": "none", "fill": "toself", "fillcolor": tint(PURPLE, 0.45)},
}
GROUP_REACH = {"tp": 0.5, "pp": 0.45, "dp": CELL_HALF}  # outline or fill, from the cell's centre


def mesh_grid(world_size: int, dp: int | None = None, pp: int = 1, tp: int = 1,
              highlight_rank: int | None = None) -> go.Figure:
    """`world_size` ranks on a dp x pp x tp mesh (dp=None: what pp and tp leave), each cell labelled with its
    global rank and coordinate. With `highlight_rank`, that rank gets a thick border, its tp group (its row) and
    pp group (its column) are outlined and its dp group is filled, the legend naming each group's ranks.

    >>> figure = mesh_grid(8, dp=2, pp=2, tp=2, highlight_rank=5)
    >>> [trace.name for trace in figure.data]
    ['dp group of rank 5: ranks 1, 5', 'pp group of rank 5: ranks 5, 7', 'tp group of rank 5: ranks 4, 5', 'ranks']
    """
    layout = mesh_layout(world_size, dp, pp, tp)
    sizes = {a: max(p.coordinate[a] for p in layout) + 1 for a in AXES}
    _check_drawable(len(layout), sizes["tp"], highlight_rank)
    centres = _centres(layout, sizes)
    figure = go.Figure()
    if highlight_rank is not None:
        for axis in AXES:
            figure.add_trace(_group(layout[highlight_rank], axis, layout, centres))
    figure.add_trace(_labels(layout, centres))  # last: over the dp group's fill
    figure.update_layout(shapes=[_cell(centres[p.rank], highlighted=p.rank == highlight_rank) for p in layout],
                         annotations=_block_titles(layout, centres))  # at once: one by one is quadratic in plotly
    _frame(figure, len(layout), sizes, centres, highlight_rank)
    return figure


def _check_drawable(world_size: int, tp: int, highlight_rank) -> None:
    if world_size > MAX_GRID_RANKS:
        raise ValueError(f"world_size={world_size}: mesh_grid draws at most {MAX_GRID_RANKS} ranks, so that every "
                         "label stays readable; use labkit.parallel.mesh_layout for larger meshes.")
    if tp > MAX_GRID_COLUMNS:
        raise ValueError(f"tp={tp}: mesh_grid draws at most {MAX_GRID_COLUMNS} tp columns side by side; use "
                         "labkit.parallel.mesh_layout for wider tp groups.")
    if highlight_rank is not None and whole("highlight_rank", highlight_rank, minimum=0) >= world_size:
        raise ValueError(f"highlight_rank={shown(highlight_rank)}: pass a rank from 0 to {world_size - 1}, "
                         "or None.")


def _centres(layout: list[MeshPlace], sizes: dict[str, int]) -> dict[int, tuple[float, float]]:
    """Each rank's cell centre (x to the right, y downwards), in cells: dp blocks side by side, as many as
    MAX_GRID_COLUMNS allow, then on further rows; inside a block, pp rows of tp columns."""
    per_row = max(1, min(sizes["dp"], MAX_GRID_COLUMNS // sizes["tp"]))
    centres = {}
    for place in layout:
        block_column, block_row = place.coordinate["dp"] % per_row, place.coordinate["dp"] // per_row
        x = block_column * (sizes["tp"] + BLOCK_GAP) + place.coordinate["tp"]
        y = block_row * (sizes["pp"] + BLOCK_ROW_GAP) + place.coordinate["pp"]
        centres[place.rank] = (x, y)
    return centres


def _cell(centre: tuple[float, float], highlighted: bool) -> dict:
    """A rank's cell, pale blue; the highlighted rank's with a thick border."""
    x, y = centre
    line = {"color": DARK_GREY, "width": 4} if highlighted else {"color": GREY, "width": 1}
    return {"type": "rect", "x0": x - CELL_HALF, "x1": x + CELL_HALF, "y0": y - CELL_HALF, "y1": y + CELL_HALF,
            "layer": "below", "fillcolor": tint(BLUE, 0.15), "line": line}


def _group(place: MeshPlace, axis: str, layout: list[MeshPlace],
           centres: dict[int, tuple[float, float]]) -> go.Scatter:
    """`place`'s group on `axis`: one rectangle around its cells in each dp block (its row for tp, its column
    for pp, one cell in every block for dp), as one trace so that the legend names the group once; `meta`
    holds the group's global ranks."""
    members = place.groups[axis]
    by_block: dict[int, list[tuple[float, float]]] = {}
    for rank in members:
        by_block.setdefault(layout[rank].coordinate["dp"], []).append(centres[rank])
    xs: list[float | None] = []
    ys: list[float | None] = []
    reach = GROUP_REACH[axis]
    for cells in by_block.values():
        left, right = min(x for x, _ in cells) - reach, max(x for x, _ in cells) + reach
        top, bottom = min(y for _, y in cells) - reach, max(y for _, y in cells) + reach
        xs += [left, right, right, left, left, None]
        ys += [top, top, bottom, bottom, top, None]
    ranks = f"ranks {', '.join(map(str, members))}" if len(members) > 1 else f"rank {members[0]} alone"
    return go.Scatter(x=xs, y=ys, hoverinfo="skip", name=f"{axis} group of rank {place.rank}: {ranks}",
                      meta=list(members), **GROUP_STYLE[axis])


def _labels(layout: list[MeshPlace], centres: dict[int, tuple[float, float]]) -> go.Scatter:
    """One text per cell: the global rank, bold, over its coordinate; customdata holds the rank."""
    coordinates = [" ".join(f"{a}{p.coordinate[a]}" for a in AXES) for p in layout]
    return go.Scatter(
        x=[centres[p.rank][0] for p in layout], y=[centres[p.rank][1] for p in layout], mode="text", name="ranks",
        text=[f"<b>rank {p.rank}</b><br>{c}" for p, c in zip(layout, coordinates, strict=True)],
        customdata=[p.rank for p in layout], textfont={"size": 12, "color": DARK_GREY}, showlegend=False,
        hovertext=[_hover(p) for p in layout], hoverinfo="text")


def _hover(place: MeshPlace) -> str:
    groups = "<br>".join(f"{a} group: ranks {', '.join(map(str, place.groups[a]))}" for a in AXES)
    return f"rank {place.rank} at {place.coordinate}<br>{groups}"


def _block_titles(layout: list[MeshPlace], centres: dict[int, tuple[float, float]]) -> list[dict]:
    """ "dp i" above each block's top-left cell, clear of a tp outline there."""
    corners = [(p.coordinate["dp"], centres[p.rank]) for p in layout if p.coordinate["pp"] == p.coordinate["tp"] == 0]
    return [{"x": x - CELL_HALF, "y": y - GROUP_REACH["tp"], "text": f"dp {dp}", "showarrow": False, "xanchor": "left",
             "yanchor": "bottom", "font": {"size": 13, "color": DARK_GREY}} for dp, (x, y) in corners]


def _frame(figure: go.Figure, world_size: int, sizes: dict[str, int], centres: dict[int, tuple[float, float]],
           highlight_rank: int | None) -> None:
    """Title, legend, and axes scaled so that every cell is CELL_WIDTH_PX x CELL_HEIGHT_PX on screen."""
    columns = max(x for x, _ in centres.values()) + 1
    rows = max(y for _, y in centres.values()) + 1 + BLOCK_ROW_GAP
    plot_width_px = max(MIN_WIDTH_PX - MARGIN_PX["l"] - MARGIN_PX["r"], math.ceil((columns + 0.1) * CELL_WIDTH_PX))
    top_px = TITLE_PX + (3 * LEGEND_LINE_PX if highlight_rank is not None else 0)
    shape = " x ".join(f"{a}={sizes[a]}" for a in AXES)
    subtitle = ("each dp block is pp rows of tp columns" if highlight_rank is None else
                f"rank {highlight_rank} has the thick border; its groups are drawn in colour")
    figure.update_xaxes(visible=False, range=[-0.55, plot_width_px / CELL_WIDTH_PX - 0.55])  # room for outlines
    figure.update_yaxes(visible=False, range=[rows - 0.5, -0.5 - BLOCK_ROW_GAP])
    figure.update_layout(
        title={"text": f"{world_size} ranks on a {shape} mesh<br><sup>{subtitle}</sup>", "x": 0, "xanchor": "left",
               "y": 1, "yref": "container", "yanchor": "top", "pad": {"t": 12, "l": 10}},
        plot_bgcolor=WHITE, hovermode="closest", margin=MARGIN_PX | {"t": top_px}, showlegend=True,
        width=plot_width_px + MARGIN_PX["l"] + MARGIN_PX["r"],
        height=math.ceil(rows * CELL_HEIGHT_PX) + top_px + MARGIN_PX["b"],
        legend={"orientation": "v", "x": 0, "y": 1, "yanchor": "bottom", "traceorder": "normal"})
