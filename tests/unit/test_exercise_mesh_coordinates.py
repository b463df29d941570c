"""The mesh grader (notebook 13) against its catalogue: wrong coordinates and groups, each rejected with a message
that names the mistake, and right ones written in different ways (divmod, a torch mesh tensor, an enumeration),
all accepted. No processes: the grader compares numbers with labkit.parallel.mesh_layout, which notebook 13 checks
against the real Mesh (torch's DeviceMesh) on real ranks."""

import functools
import itertools
import math
import re
import sys
import time
from collections import deque

import numpy as np
import pytest
import torch

from labkit.exercises import Verdict
from labkit.exercises.mesh_coordinates import DRAWN, SHAPES, check_mesh_coordinates, draw_shapes
from labkit.parallel import Mesh, mesh_layout
from labkit.plan import ParallelLayout

# ---- right solutions, three ways -------------------------------------------------------------------------


def divmod_coordinates(rank, dp, pp, tp):
    """tp varies fastest: peel it off first, then pp; what is left is dp."""
    rest, t = divmod(rank, tp)
    d, p = divmod(rest, pp)
    return d, p, t


def divmod_groups(rank, dp, pp, tp):
    d, p, t = divmod_coordinates(rank, dp, pp, tp)
    at = lambda d, p, t: (d * pp + p) * tp + t  # noqa: E731
    return {"dp": [at(i, p, t) for i in range(dp)], "pp": [at(d, j, t) for j in range(pp)],
            "tp": [at(d, p, k) for k in range(tp)]}


def tensor_coordinates(rank, dp, pp, tp):
    """torch's DeviceMesh is this tensor: find the rank in it (a tensor of three indices)."""
    return (torch.arange(dp * pp * tp).reshape(dp, pp, tp) == rank).nonzero()[0]


def tensor_groups(rank, dp, pp, tp):
    """Slices of the mesh tensor through the rank, returned as tensors."""
    mesh = torch.arange(dp * pp * tp).reshape(dp, pp, tp)
    d, p, t = np.unravel_index(rank, (dp, pp, tp))
    return {"dp": mesh[:, p, t], "pp": mesh[d, :, t], "tp": mesh[d, p, :]}


def enumerated_coordinates(rank, dp, pp, tp):
    """Row-major enumeration: itertools.product varies its last factor fastest; as a dict, like Mesh.coordinate."""
    return dict(zip(("dp", "pp", "tp"), list(itertools.product(range(dp), range(pp), range(tp)))[rank], strict=True))


def enumerated_groups(rank, dp, pp, tp):
    """The ranks whose place differs from the rank's on one axis alone (or not at all)."""
    places = list(itertools.product(range(dp), range(pp), range(tp)))
    mine = places[rank]
    return {axis: [r for r, place in enumerate(places) if all(place[j] == mine[j] for j in range(3) if j != k)]
            for k, axis in enumerate(("dp", "pp", "tp"))}


@functools.cache
def cached_coordinates(rank, dp, pp, tp):
    """Right, memoized on every argument: state across calls keyed on all the answer depends on (issue 27)."""
    return divmod_coordinates(rank, dp, pp, tp)


def groups_by_loops(rank, dp, pp, tp):
    """Right, with loops over each axis's own size (not a fixed range)."""
    d, p, t = divmod_coordinates(rank, dp, pp, tp)
    groups = {"dp": [], "pp": [], "tp": []}
    for i in range(dp * pp * tp):
        other = divmod_coordinates(i, dp, pp, tp)
        for k, axis in enumerate(("dp", "pp", "tp")):
            if all(other[j] == (d, p, t)[j] for j in range(3) if j != k):
                groups[axis].append(i)
    return groups


RIGHT = {"cached, loops": (cached_coordinates, groups_by_loops),
         "divmod": (divmod_coordinates, divmod_groups), "torch mesh tensor": (tensor_coordinates, tensor_groups),
         "enumeration": (enumerated_coordinates, enumerated_groups)}


@pytest.mark.parametrize("name", RIGHT)
def test_right_solutions_written_differently_pass(name):
    verdict = check_mesh_coordinates(*RIGHT[name])
    assert verdict and isinstance(verdict, Verdict), verdict
    assert "all 64 shapes" in verdict.message and repr(verdict).startswith("Correct! ")


def test_the_shapes_are_every_mesh_of_1_to_4_ranks_per_axis_notebook_12s_first():
    assert SHAPES[0] == (2, 2, 2) and sorted(SHAPES) == list(itertools.product(range(1, 5), repeat=3))


