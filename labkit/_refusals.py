"""Ready-made helpers that refuse to run while a grader grades the exercise they would do for the student.

A grader's guard watches graded code from the outside: the process group's methods, the call stack, a tracer.
Code can run a ready-made helper out of that sight, honestly: in a thread of its own, in a subprocess, after a
`sys.settrace(None)` of its own, or from a copy of the helper's text. So the helper checks where it runs: each
one starts with `refuse_while_graded("labkit.parallel's average_gradients")`, and raises `ForbiddenCall` while
a grader has said that spelling is off (`refusing(...)`). What the grader says is process-wide (every thread
sees it) and is put in the environment (`LABKIT_REFUSED`), which a subprocess started meanwhile inherits. A copy
of the helper's text carries its first line with it.

A leaf: it imports only the standard library, so labkit.parallel and labkit.comm can import it without loading
the graders (the layering test, tests/unit/test_layering.py).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

__all__: list[str] = []

_ENVIRONMENT = "LABKIT_REFUSED"  # the refused spellings, one per line, for subprocesses
_lock = threading.Lock()
_refused: list[str] = []  # what the graders in this process switched off now (a stack: graders can nest)
_seen: list[str] = []  # every refusal while a grader was on, for the grader to report even if it was caught


class ForbiddenCall(RuntimeError):
    """Raised on a rank when graded code calls what the exercise asks it to build itself. Its one argument is what
    was called (`spelling`, e.g. "torch.distributed.all_reduce"), so a grader reads it from a rank's Failure
    (`failure.exception_args[0]`) without parsing prose."""

    def __init__(self, spelling: str):
        super().__init__(spelling)
        self.spelling = spelling

    def __str__(self) -> str:
        return f"{self.spelling} is switched off while this exercise is graded"


def refuse_while_graded(spelling: str) -> None:
    """The first line of a ready-made helper: raise ForbiddenCall(spelling) if a grader has switched it off, in this
    process (any thread) or in the process that started this one."""
    inherited = os.environ.get(_ENVIRONMENT, "").split("\n")
    with _lock:
        refused = spelling in _refused or spelling in inherited
        if refused:
            _seen.append(spelling)
    if refused:
        raise ForbiddenCall(spelling)


@contextlib.contextmanager
def refusing(spellings: tuple[str, ...]) -> Iterator[list[str]]:
    """While the `with` runs, the helpers named `spellings` refuse to run (refuse_while_graded); yields the list of
    refusals made meanwhile (in any thread), which the grader reports even when graded code caught the error."""
    with _lock:
        start, _refused[len(_refused):] = len(_seen), spellings
        previous = os.environ.get(_ENVIRONMENT)
        os.environ[_ENVIRONMENT] = "\n".join(_refused)
    made: list[str] = []
    try:
        yield made
    finally:
        with _lock:
            made.extend(_seen[start:])
            del _seen[start:]
            for spelling in spellings:
                _refused.remove(spelling)
            if previous is None:
                os.environ.pop(_ENVIRONMENT, None)
            else:
                os.environ[_ENVIRONMENT] = previous
