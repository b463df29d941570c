"""Error reports: rank lists, merged failures, root cause first, Python-like tracebacks."""

import pickle

from labkit.launch.errors import (
    FOLLOW_ON_ATTRIBUTE,
    CellSyntaxError,
    Failure,
    NoReply,
    RankError,
    describe_exception,
    format_exception,
    rank_list,
    still_running,
)
from labkit.launch.protocol import Chained, ExceptionDescription, Frame, Outcome, Stack


def test_rank_list():
    assert rank_list([2]) == "rank 2"
    assert rank_list([3, 0, 1, 2]) == "ranks 0-3"
    assert rank_list([0, 2, 5, 6]) == "ranks 0, 2, 5-6"


def test_identical_failures_merge_and_differing_ones_do_not():
    same = [Failure(r, Outcome.ERROR, "NameError: x", "tb") for r in range(4)]
    assert "--- ranks 0-3: NameError: x" in str(RankError("boom", same))
    mixed = same[:2] + [Failure(2, Outcome.ERROR, "ValueError: y", "tb2")]
    text = str(RankError("boom", mixed))
    assert "ranks 0-1: NameError: x" in text and "rank 2: ValueError: y" in text


def test_failure_kinds_are_the_reply_outcomes_and_two_of_their_own_each_its_text():
    # a rank that replied fails with its reply's Outcome; one that did not, with a NoReply: no kind in two enums
    assert {str(kind) for kind in NoReply} == {"died", "stopped"}
    assert not set(NoReply) & {Outcome.ERROR, Outcome.INTERRUPTED, Outcome.UNPICKLABLE}
    died = Failure(1, NoReply.DIED, "process killed by SIGKILL")
    assert died.kind == "died" and f"{died.kind}" == "died" and pickle.loads(pickle.dumps(died.kind)) is NoReply.DIED


def test_a_dead_rank_is_the_root_cause_even_if_reported_later():
    failures = [Failure(0, Outcome.ERROR, "RuntimeError: Connection closed by peer", "tb", time=1.0),
                Failure(1, NoReply.DIED, "process killed by SIGKILL", time=2.0)]
    text = str(RankError("boom", failures))
    assert text.index("root cause, rank 1") < text.index("rank 0: RuntimeError")


def test_exception_chain_reads_like_python():
    try:
        try:
            raise KeyError("inner")
        except KeyError as inner:
            raise ValueError("outer") from inner
    except ValueError as exc:
        text = format_exception(describe_exception(exc))
    assert text.index("KeyError: 'inner'") < text.index("direct cause") < text.index("ValueError: outer")
    assert 'raise ValueError("outer") from inner' in text


def test_an_exception_travels_as_named_plain_data():
    try:
        try:
            raise KeyError("inner")
        except KeyError:
            error = RuntimeError("rank 0 failed to save")
            setattr(error, FOLLOW_ON_ATTRIBUTE, True)
            raise error  # noqa: B904 - its context is the point
    except RuntimeError as exc:
        description = describe_exception(exc)
    back = pickle.loads(pickle.dumps(description))
    assert isinstance(back, ExceptionDescription) and back == description and back.follow_on
    inner, outer = back.chain
    assert (inner.type_name, inner.module, inner.after) == ("KeyError", "builtins", None)
    assert (outer.type_name, outer.message, outer.after) == ("RuntimeError", "rank 0 failed to save", Chained.CONTEXT)
    assert outer.frames[-1].function == "test_an_exception_travels_as_named_plain_data"
    assert "During handling of the above exception" in format_exception(back)


def test_ipython_shows_only_the_report():
    error = RankError("rank 1 of 2 failed.", [Failure(1, Outcome.ERROR, "ValueError: v", "Traceback ...")])
    assert error._render_traceback_() == [f"RankError: {error}"]


def test_a_rank_sending_its_result_is_not_said_to_run_in_send():
    assert still_running(Stack([], sending_result_nbytes=12_345_678)) == (
        "was sending its result (12.3 MB) when the timeout passed", "")
    summary, detail = still_running(Stack([Frame("/home/me/train.py", 4, "all_reduce")]))
    assert summary.startswith("was still running in all_reduce") and "train.py" in detail
    assert still_running(None) == still_running(Stack([])) == ("was still running and did not say where", "")


def test_a_cell_syntax_error_names_the_line():
    try:
        compile("x = (1 +\n", "<ranks-cell-7>", "exec")
    except SyntaxError as exc:
        error = CellSyntaxError(exc)
    assert str(error) == "'(' was never closed (Cell In[7], line 1)"
