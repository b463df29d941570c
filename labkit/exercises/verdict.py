"""The grade every grader of labkit.exercises returns: a `Verdict`.

It holds `passed` (and is truthy exactly when it passed, so `assert check_ring_allreduce(fn)` and `if verdict:`
read as they should) and `message`, written for the student: on a pass, what was checked; on a failure, what
is wrong and, where the grader can tell, what to try. A notebook cell that ends with a grader call shows it as
Markdown, "✅ Correct!" or "❌ Not yet." in bold before the message; repr() and print() give the same as one
plain line, "Correct! ..." or "Not yet. ...".
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Verdict"]


@dataclass
class Verdict:
    """The grade: `passed`, and a message for the student. Shows itself as one line in a notebook.

    >>> Verdict(False, "rank 1 still holds its own input.")
    Not yet. rank 1 still holds its own input.
    """

    passed: bool
    message: str

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return ("Correct! " if self.passed else "Not yet. ") + self.message

    def _repr_markdown_(self) -> str:
        return ("**✅ Correct!** " if self.passed else "**❌ Not yet.** ") + self.message
