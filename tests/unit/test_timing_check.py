"""labkit.measure.timing_check: a notebook's timing claim is a printed verdict, never an exception (issue 26)."""

from labkit.measure import timing_check


def test_a_claim_that_held_says_so_and_returns_true(capsys):
    assert timing_check(True, "8 passes take over twice one pass", "41.0 ms against 12.0 ms") is True
    assert capsys.readouterr().out == "✅ 8 passes take over twice one pass: 41.0 ms against 12.0 ms.\n"


def test_a_missed_claim_names_what_was_measured_and_that_a_rerun_is_fine(capsys):
    assert timing_check(0.26 > 0.28, "the bubble is near the formula", "26.0 % against 33.3 %") is False
    printed = capsys.readouterr().out
    assert printed.startswith("⚠️ the bubble is near the formula: not in this run (26.0 % against 33.3 %).")
    one_line = printed.replace("\n  ", " ")  # tables.wrapped breaks it into lines a notebook shows unbroken
    assert "rerunning the cell is fine" in one_line and one_line.count("\n") == 1
