"""The ring animation: one frame per hop, labels that stay readable at 2, 4 and 8 ranks."""

import math

import pytest

from labkit import comm
from labkit.viz import contributions_by_hop, ring_animation


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_every_chunk_ends_holding_every_ranks_data(world_size):
    counts = contributions_by_hop(comm.simulate("ring_allreduce", world_size, 8 * world_size), world_size)
    assert len(counts) == 2 * (world_size - 1) + 1                      # before, then one entry per hop
    assert counts[0] == [[1] * world_size] * world_size
    assert counts[world_size - 1] != counts[-1]                           # scatter-reduce done, all-gather to go
    assert counts[-1] == [[world_size] * world_size] * world_size


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_frames_and_slider_count_hops_not_steps(world_size):
    figure = ring_animation(comm.simulate("ring_allreduce", world_size, 8 * world_size), world_size)
    hops = 2 * (world_size - 1)
    assert len(figure.frames) == len(figure.layout.sliders[0].steps) == hops + 1
    assert figure.layout.sliders[0].currentvalue.prefix == "hop "
    captions = [frame.layout.title.text for frame in figure.frames]
    assert f"hop {hops} of {hops}" in captions[-1] and not any("step" in c for c in captions)


def test_colour_bar_ticks_are_whole_rank_counts():
    colorbar = ring_animation(comm.simulate("ring_allreduce", 8, 64), 8).data[3].colorbar
    assert list(colorbar.tickvals) == list(range(1, 9)) and colorbar.tickmode == "array"


def test_play_buttons_sit_left_of_the_slider_whose_label_is_at_its_right_end():
    figure = ring_animation(comm.simulate("ring_allreduce", 4, 16), 4)
    buttons, slider = figure.layout.updatemenus[0], figure.layout.sliders[0]
    assert buttons.xanchor == "left" and buttons.x < slider.x and slider.currentvalue.xanchor == "right"


def test_sent_labels_point_away_from_the_centre_and_are_not_clipped():
    figure = ring_animation(comm.simulate("ring_allreduce", 8, 64), 8)
    sent = figure.frames[-1].data[0]
    assert sent.cliponaxis is False and all(t.startswith("sent") for t in sent.text)
    assert list(sent.textposition) == ["top center", "top right", "middle right", "bottom right",
                                       "bottom center", "bottom left", "middle left", "top left"]


def test_two_ranks_arrows_lie_side_by_side_with_their_labels_apart():
    figure = ring_animation(comm.simulate("ring_allreduce", 2, 8), 2)
    arrows = [a for a in figure.frames[1].layout.annotations if a.showarrow]
    labels = [a for a in figure.frames[1].layout.annotations if a.text.startswith("chunk")]
    assert len(arrows) == len(labels) == 2
    assert arrows[0].x != arrows[1].x                                     # not drawn on top of each other
    assert {(a.xanchor, a.x > 0) for a in labels} == {("left", True), ("right", False)}


def test_chunk_labels_stay_inside_the_ring():
    figure = ring_animation(comm.simulate("ring_allreduce", 8, 64), 8)
    for frame in figure.frames[1:]:
        labels = [a for a in frame.layout.annotations if (a.text or "").startswith("chunk")]
        assert len(labels) == 8 and all(math.hypot(a.x, a.y) < 1 for a in labels)


def test_rejects_a_world_size_it_cannot_draw():
    with pytest.raises(ValueError, match=r"^world_size=1: pass a whole number >= 2"):
        ring_animation([], 1)


@pytest.mark.parametrize("world_size, error, message", [
    (17, ValueError, r"^world_size=17: ring_animation draws 2 to 16 ranks; pass fewer\.$"),
    (2.5, ValueError, r"^world_size=2\.5: pass a whole number >= 2 \(an int, not a bool\)\.$"),  # once drawn
    (True, ValueError, r"^world_size=True: pass a whole number >= 2"),
    ("4", TypeError, r"^world_size='4': pass a whole number >= 2"),
])
def test_world_size_is_checked_as_every_labkit_argument(world_size, error, message):
    with pytest.raises(error, match=message):
        ring_animation([], world_size)
