"""mesh_grid: every cell is the rank mesh_layout puts there, and the highlighted rank's groups are exactly its
groups in the layout, drawn around exactly their cells."""

import pytest

from labkit.parallel import AXES, mesh_layout
from labkit.viz import mesh_grid
from labkit.viz.mesh_chart import MAX_GRID_RANKS

SHAPES = [(8, 2, 2, 2), (4, 2, 1, 2), (12, 3, 2, 2), (16, 2, 1, 8), (32, 8, 1, 4), (64, 4, 4, 4), (6, 1, 6, 1)]


def cells(figure):
    """{rank: (x, y)} from the label trace: the centre of each rank's cell."""
    labels = next(t for t in figure.data if t.name == "ranks")
    return {rank: (x, y) for rank, x, y in zip(labels.customdata, labels.x, labels.y, strict=True)}


def enclosed(trace, centres):
    """The ranks whose cell centres lie inside one of the trace's rectangles (segments split by None)."""
    inside, xs, ys = set(), [], []
    for x, y in [*zip(trace.x, trace.y, strict=True), (None, None)]:
        if x is not None:
            xs.append(x), ys.append(y)
            continue
        if xs:
            inside |= {r for r, (cx, cy) in centres.items() if min(xs) < cx < max(xs) and min(ys) < cy < max(ys)}
        xs, ys = [], []
    return inside


@pytest.mark.parametrize("world_size, dp, pp, tp", SHAPES)
def test_every_cell_shows_the_rank_and_coordinate_of_the_layout(world_size, dp, pp, tp):
    figure = mesh_grid(world_size, dp, pp, tp)
    labels = next(t for t in figure.data if t.name == "ranks")
    layout = mesh_layout(world_size, dp, pp, tp)
    assert list(labels.customdata) == [place.rank for place in layout]
    for place, text in zip(layout, labels.text, strict=True):
        assert text == f"<b>rank {place.rank}</b><br>" + " ".join(f"{a}{place.coordinate[a]}" for a in AXES)
    centres = cells(figure)
    for place in layout:                                 # inside a dp block: tp to the right, pp downwards
        x, y = centres[place.rank]
        for axis, step in (("tp", (1, 0)), ("pp", (0, 1))):
            group = place.groups[axis]
            i = group.index(place.rank)
            if i + 1 < len(group):
                assert centres[group[i + 1]] == (x + step[0], y + step[1])
    assert len({centres[r] for r in centres}) == world_size      # no two ranks in one cell
    assert [(s.x0 + s.x1) / 2 for s in figure.layout.shapes] == pytest.approx([c[0] for c in centres.values()])


@pytest.mark.parametrize("world_size, dp, pp, tp", SHAPES)
def test_the_highlighted_ranks_groups_are_exactly_its_layout_groups(world_size, dp, pp, tp):
    layout = mesh_layout(world_size, dp, pp, tp)
    for rank in sorted({0, world_size // 2 + 1, world_size - 1} & set(range(world_size))):
        figure = mesh_grid(world_size, dp, pp, tp, highlight_rank=rank)
        groups = {t.name.split()[0]: t for t in figure.data if t.name != "ranks"}
        assert list(groups) == list(AXES)
        for axis, trace in groups.items():
            members = layout[rank].groups[axis]
            assert tuple(trace.meta) == members
            assert enclosed(trace, cells(figure)) == set(members), (axis, rank)
            assert trace.name.startswith(f"{axis} group of rank {rank}: ")
            assert trace.name.endswith(", ".join(map(str, members)) if len(members) > 1 else "alone")
        thick = [i for i, s in enumerate(figure.layout.shapes) if s.line.width > 1]
        assert thick == [rank]


def test_a_group_of_one_says_so():
    figure = mesh_grid(4, tp=2, highlight_rank=3)
    assert [t.name for t in figure.data] == ["dp group of rank 3: ranks 1, 3", "pp group of rank 3: rank 3 alone",
                                            "tp group of rank 3: ranks 2, 3", "ranks"]


@pytest.mark.parametrize("world_size, dp, pp, tp", SHAPES)
def test_readable_at_1280_px(world_size, dp, pp, tp):
    figure = mesh_grid(world_size, dp, pp, tp, highlight_rank=0)
    assert figure.layout.width <= 1280
    columns = max(x for x, _ in cells(figure).values()) + 1
    plot_px = figure.layout.width - figure.layout.margin.l - figure.layout.margin.r
    x0, x1 = figure.layout.xaxis.range
    assert plot_px / (x1 - x0) >= 90                      # each cell ~92 px: its label fits
    assert x0 < -0.5 and x1 > columns - 0.5               # outlines (0.5 beside a cell's centre) not cut


def test_dp_left_out_fills_the_rest():
    assert mesh_grid(8, tp=2).layout.title.text.startswith("8 ranks on a dp=4 x pp=1 x tp=2 mesh")


def test_what_it_cannot_draw_is_refused_with_a_reason():
    with pytest.raises(ValueError, match=rf"world_size=128: mesh_grid draws at most {MAX_GRID_RANKS} ranks"):
        mesh_grid(128, tp=2)
    with pytest.raises(ValueError, match=r"tp=16: mesh_grid draws at most 12 tp columns"):
        mesh_grid(32, tp=16)
    with pytest.raises(ValueError, match=r"highlight_rank=8: pass a rank from 0 to 7, or None"):
        mesh_grid(8, tp=2, highlight_rank=8)
    with pytest.raises(ValueError, match=r"highlight_rank=-1"):
        mesh_grid(8, tp=2, highlight_rank=-1)
    with pytest.raises(TypeError, match=r"highlight_rank='0'"):
        mesh_grid(8, tp=2, highlight_rank="0")
    with pytest.raises(ValueError, match=r"dp=3 x pp=1 x tp=2 = 6 ranks, but the world has 8"):
        mesh_grid(8, dp=3, tp=2)
