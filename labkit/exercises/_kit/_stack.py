"""Is the course's own answer on the call stack? One helper for every grader: `outermost_caller(is_ready_made)`.

A guard sees a collective arrive at the process group; whether the student wrote it or a ready-made helper of the
course (labkit.parallel's average_gradients, its tensor-parallel operators, torch's DDP) made it shows on the
call stack. The outermost such frame is what the student called (average_gradients calls helpers of its own).
The stack is the current thread's: a helper run in another thread, a subprocess or from a copy of its text is
refused by the helper itself (labkit._refusals), which a grader lists in its Spec's `ready_made`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

__all__: list[str] = []


def outermost_caller(spelled: Callable[[Path, str], str | None]) -> str | None:
    """The outermost frame of the current stack that `spelled(file, qualified name)` names (its answer: how the
    student would spell that helper, e.g. "labkit.parallel's average_gradients"), or None."""
    frame, found = sys._getframe(1), None
    while frame is not None:
        found = spelled(Path(frame.f_code.co_filename), frame.f_code.co_qualname) or found
        frame = frame.f_back
    return found
