"""One interceptor for every grader's guard: wrap or refuse a method for the guard's time, and put it back.

Every patch is registered on one `contextlib.ExitStack` as it is made, so that leaving the `with`, normally or by
any exception (one raised half-way through installing included), restores everything in reverse order: an
attribute patched twice (by a subclass on top of its base, or by a nested interceptor) gets back what it had.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

__all__: list[str] = []

_ABSENT = object()


class Interceptor:
    """A context manager that patches attributes on entry (`install`, which subclasses extend) and restores them
    on exit. `on` is True from entry until everything is put back: a refused stand-in that a module kept after
    the exit calls the original again. `refuse(spelling)` is what a refused call runs; graders override it to
    raise their ForbiddenCall."""

    def __init__(self):
        self.on = False
        self._stack = contextlib.ExitStack()

    def install(self) -> None:
        """Make the patches, with `patch`, `wrap`, `switch_off` and `on_exit`; subclasses override it (extending
        their base's, or replacing it: a grader's guard chooses its own switches)."""

    def __enter__(self):
        if self.on:
            raise RuntimeError(f"this {type(self).__name__} is already on: make a new one to nest")
        with contextlib.ExitStack() as stack:
            self._stack = stack
            stack.callback(setattr, self, "on", False)  # registered first: runs last
            self.on = True
            self.install()
            self._stack = stack.pop_all()  # installed: keep the patches until __exit__
        return self

    def __exit__(self, *exc_info) -> None:
        self._stack.close()

    def on_exit(self, callback: Callable, *args, **kwargs) -> None:
        """Run callback(*args, **kwargs) on exit (in reverse order of registration, with the patches)."""
        self._stack.callback(callback, *args, **kwargs)

    def patch(self, owner, name: str, value) -> None:
        """owner.name = value until exit; then what owner itself held (or nothing, if it held nothing)."""
        original = vars(owner).get(name, _ABSENT)
        self.on_exit(_put_back, owner, name, original)
        setattr(owner, name, value)

    def wrap(self, owner, name: str, make: Callable[[Callable], Callable]) -> None:
        """owner.name = make(the current owner.name) until exit."""
        self.patch(owner, name, make(getattr(owner, name)))

    def switch_off(self, owner, name: str, spelling: str, operator: bool = False) -> None:
        """Make owner.name call `refuse(spelling)` while this interceptor is on, and the original once it is off
        (a module imported meanwhile may have bound it). Skipped where owner has no such attribute (another
        torch release). `operator=True` for an operator of a torch.ops namespace, which makes its attributes on
        first use: it is replaced by a `RefusedOperator`, which keeps its overloads and schema."""
        if not operator and name not in vars(owner):
            return
        original = getattr(owner, name)
        if operator:
            self.patch(owner, name, RefusedOperator(original, self, spelling))
            return

        def refused(*args, **kwargs):
            if self.on:
                self.refuse(spelling)
            return original(*args, **kwargs)

        self.patch(owner, name, refused)

    def refuse(self, spelling: str):
        """A refused call was made: raise. Graders override this with their own exception."""
        raise RuntimeError(f"{spelling} is switched off")


def _put_back(owner, name: str, original) -> None:
    if original is _ABSENT:
        delattr(owner, name)
    else:
        setattr(owner, name, original)


class RefusedOperator:
    """A c10d operator of torch.ops (or one of its overloads, `.default`) while an interceptor is on: calling it
    refuses; everything else (its overloads, schema, name) is the operator's own, for torch's code that looks them
    up when graded code first imports it. Once the interceptor is off it calls the operator, should a module have
    kept it."""

    def __init__(self, operator, interceptor: Interceptor, spelling: str):
        self._operator, self._interceptor, self._spelling = operator, interceptor, spelling

    def __call__(self, *args, **kwargs):
        if self._interceptor.on:
            self._interceptor.refuse(self._spelling)
        return self._operator(*args, **kwargs)

    def __getattr__(self, name: str):
        if "_operator" not in vars(self):  # while copy or pickle builds an empty one
            raise AttributeError(name)
        value = getattr(self._operator, name)
        if isinstance(value, torch._ops.OpOverload):
            return RefusedOperator(value, self._interceptor, self._spelling)
        return value