def test_each_grading_adds_a_shape_with_each_axis_past_4_drawn_afresh():
    draws = [draw_shapes() for _ in range(20)]
    for shapes in draws:
        assert shapes[:len(SHAPES)] == SHAPES
        drawn = shapes[len(SHAPES):]
        for k in range(3):  # a search over range(4) on any one axis shows
            assert any(shape[k] in DRAWN["long"] and shape[k] > 4 for shape in drawn), (k, drawn)
        assert all(math.prod(shape) <= 72 for shape in drawn), "the world stays small: a grading stays fast"
    assert len({tuple(shapes) for shapes in draws}) > 1, "drawn afresh"


@pytest.mark.parametrize("shape", SHAPES)
def test_the_reference_is_torchs_device_mesh_layout(shape):
    """init_device_mesh lays the ranks out as torch.arange(world_size).view(shape) (torch 2.13's device_mesh.py)."""
    mesh = torch.arange(math.prod(shape)).view(shape)
    for place in mesh_layout(math.prod(shape), *shape):
        d, p, t = (place.coordinate[axis] for axis in ("dp", "pp", "tp"))
        assert mesh[d, p, t] == place.rank
        assert place.groups == {"dp": tuple(mesh[:, p, t].tolist()), "pp": tuple(mesh[d, :, t].tolist()),
                                "tp": tuple(mesh[d, p, :].tolist())}


def test_right_coordinates_alone_are_told_to_write_the_groups():
    verdict = check_mesh_coordinates(divmod_coordinates)
    assert not verdict and "Your coordinates are right on every rank of all 64 shapes" in verdict.message
    assert "Now write groups(rank, dp, pp, tp)" in verdict.message


# ---- wrong coordinates, each with the words its message must have ----------------------------------------

