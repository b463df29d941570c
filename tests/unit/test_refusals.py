"""labkit._refusals: a ready-made helper refuses where it runs (any thread, a subprocess, a copy of its text) while
a grader has switched it off, and runs again once the grader is done (issue 27, "ready-made helpers reached
around the tracer")."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from labkit._refusals import ForbiddenCall, refuse_while_graded, refusing

SPELLING = "labkit.parallel's average_gradients"


def helper() -> str:
    refuse_while_graded(SPELLING)
    return "done"


def test_refused_in_the_grader_thread_and_reported_even_if_caught():
    with refusing((SPELLING,)) as made:
        try:
            helper()
        except ForbiddenCall:
            pass  # a student's code that swallows the error still has it counted
    assert made == [SPELLING]
    assert helper() == "done"


def test_refused_in_another_thread():
    errors: list[BaseException] = []

    def run():
        try:
            helper()
        except ForbiddenCall as error:
            errors.append(error)

    with refusing((SPELLING,)) as made:
        thread = threading.Thread(target=run)
        thread.start()
        thread.join(timeout=30)
    assert [e.spelling for e in errors] == [SPELLING] and made == [SPELLING]
    assert str(errors[0]) == f"{SPELLING} is switched off while this exercise is graded"


def test_refused_in_a_subprocess_started_meanwhile():
    code = ("from labkit._refusals import ForbiddenCall, refuse_while_graded\n"
            f"try:\n    refuse_while_graded({SPELLING!r})\nexcept ForbiddenCall:\n    print('refused')\n"
            "else:\n    print('ran')\n")
    with refusing((SPELLING,)):
        inside = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    after = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (inside.stdout.strip(), after.stdout.strip()) == ("refused", "ran"), inside.stderr + after.stderr


def test_only_what_was_switched_off_is_refused_and_nesting_restores():
    with refusing(("other",)):
        assert helper() == "done"
        with refusing((SPELLING,)):
            with pytest.raises(ForbiddenCall):
                helper()
        assert helper() == "done"

