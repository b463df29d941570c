"""The mesh grader of notebook 13: a rank's (dp, pp, tp) coordinates and its three groups, checked with no processes.

The student writes two functions of `(rank, dp, pp, tp)`, the global rank and the mesh's three sizes:

    coordinates(rank, dp, pp, tp) -> (dp_i, pp_j, tp_k)       the rank's index on each axis
    groups(rank, dp, pp, tp) -> {"dp": [...], "pp": [...], "tp": [...]}
                                                               on each axis, the global ranks that share the rank's
                                                               other two coordinates, itself included, sorted

The layout is the course's `Mesh`, which is torch's own DeviceMesh (`init_device_mesh`, whose ranks are
`torch.arange(world_size).view(dp, pp, tp)`): row-major in (dp, pp, tp), tp innermost, as Megatron-LM lays it out
so that a tensor-parallel group's ranks are consecutive, one node's GPUs (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", section 3):

    rank = (dp_i * pp + pp_j) * tp + tp_k

`check_mesh_coordinates(coordinates, groups)` compares both with `labkit.parallel.mesh_layout` (the same layout,
computed without processes; notebook 13 checks it against the real Mesh) on every rank of all 64 shapes with 1 to
4 ranks per axis and of three larger shapes drawn afresh at each grading, each with one axis of 5 to 8 ranks
(`draw_shapes`: a search over range(4) shows). Notebook 13's 2 x 2 x 2 is asked first, rank by rank; the other
calls come in a shuffled order, so that an answer cannot lean on the calls before it (a table filled in the
grader's old order). The first mistake, on the first shape (in the order above) and rank that show it, is
reported, named where the grader recognises it: another axis order (tp outermost, pp and tp swapped, ...), an
axis's formula
(which one the student's numbers follow, on every shape: world_size where a product of sizes belongs, a missing
modulo, the wrong axis's size), coordinates or ranks counted from 1, true division; groups without the rank,
unsorted, holding ranks off the mesh or ranks that differ on another axis too, or stepping by the wrong stride.
Calling the course's own layouts, `mesh_layout`, `Mesh` or the planner's `ParallelLayout(...).place`, is refused:
the exercise is to compute the layout. The student's
calls run under a tracer (sys.settrace) that stops them after `timeout_seconds` seconds in all: an endless loop fails,
it does not hang the notebook.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import random
import sys
import time
from typing import NamedTuple

from labkit._refusals import ForbiddenCall, refusing
from labkit.exercises._kit._pace import grading_seconds
from labkit.exercises.progress import graded
from labkit.exercises.verdict import Verdict
from labkit.parallel.mesh import AXES, Mesh, mesh_layout
from labkit.plan import ParallelLayout

__all__ = ["DRAWN", "SHAPES", "check_mesh_coordinates", "draw_shapes"]

# (dp, pp, tp): notebook 13's mesh first, then every shape of 1 to 4 ranks per axis, the smaller worlds first
SHAPES = [(2, 2, 2)] + sorted((shape for shape in itertools.product(range(1, 5), repeat=3) if shape != (2, 2, 2)),
                              key=lambda shape: (math.prod(shape), shape))
# The larger shapes drawn at each grading: per axis one shape where that axis is long (past range(4)) and the
# other two short, so that the world stays small (at most 8 x 3 x 3 = 72 ranks) and a grading fast.
DRAWN = {"long": range(5, 9), "short": range(1, 4)}
LAYOUT = "rank = (dp_i * pp + pp_j) * tp + tp_k"  # the notebook's statement of the layout; inverting it is the task
_SIZES = {"1": (), "tp": ("tp",), "pp": ("pp",), "dp": ("dp",), "pp * tp": ("pp", "tp"), "dp * tp": ("dp", "tp"),
          "dp * pp": ("dp", "pp"), "world_size": AXES}  # the sizes a student's formula may divide by or take modulo
_READY_MADE = {mesh_layout.__code__: "labkit.parallel.mesh_layout", Mesh.__init__.__code__: "labkit.parallel.Mesh",
               ParallelLayout.place.__code__: "labkit.plan.ParallelLayout(...).place"}  # the course's own layouts
TIMEOUT_SECONDS = 20.0  # for all the student's calls together: right solutions take 0.1 to 1 s on 2 busy cores


class _Stopped(BaseException):
    """The student's function was stopped: it called the course's own layout, or ran out of time. A BaseException,
    so that the student's own `except Exception` cannot swallow it; its message is the verdict's."""


class _Budget(NamedTuple):
    """The time the student's calls have together: `seconds` in all, until time.monotonic() reaches `deadline`,
    for the `ranks` calls of one grading."""

    seconds: float
    deadline: float
    ranks: int


def draw_shapes() -> list[tuple[int, int, int]]:
    """The shapes of one grading: SHAPES (notebook 13's first), then one drawn shape per axis with that axis long
    (DRAWN), drawn afresh each time."""
    drawn = []
    for k in range(len(AXES)):
        shape = [random.choice(DRAWN["short"]) for _ in AXES]
        shape[k] = random.choice(DRAWN["long"])
        drawn.append(tuple(shape))
    return SHAPES + sorted(drawn, key=lambda shape: (math.prod(shape), shape))


def _calls(shapes: list[tuple[int, int, int]]) -> list[tuple[tuple[int, int, int], int]]:
    """(shape, rank) for every rank of every shape: the first shape's ranks in order, the rest shuffled."""
    rest = [(shape, rank) for shape in shapes[1:] for rank in range(math.prod(shape))]
    random.shuffle(rest)
    return [(shapes[0], rank) for rank in range(math.prod(shapes[0]))] + rest


@graded("mesh_coordinates")
def check_mesh_coordinates(coordinates, groups=None, *, timeout_seconds: float = TIMEOUT_SECONDS) -> Verdict:
    """Grade `coordinates(rank, dp, pp, tp)` and `groups(rank, dp, pp, tp)` on every rank of 64 mesh shapes and
    three larger ones drawn for this grading, in a shuffled order;
    `timeout_seconds`: the seconds all their calls may take together (an endless loop is stopped, not waited for).

    >>> right = lambda rank, dp, pp, tp: (rank // (pp * tp), rank // tp % pp, rank % tp)
    >>> check_mesh_coordinates(right)
    Not yet. Your coordinates are right on every rank of all 64 shapes...
    >>> check_mesh_coordinates(lambda rank, dp, pp, tp: (rank % dp, rank // dp % pp, rank // (dp * pp)))
    Not yet. On dp=2 x pp=2 x tp=2, rank 1 is at (dp 0, pp 0, tp 1); your coordinates(1, 2, 2, 2) gives (1, 0, 0)...
    """
    for name, fn in (("coordinates", coordinates), ("groups", groups)):
        if not callable(fn) and (fn is not None or name == "coordinates"):
            return Verdict(False, f"pass your functions themselves, e.g. check_mesh_coordinates(coordinates, "
                                  f"groups); {name} is {type(fn).__name__}.")
    seconds = grading_seconds("timeout_seconds", timeout_seconds)
    shapes = draw_shapes()
    for shape in shapes:
        _reference(shape)  # the course's layout computed (and cached) before it refuses to run (below)
    budget = _Budget(seconds, time.monotonic() + seconds, sum(map(math.prod, shapes)))
    try:
        with refusing(tuple(_READY_MADE.values())) as refused:
            problem = (_coordinates_problem(coordinates, shapes, budget)
                       or (_groups_problem(groups, shapes, budget) if groups else None))
    except _Stopped as stopped:
        problem = str(stopped)
    if refused and not (problem and refused[0] in problem):  # refused in a thread of the student's, or caught
        problem = (f"your functions called {refused[0]} (and caught the error; it still counts), the course's own "
                   f"layout: compute the coordinates and groups from the rank and the sizes yourself ({LAYOUT}).")
    if problem:
        return Verdict(False, problem[0].upper() + problem[1:])
    larger = ", ".join(" x ".join(map(str, shape)) for shape in shapes[len(SHAPES):])
    checked = (f"on every rank of all {len(SHAPES)} shapes from 1 x 1 x 1 to 4 x 4 x 4 and of {larger} (drawn for "
               f"this grading), asked in a shuffled order ({budget.ranks:,} ranks)")
    if groups is None:
        return Verdict(False, f"Your coordinates are right {checked}. Now write groups(rank, dp, pp, tp) and pass "
                              "both: check_mesh_coordinates(coordinates, groups).")
    return Verdict(True, f"your coordinates and groups are the mesh's {checked}: row-major in (dp, pp, tp), tp "
                         "innermost, as torch's DeviceMesh lays out torch.arange(world_size).view(dp, pp, tp), so "
                         "a tp group is consecutive ranks, and each group holds the ranks that differ from yours "
                         "on its axis alone.")


@functools.cache
def _reference(shape: tuple[int, int, int]) -> tuple[list[tuple[int, ...]], list[dict[str, list[int]]]]:
    """Every rank's coordinates and groups on `shape`, from mesh_layout."""
    places = mesh_layout(math.prod(shape), *shape)
    return ([tuple(place.coordinate[axis] for axis in AXES) for place in places],
            [{axis: list(place.groups[axis]) for axis in AXES} for place in places])


def _watched_call(fn, name: str, rank: int, shape: tuple[int, int, int], budget: _Budget):
    """fn(rank, *shape), and the problem if it raised. A tracer (sys.settrace) stops it with _Stopped when it calls
    the course's own layout, or when the budget's deadline has passed; the layout also refuses itself where it runs
    (labkit._refusals: in a thread of the student's, after a sys.settrace(None) of its own)."""
    def trace(frame, event, arg):
        if event == "call" and frame.f_code in _READY_MADE:
            raise _Stopped(f"your {name} calls {_READY_MADE[frame.f_code]}, the course's own layout: compute the "
                           f"coordinates and groups from the rank and the sizes yourself ({LAYOUT}).")
        if time.monotonic() > budget.deadline:
            raise _Stopped(f"{_call(name, rank, shape)} was still running when the {budget.seconds:g} s for all the "
                           f"{budget.ranks:,} ranks' calls ran out, and was stopped: an endless loop? "
                           "Each call needs only a few divisions (or a loop over the world's ranks).")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        answer = fn(rank, *shape)
    except ForbiddenCall as refused:  # the course's layout refused itself where it ran (labkit._refusals)
        raise _Stopped(f"your {name} calls {refused.spelling}, the course's own layout: compute the coordinates and "
                       f"groups from the rank and the sizes yourself ({LAYOUT}).") from None
    except Exception as error:  # noqa: BLE001 - the student's error, reported with the call that raised it
        return None, (f"{_call(name, rank, shape)} (rank={rank}, dp={shape[0]}, pp={shape[1]}, tp={shape[2]}) "
                      f"raised {type(error).__name__}: {error}")
    finally:
        sys.settrace(previous)
    return answer, None


def _first(problems: dict, shapes: list[tuple[int, int, int]]) -> str:
    """The problem of the first (shape, rank) in the grading's order, whatever order the calls came in: the
    smallest case reads best."""
    return problems[min(problems, key=lambda call: (shapes.index(call[0]), call[1]))]


def _call(name: str, rank: int, shape: tuple[int, int, int]) -> str:
    """The call as the student would type it: coordinates(5, 2, 2, 2)."""
    return f"your {name}({rank}, {', '.join(map(str, shape))})"


def _on(shape: tuple[int, int, int]) -> str:
    return "dp={} x pp={} x tp={}".format(*shape)


def _whole(value) -> int | str:
    """`value` as an int, or why it is not one (a float from /, a bool, something else)."""
    if isinstance(value, bool):
        return f"{value!r} (a bool)"
    if isinstance(value, float):
        return f"{value!r}, a float (true division, /, gives floats)"
    try:
        return operator.index(value)
    except TypeError:
        return f"{value!r} ({type(value).__name__}), not a whole number"


def _answers(fn, name: str, read, show, shapes: list[tuple[int, int, int]], budget: _Budget):
    """fn's answer for every rank of every shape, called in the grading's shuffled order and read by `read` (which
    returns the answer, or a str saying what is wrong with it); and the problem of the first call, in shape order,
    that raised or gave an unreadable answer (`show` prints that answer), or None."""
    answers, problems = {shape: [None] * math.prod(shape) for shape in shapes}, {}
    for shape, rank in _calls(shapes):
        answer, problem = _watched_call(fn, name, rank, shape, budget)
        taken = problem or read(answer)
        if isinstance(taken, str):
            problems[shape, rank] = taken if problem else f"{_call(name, rank, shape)} returned {show(answer)}: {taken}"
        answers[shape][rank] = taken
    return answers, (_first(problems, shapes) if problems else None)


# ---- coordinates ---------------------------------------------------------------------------------------------

def _coordinates_problem(coordinates, shapes: list[tuple[int, int, int]], budget: _Budget) -> str | None:
    """What is wrong with `coordinates` on the first shape it gets wrong, or None."""
    answers, problem = _answers(coordinates, "coordinates", _triple, repr, shapes, budget)
    if problem:
        return problem
    wrong = next((shape for shape in shapes if answers[shape] != _reference(shape)[0]), None)
    return None if wrong is None else _coordinates_mistake(answers, wrong)


def _triple(answer) -> tuple[int, int, int] | str:
    """`answer` as (dp_i, pp_j, tp_k), or why it cannot be read as one. A dict {"dp": .., "pp": .., "tp": ..}
    (what Mesh.coordinate gives) and a tensor or array of three numbers are read too."""
    if isinstance(answer, dict):
        if sorted(answer) != sorted(AXES):
            return 'return (dp_i, pp_j, tp_k), or a dict with the keys "dp", "pp" and "tp".'
        answer = [answer[axis] for axis in AXES]
    if isinstance(answer, (str, bytes, set)) or not hasattr(answer, "__iter__"):
        return f"return three numbers, (dp_i, pp_j, tp_k), not {type(answer).__name__}."
    values = [_whole(value) for value in answer]
    if len(values) != 3:
        return f"return three numbers, (dp_i, pp_j, tp_k), not {len(values)}."
    bad = next((value for value in values if isinstance(value, str)), None)
    return f"each coordinate must be a whole number; one is {bad}." if bad else tuple(values)


def _coordinates_mistake(answers: dict, shape: tuple[int, int, int]) -> str:
    """The message for coordinates that first go wrong on `shape`: the first wrong rank, and the mistake named."""
    want = _reference(shape)[0]
    rank = next(rank for rank, (mine, theirs) in enumerate(zip(answers[shape], want, strict=True)) if mine != theirs)
    where = (f"On {_on(shape)}, rank {rank} is at (dp {want[rank][0]}, pp {want[rank][1]}, tp {want[rank][2]}); "
             f"{_call('coordinates', rank, shape)} gives {answers[shape][rank]}. ")
    named = _counted_from_one(answers) or _axis_order(answers) or _axis_formulas(answers)
    return where + (named or _unexplained(answers[shape], shape))


def _counted_from_one(answers: dict) -> str | None:
    """Coordinates counted from 1, or the coordinates of rank + 1, on every shape."""
    if all(got == [tuple(c + 1 for c in coordinate) for coordinate in _reference(shape)[0]]
           for shape, got in answers.items()):
        return "Your coordinates count from 1; they count from 0, as ranks do: rank 0 is at (0, 0, 0)."
    if all(got == [_row_major(rank + 1, shape, AXES) for rank in range(len(got))] for shape, got in answers.items()):
        return ("Yours are the coordinates of rank + 1 (ranks counted from 1?). Ranks count from 0 (labkit.rank(), "
                "torch.distributed.get_rank()): rank 0 is at (0, 0, 0).")
    return None


def _row_major(rank: int, shape: tuple[int, int, int], order: tuple[str, ...]) -> tuple[int, int, int]:
    """(dp_i, pp_j, tp_k) of `rank` when the ranks are laid out row-major in the axis order `order` (outermost
    first); the outermost coordinate is not taken modulo its size."""
    sizes, coordinate = dict(zip(AXES, shape, strict=True)), {}
    for axis in reversed(order[1:]):
        rank, coordinate[axis] = divmod(rank, sizes[axis])
    coordinate[order[0]] = rank
    return tuple(coordinate[axis] for axis in AXES)


def _axis_order(answers: dict) -> str | None:
    """Coordinates that are row-major in another order of the axes, on every shape."""
    for order in itertools.permutations(AXES):
        if order != AXES and all(got == [_row_major(rank, shape, order) for rank in range(len(got))]
                                 for shape, got in answers.items()):
            return (f"Your layout is row-major in ({', '.join(order)}): {order[0]} outermost, {order[2]} innermost"
                    f"{_ORDER_NAMES.get(order, '')}. The mesh (torch's DeviceMesh, Megatron-LM) is row-major in "
                    "(dp, pp, tp): tp innermost, so that a tp group is consecutive ranks, on one node.")
    return None


_ORDER_NAMES = {("tp", "pp", "dp"): ", the axes reversed", ("dp", "tp", "pp"): ": pp and tp swapped",
                ("pp", "dp", "tp"): ": dp and pp swapped"}


def _axis_formulas(answers: dict) -> str | None:
    """For every axis whose coordinate is wrong somewhere, the formula of `rank` it follows on every shape."""
    found = []
    for k, axis in enumerate(AXES):
        if all([c[k] for c in got] == [c[k] for c in _reference(shape)[0]] for shape, got in answers.items()):
            continue
        formula = next((spelled for spelled, compute in _formulas()
                        if all(c[k] == compute(rank, shape) for shape, got in answers.items()
                               for rank, c in enumerate(got))), None)
        if formula is None:
            return None
        if formula == "rank // world_size":
            formula = "0 on every rank (as rank // world_size is)"
        note = " (world_size counts every rank, this axis's own too)" if "world_size" in formula else \
            _out_of_range(answers, k)
        found.append(f"your {axis} coordinate is {formula}{note}")
    return "On every shape, " + "; ".join(found) + "." if found else None


def _out_of_range(answers: dict, k: int) -> str:
    """Where axis k's coordinate first leaves its range, 0 to size - 1, as a note; "" if it never does."""
    for shape, got in answers.items():
        for rank, coordinate in enumerate(got):
            if not 0 <= coordinate[k] < shape[k]:
                return (f" (on {_on(shape)} it gives rank {rank} {AXES[k]} {coordinate[k]}, past the axis's last "
                        f"index, {shape[k] - 1})")
    return ""


def _formulas():
    """(spelled, compute(rank, shape)) for rank // A and (rank // A) % B, A and B products of the sizes."""
    for a in _SIZES:
        divided = "rank" if a == "1" else f"rank // {_parenthesised(a)}"
        yield divided, lambda rank, shape, a=a: rank // _size(a, shape)
        for b in _SIZES:
            if b != "1":
                modulo = f"{divided if a == '1' else f'({divided})'} % {_parenthesised(b)}"
                yield modulo, lambda rank, shape, a=a, b=b: rank // _size(a, shape) % _size(b, shape)


def _parenthesised(name: str) -> str:
    return f"({name})" if " " in name else name


def _unexplained(got: list[tuple[int, int, int]], shape: tuple[int, int, int]) -> str:
    """What can still be said of coordinates the grader does not recognise: out of range, or shared."""
    for rank, coordinate in enumerate(got):
        for axis, value, size in zip(AXES, coordinate, shape, strict=True):
            if not 0 <= value < size:
                return (f"Rank {rank}'s {axis} coordinate is {value}, but the {axis} axis has {size} ranks, 0 to "
                        f"{size - 1}.")
    twice = next(((first, rank) for rank, coordinate in enumerate(got) for first in range(rank)
                  if got[first] == coordinate), None)
    if twice:
        return f"Ranks {twice[0]} and {twice[1]} both get {got[twice[1]]}: each place on the mesh holds one rank."
    return "Each rank has its own place, but not the mesh's."


# ---- groups --------------------------------------------------------------------------------------------------

def _groups_problem(groups, shapes: list[tuple[int, int, int]], budget: _Budget) -> str | None:
    """What is wrong with `groups` on the first rank and axis it gets wrong, or None."""
    answers, problem = _answers(groups, "groups", _read_groups, _short, shapes, budget)
    if problem:
        return problem
    for shape in shapes:
        for rank, (mine, theirs) in enumerate(zip(answers[shape], _reference(shape)[1], strict=True)):
            axis = next((axis for axis in AXES if mine[axis] != theirs[axis]), None)
            if axis:
                return _group_mistake(answers, shape, rank, axis)
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _read_groups(answer) -> dict[str, list[int]] | str:
    """`answer` as {"dp": [...], "pp": [...], "tp": [...]}, or why it cannot be read as one."""
    if not isinstance(answer, dict) or sorted(answer) != sorted(AXES):
        return 'return a dict with the keys "dp", "pp" and "tp", each the list of its group\'s global ranks.'
    read = {}
    for axis in AXES:
        group = answer[axis]
        if isinstance(group, (set, frozenset)):
            return f'groups["{axis}"] is a set: return a sorted list, group rank 0 first.'
        if isinstance(group, (str, bytes, dict)) or not hasattr(group, "__iter__"):
            return f'groups["{axis}"] is a {type(group).__name__}: return a list of global ranks.'
        read[axis] = [_whole(rank) for rank in group]
        bad = next((rank for rank in read[axis] if isinstance(rank, str)), None)
        if bad:
            return f'groups["{axis}"] must hold whole numbers (global ranks); one is {bad}.'
    return read


def _group_mistake(answers: dict, shape: tuple[int, int, int], rank: int, axis: str) -> str:
    """The message for the first group that is wrong: rank `rank`'s on `axis`, on `shape`."""
    coordinates, want = _reference(shape)[0], _reference(shape)[1][rank][axis]
    mine, others = answers[shape][rank][axis], [other for other in AXES if other != axis]
    here = dict(zip(AXES, coordinates[rank], strict=True))
    where = (f"On {_on(shape)}, rank {rank} is at (dp {here['dp']}, pp {here['pp']}, tp {here['tp']}); "
             f'{_call("groups", rank, shape)}["{axis}"] is {mine}, the mesh\'s {axis} group is {want}: the ranks '
             f"that share rank {rank}'s {others[0]} and {others[1]} coordinates, itself included, sorted. ")
    sharing = [other for other, coordinate in enumerate(coordinates) if coordinate[AXES.index(axis)] == here[axis]]
    if rank not in mine:
        return where + (f"Yours does not hold rank {rank} itself: a group lists all its members, the rank included "
                        "(torch.distributed.new_group takes every member's global rank).")
    outside = [other for other in mine if not 0 <= other < len(coordinates)]
    if outside:
        return where + (f"Yours holds rank {outside[0]}, which is not on this mesh: its ranks are 0 to "
                        f"{len(coordinates) - 1} (range(n) runs from 0 to n - 1).")
    if len(set(mine)) < len(mine):
        return where + f"Yours holds rank {next(r for r in mine if mine.count(r) > 1)} twice."
    if sorted(mine) == want:
        return where + ("Yours holds the right ranks, out of order: sort them. A group numbers its ranks in "
                        "ascending global rank (group rank 0 is the smallest), as new_group and the DeviceMesh do.")
    if sorted(mine) == sharing and len(sharing) > 1:
        return where + (f"Yours are the ranks with the same {axis} coordinate as rank {rank}: they differ from it on "
                        f"the other axes. The {axis} group is the opposite: the same {others[0]} and {others[1]} "
                        f"coordinates, every {axis} coordinate.")
    if set(mine) > set(want):
        extra = next(other for other in mine if other not in want)
        differ = [other for k, other in enumerate(AXES) if coordinates[extra][k] != here[other] and other != axis]
        return where + (f"Yours also holds rank {extra}, at (dp {coordinates[extra][0]}, pp {coordinates[extra][1]}, "
                        f"tp {coordinates[extra][2]}), which differs from rank {rank} on {' and '.join(differ)} too: "
                        f"a group on {axis} holds only the ranks that differ from it on {axis} alone.")
    return where + _stride_problem(answers, shape, rank, axis)


def _stride_problem(answers: dict, shape: tuple[int, int, int], rank: int, axis: str) -> str:
    """A group stepping through the ranks by the wrong stride, named by the product of sizes it follows on every
    shape; else its size, or nothing more to say."""
    mine, want = answers[shape][rank][axis], _reference(shape)[1][rank][axis]
    stride = _stride(mine)
    if stride and len(mine) == len(want) and stride != _stride(want):
        strides = {(s, r): _stride(answers[s][r][axis]) for s in answers for r in range(math.prod(s))}
        name = next((name for name in _SIZES
                     if all(found is None or found == _size(name, s) for (s, _), found in strides.items())), None)
        followed = f"{name} = {stride}" if name and name != "1" else f"{stride}"
        return (f"Yours steps by {followed} rank{'s' if stride > 1 else ''}; the mesh's {axis} group steps by "
                f"{_stride(want)} here.")
    if len(mine) != len(want):
        return f"Yours holds {len(mine)} ranks; a group on {axis} holds {axis} = {len(want)}."
    return "Yours holds the right number of ranks, not the right ones."


def _stride(group: list[int]) -> int | None:
    """The step between the ranks of `group`, when there are at least two and they are evenly spaced upwards."""
    steps = {b - a for a, b in itertools.pairwise(group)}
    return steps.pop() if len(steps) == 1 and min(steps) > 0 else None


def _size(name: str, shape: tuple[int, int, int]) -> int:
    """The product of the sizes `name` spells ("pp * tp", "world_size", "1") on `shape`."""
    return math.prod(dict(zip(AXES, shape, strict=True))[axis] for axis in _SIZES[name])
