"""The grade every grader returns: passed or not, and a message for the student."""

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