WRONG_COORDINATES = {
    "tp outermost": (lambda r, dp, pp, tp: (r % dp, r // dp % pp, r // (dp * pp)),
                     ["rank 1 is at (dp 0, pp 0, tp 1)", "coordinates(1, 2, 2, 2) gives (1, 0, 0)",
                      "row-major in (tp, pp, dp)", "the axes reversed", "tp innermost"]),
    "pp and tp swapped": (lambda r, dp, pp, tp: (r // (pp * tp), r % pp, r // pp % tp),
                          ["row-major in (dp, tp, pp)", "pp and tp swapped"]),
    "dp and pp swapped": (lambda r, dp, pp, tp: (r // tp % dp, r // (dp * tp), r % tp),
                          ["dp and pp swapped"]),
    "ranks from 1": (lambda r, dp, pp, tp: divmod_coordinates(r + 1, dp, pp, tp),
                     ["rank 0 is at (dp 0, pp 0, tp 0)", "the coordinates of rank + 1", "ranks counted from 1"]),
    "coordinates from 1": (lambda r, dp, pp, tp: tuple(c + 1 for c in divmod_coordinates(r, dp, pp, tp)),
                           ["gives (1, 1, 1)", "Your coordinates count from 1"]),
    "world_size for pp * tp": (lambda r, dp, pp, tp: (r // (dp * pp * tp), r // tp % pp, r % tp),
                               ["rank 4 is at (dp 1, pp 0, tp 0)", "your dp coordinate is 0 on every rank (as rank // "
                                "world_size is) (world_size counts every rank"]),
    "tp modulo dp": (lambda r, dp, pp, tp: (r // (pp * tp), r // tp % pp, r % dp),
                     ["On dp=1 x pp=1 x tp=2, rank 1 is at (dp 0, pp 0, tp 1)", "gives (0, 0, 0)",
                      "On every shape, your tp coordinate is rank % dp (on dp=2 x pp=1 x tp=1 it gives rank 1 tp 1, "
                      "past the axis's last index, 0)"]),
    "no modulo": (lambda r, dp, pp, tp: (r // (pp * tp), r // tp, r % tp),
                  ["rank 4", "your pp coordinate is rank // tp (on dp=2 x pp=2 x tp=2 it gives rank 4 pp 2, past the "
                   "axis's last index, 1)"]),
    "pp before dividing": (lambda r, dp, pp, tp: (r // (pp * tp), r % pp, r % tp),
                           ["gives (0, 1, 1)", "On every shape, your pp coordinate is rank % pp."]),
    "true division": (lambda r, dp, pp, tp: (r / (pp * tp), r // tp % pp, r % tp),
                      ["coordinates(0, 2, 2, 2) returned (0.0, 0, 0)", "a float (true division, /, gives floats)"]),
    "raises": (lambda r, dp, pp, tp: (r // (pp * tp), r // tp % pp, r % (tp - 1)),
               ["Your coordinates(0, 1, 1, 1) (rank=0, dp=1, pp=1, tp=1) raised ZeroDivisionError"]),
    "two numbers": (lambda r, dp, pp, tp: (r // tp, r % tp), ["return three numbers, (dp_i, pp_j, tp_k), not 2."]),
    "shared places": (lambda r, dp, pp, tp: (0 if r == 4 else r // (pp * tp), r // tp % pp, r % tp),
                      ["rank 4 is at (dp 1, pp 0, tp 0)", "Ranks 0 and 4 both get (0, 0, 0)"]),
    "ready-made": (lambda r, dp, pp, tp: mesh_layout(dp * pp * tp, dp, pp, tp)[r].coordinate,
                   ["Your coordinates calls labkit.parallel.mesh_layout, the course's own layout"]),
    "the planner's layout": (lambda r, dp, pp, tp: ParallelLayout(dp, pp, tp).place(r),
                             ["Your coordinates calls labkit.plan.ParallelLayout(...).place, the course's own layout",
                              "compute the coordinates and groups from the rank and the sizes yourself"]),
}


# ---- issue 27: honest mistakes that the old fixed shapes (every axis up to 4, always in one order) let pass ------

GRADINGS = 3  # each of these is graded on this many fresh draws: it must be refused on every one


def searched_in_range_4(rank, dp, pp, tp):
    """A search for the rank's place over range(4) on each axis: the grid's sizes, not the mesh's."""
    for d, p, t in itertools.product(range(4), repeat=3):
        if d < dp and p < pp and t < tp and (d * pp + p) * tp + t == rank:
            return d, p, t
    return None


def groups_in_range_4(rank, dp, pp, tp):
    """Each group built over range(4) of its axis, capped at the axis's size as the student thought of it."""
    d, p, t = divmod_coordinates(rank, dp, pp, tp)
    at = lambda d, p, t: (d * pp + p) * tp + t  # noqa: E731
    return {"dp": [at(i, p, t) for i in range(min(dp, 4))], "pp": [at(d, j, t) for j in range(min(pp, 4))],
            "tp": [at(d, p, k) for k in range(min(tp, 4))]}


TABLE = {(r, *shape): divmod_coordinates(r, *shape) for shape in SHAPES for r in range(math.prod(shape))}


def cached_per_rank():
    """A cache keyed on the rank alone: right for the first shape asked, stale for every other."""
    seen = {}
    return lambda rank, dp, pp, tp: seen.setdefault(rank, divmod_coordinates(rank, dp, pp, tp))


def replayed_in_an_earlier_order():
    """Right coordinates recorded during one grading, handed back one per call in the order they were asked."""
    asked = []
    check_mesh_coordinates(lambda *call: asked.append(call) or divmod_coordinates(*call), divmod_groups,
                           record=False)
    answers = deque(divmod_coordinates(*call) for call in asked)
    return lambda rank, dp, pp, tp: answers.popleft() if answers else (0, 0, 0)


WRONG_COORDINATES.update({
    "a search over range(4)": (searched_in_range_4, ["returned None: return three numbers"]),
    "a table for the 64 shapes": (lambda r, dp, pp, tp: TABLE[r, dp, pp, tp], ["raised KeyError"]),
    # stale answers: the verdict shows the first rank whose place they miss (which one depends on the draw)
    "a cache keyed on the rank": (cached_per_rank, ["is at (dp", "your coordinates("]),
    "answers replayed in an earlier order": (replayed_in_an_earlier_order, ["is at (dp", "your coordinates("]),
})
MADE_PER_GRADING = {"a cache keyed on the rank", "answers replayed in an earlier order"}  # fresh state each time


@pytest.mark.parametrize("name", WRONG_COORDINATES)
def test_wrong_coordinates_are_rejected_with_their_mistake_named(name):
    for _ in range(GRADINGS if name in WRONG_COORDINATES_ISSUE_27 else 1):
        fn, words = WRONG_COORDINATES[name]
        verdict = check_mesh_coordinates(fn() if name in MADE_PER_GRADING else fn, divmod_groups)
        assert not verdict and repr(verdict).startswith("Not yet. "), verdict
        for word in words:
            assert word in verdict.message, (name, word, verdict.message)


WRONG_COORDINATES_ISSUE_27 = {"a search over range(4)", "a table for the 64 shapes", *MADE_PER_GRADING}


def test_a_search_over_range_4_is_refused_on_a_drawn_shape_past_4():
    verdict = check_mesh_coordinates(searched_in_range_4, divmod_groups)
    shape = tuple(int(n) for n in re.search(r"coordinates\(\d+, (\d+), (\d+), (\d+)\)", verdict.message).groups())
    assert max(shape) > 4 and shape not in SHAPES, verdict


# ---- wrong groups ----------------------------------------------------------------------------------------

def without_rank(rank, dp, pp, tp):
    return {axis: [r for r in group if r != rank] for axis, group in divmod_groups(rank, dp, pp, tp).items()}


def rank_first(rank, dp, pp, tp):
    return {axis: [rank] + [r for r in group if r != rank] for axis, group in divmod_groups(rank, dp, pp, tp).items()}


def dp_by_tp_only(rank, dp, pp, tp):
    """The dp group as every rank with the same tp coordinate: it takes in the pp neighbours too."""
    return divmod_groups(rank, dp, pp, tp) | {"dp": [r for r in range(dp * pp * tp) if r % tp == rank % tp]}


def dp_stride_tp(rank, dp, pp, tp):
    """The dp group stepping by tp from the rank's place in replica 0, as if there were no pp axis."""
    return divmod_groups(rank, dp, pp, tp) | {"dp": [rank % (pp * tp) + i * tp for i in range(dp)]}


def tp_sharing_coordinate(rank, dp, pp, tp):
    """The tp group as the ranks with the rank's tp coordinate: the opposite of a tp group."""
    return divmod_groups(rank, dp, pp, tp) | {"tp": [r for r in range(dp * pp * tp) if r % tp == rank % tp]}


def pp_consecutive(rank, dp, pp, tp):
    """The pp group as consecutive ranks, as if pp were innermost."""
    start = rank // (pp * tp) * pp * tp + rank % tp * pp
    return divmod_groups(rank, dp, pp, tp) | {"pp": list(range(start, start + pp))}


def dp_one_too_many(rank, dp, pp, tp):
    """The dp group over range(dp + 1): one replica past the mesh."""
    d, p, t = divmod_coordinates(rank, dp, pp, tp)
    return divmod_groups(rank, dp, pp, tp) | {"dp": [(i * pp + p) * tp + t for i in range(dp + 1)]}


WRONG_GROUPS = {
    "without the rank": (without_rank, ['groups(0, 2, 2, 2)["dp"] is [4]', "does not hold rank 0 itself"]),
    "unsorted": (rank_first, ['rank 1 is at (dp 0, pp 0, tp 1); your groups(1, 2, 2, 2)["tp"] is [1, 0]',
                              "the mesh's tp group is [0, 1]", "out of order: sort them"]),
    "other-axis neighbours": (dp_by_tp_only, ["is [0, 2, 4, 6], the mesh's dp group is [0, 4]",
                                              "also holds rank 2, at (dp 0, pp 1, tp 0), which differs from rank 0 "
                                              "on pp too"]),
    "dp stride tp": (dp_stride_tp, ['groups(0, 2, 2, 2)["dp"] is [0, 2]', "Yours steps by tp = 2 ranks",
                                    "the mesh's dp group steps by 4 here"]),
    "sharing the coordinate": (tp_sharing_coordinate, ["the ranks with the same tp coordinate as rank 0",
                                                       "The tp group is the opposite"]),
    "pp consecutive": (pp_consecutive, ['["pp"] is [0, 1]', "Yours steps by 1 rank;",
                                        "the mesh's pp group steps by 2 here"]),
    "range(dp + 1)": (dp_one_too_many,
                      ['groups(0, 2, 2, 2)["dp"] is [0, 4, 8]', "holds rank 8, which is not on this mesh: its ranks "
                       "are 0 to 7"]),
    "a set": (lambda r, dp, pp, tp: divmod_groups(r, dp, pp, tp) | {"tp": set(divmod_groups(r, dp, pp, tp)["tp"])},
              ['groups["tp"] is a set: return a sorted list']),
    "twice": (lambda r, dp, pp, tp: divmod_groups(r, dp, pp, tp) | {"tp": [r] + divmod_groups(r, dp, pp, tp)["tp"]},
              ["holds rank 0 twice"]),
    "no dict": (lambda r, dp, pp, tp: [[r]] * 3, ['return a dict with the keys "dp", "pp" and "tp"']),
}


WRONG_GROUPS["groups over range(4)"] = (groups_in_range_4, ["ranks; a group on"])  # "Yours holds 4 ranks; ... = 5"


@pytest.mark.parametrize("name", WRONG_GROUPS)
def test_wrong_groups_are_rejected_with_their_mistake_named(name):
    for _ in range(GRADINGS if name == "groups over range(4)" else 1):
        fn, words = WRONG_GROUPS[name]
        verdict = check_mesh_coordinates(divmod_coordinates, fn)
        assert not verdict and repr(verdict).startswith("Not yet. "), verdict
        for word in words:
            assert word in verdict.message, (name, word, verdict.message)


def test_other_arguments_are_refused_showing_what_came_back():
    assert "pass your functions themselves" in check_mesh_coordinates("coordinates").message
    assert "groups is str" in check_mesh_coordinates(divmod_coordinates, "groups").message


def test_an_endless_loop_is_stopped_within_the_timeout():
    def endless(rank, dp, pp, tp):
        while True:
            pass

    def swallowing(rank, dp, pp, tp):
        """An endless loop that catches every Exception: the grader's stop is not one."""
        while True:
            try:
                pass
            except Exception:  # noqa: BLE001
                pass

    for fn in (endless, swallowing):
        started = time.monotonic()
        verdict = check_mesh_coordinates(divmod_coordinates, fn, timeout_seconds=0.5)
        assert not verdict and time.monotonic() - started < 5, verdict
        assert re.search(r"Your groups\(0, 2, 2, 2\) was still running when the 0\.5 s for all the 1,[0-9]{3} ranks' "
                         r"calls ran out, and was stopped: an endless loop\?", verdict.message), verdict


def test_the_ready_made_mesh_is_refused_too():
    verdict = check_mesh_coordinates(divmod_coordinates, lambda r, dp, pp, tp: Mesh(dp, pp, tp))
    assert "Your groups calls labkit.parallel.Mesh, the course's own layout" in verdict.message, verdict


def planner_groups(rank, dp, pp, tp):
    """The groups from the planner's places: every rank whose place matches the rank's off the axis."""
    layout = ParallelLayout(dp, pp, tp)
    mine = layout.place(rank)
    return {axis: [r for r in range(dp * pp * tp)
                   if all(layout.place(r)[other] == mine[other] for other in ("dp", "pp", "tp") if other != axis)]
            for axis in ("dp", "pp", "tp")}


def test_the_planners_layout_is_refused_in_the_groups_too():
    verdict = check_mesh_coordinates(divmod_coordinates, planner_groups)
    assert not verdict, verdict
    assert "Your groups calls labkit.plan.ParallelLayout(...).place, the course's own layout" in verdict.message


def test_the_grader_restores_a_tracer_that_was_set():
    tracer = lambda frame, event, arg: None  # noqa: E731
    sys.settrace(tracer)
    try:
        check_mesh_coordinates(divmod_coordinates, divmod_groups, record=False)
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)


def _layout_in_a_thread(rank, dp, pp, tp):
    """The course's layout computed in a thread of the student's, out of the tracer's sight."""
    import threading

    from labkit.exercises import ForbiddenCall
    from labkit.parallel import mesh_layout
    found = []

    def look_up():
        try:
            found.append(mesh_layout(dp * pp * tp, dp, pp, tp)[rank])
        except ForbiddenCall:
            pass  # the student's thread swallows the refusal; the grader still reports it

    thread = threading.Thread(target=look_up)
    thread.start()
    thread.join()
    place = found[0] if found else None
    return tuple(place.coordinate[a] for a in ("dp", "pp", "tp")) if place else (0, 0, 0)


def _layout_after_settrace_none(rank, dp, pp, tp):
    import sys

    from labkit.parallel import mesh_layout
    sys.settrace(None)
    place = mesh_layout(dp * pp * tp, dp, pp, tp)[rank]
    return tuple(place.coordinate[a] for a in ("dp", "pp", "tp"))


@pytest.mark.parametrize("fn", [_layout_in_a_thread, _layout_after_settrace_none])
def test_the_course_layout_is_refused_where_it_runs(fn):
    """Issue 27, ready-made helpers reached around the tracer: mesh_layout refuses itself while graded."""
    verdict = check_mesh_coordinates(fn, record=False)
    assert not verdict and "labkit.parallel.mesh_layout" in verdict.message and "course's own layout" in \
        verdict.message, verdict
    from labkit.parallel import mesh_layout
    assert mesh_layout(4, tp=2)[1].coordinate["tp"] == 1  # and works again once the grader is done
