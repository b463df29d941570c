"""The graders' kit (labkit/exercises/_kit): the interceptor puts back everything it patched, however its `with`
ends (an exception half-way through installing included), nests, and refuses a call with the grader's
ForbiddenCall; a ProcessGroup call is read one way (its options, else the defaults)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from labkit._refusals import ForbiddenCall
from labkit.exercises._kit._group_call import GroupCall, Kind, wrap_group_method
from labkit.exercises._kit._guard import Guard
from labkit.exercises._kit._intercept import Interceptor


def namespace():
    """A module-like owner with two functions to patch."""
    return types.SimpleNamespace(f=lambda: "f", g=lambda: "g")


class Patches(Interceptor):
    """Patches `owner.f` twice (the second on top of the first), adds `owner.h`, then raises `fail` if set."""

    def __init__(self, owner, fail: BaseException | None = None):
        super().__init__()
        self.owner, self.fail = owner, fail

    def install(self) -> None:
        super().install()
        self.wrap(self.owner, "f", lambda f: lambda: "first " + f())
        self.wrap(self.owner, "f", lambda f: lambda: "second " + f())
        self.patch(self.owner, "h", lambda: "h")
        if self.fail is not None:
            raise self.fail


@pytest.mark.parametrize("fail", [RuntimeError("install failed"), KeyboardInterrupt()])
def test_an_exception_half_way_through_installing_restores_everything(fail):
    owner = namespace()
    f, g = owner.f, owner.g
    patches = Patches(owner, fail)
    with pytest.raises(type(fail)):
        with patches:
            pytest.fail("the body must not run when installing failed")
    assert (owner.f, owner.g, hasattr(owner, "h"), patches.on) == (f, g, False, False)


def test_leaving_normally_or_by_an_exception_restores_in_reverse_order():
    owner = namespace()
    f = owner.f
    with Patches(owner) as patches:
        assert (owner.f(), owner.h(), patches.on) == ("second first f", "h", True)
    assert (owner.f, hasattr(owner, "h"), patches.on) == (f, False, False)
    with pytest.raises(ZeroDivisionError), Patches(owner):
        raise ZeroDivisionError
    assert (owner.f, hasattr(owner, "h")) == (f, False)


def test_interceptors_nest_and_one_cannot_be_entered_twice():
    owner = namespace()
    f = owner.f
    outer = Patches(owner)
    with outer:
        with Patches(owner):
            assert owner.f() == "second first second first f"
        assert owner.f() == "second first f"
        with pytest.raises(RuntimeError, match="already on"):
            outer.__enter__()
        assert owner.f() == "second first f"
    assert owner.f is f


def test_refusing_a_call_raises_the_graders_forbidden_call_with_its_spelling():
    owner, original = namespace(), dist.all_reduce
    with Guard() as guard:
        guard.switch_off(owner, "g", "owner.g")
        kept = owner.g
        with pytest.raises(ForbiddenCall, match=r"^torch\.distributed\.all_reduce is switched off"):
            dist.all_reduce(torch.ones(1))
        with pytest.raises(ForbiddenCall, match=r"^owner\.g is switched off"):
            owner.g()
        assert "allreduce_" in str(torch.ops.c10d.allreduce_.default._schema)  # the operator's own schema
        with pytest.raises(ForbiddenCall, match="c10d"):
            torch.ops.c10d.allreduce_([torch.ones(1)])
    assert guard.forbidden == ["torch.distributed.all_reduce", "owner.g", "torch.ops.c10d.allreduce_"]
    assert dist.all_reduce is original and kept() == "g"  # a stand-in kept after the guard calls the original


def test_a_group_call_reads_its_options_one_way():
    t = torch.ones(2)
    options = dist.AllreduceOptions()
    options.reduceOp, options.asyncOp = dist.ReduceOp.MAX, False
    made = []
    cases = [(([t],), {}, ("SUM", True)), (([t], dist.ReduceOp.MIN), {}, ("MIN", True)),
             (([t],), {"opts": options}, ("MAX", False)), ((t, dist.ReduceOp.AVG), {}, ("AVG", True))]
    for args, kwargs, expected in cases:
        call = GroupCall(Kind.ALLREDUCE, "group", args, kwargs, lambda *a, **k: made.append((a, k)) or "work")
        assert (call.reduce_op, call.asynchronous, call.tensor is t) == (*expected, True)
        assert call.proceed() == "work" and made[-1] == (("group", *args), kwargs)


def test_a_wrapped_process_group_method_hands_each_call_to_the_callback_until_the_with_ends():
    original, seen = vars(dist.ProcessGroup)["allreduce"], []

    class Wrapped(Interceptor):
        def install(self) -> None:
            wrap_group_method(self, Kind.ALLREDUCE, lambda call: seen.append((call.kind, call.reduce_op)) or "work")

    with Wrapped():
        assert dist.ProcessGroup.allreduce("a group", [torch.ones(1)], dist.ReduceOp.MAX) == "work"
    assert seen == [(Kind.ALLREDUCE, "MAX")] and vars(dist.ProcessGroup)["allreduce"] is original


def test_the_outermost_ready_made_frame_is_what_the_student_called():
    from pathlib import Path

    from labkit.exercises._kit._stack import outermost_caller

    here = Path(__file__)

    def spelled(path: Path, name: str) -> str | None:
        return f"the course's {name}" if path == here and ".ready_made" in name else None

    def ready_made_inner():
        return outermost_caller(spelled)

    def ready_made_outer():
        return ready_made_inner()

    assert ready_made_outer().endswith("ready_made_outer")
    assert outermost_caller(spelled) is None
