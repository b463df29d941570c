"""A rank's output without a newline costs the owner work in proportion to its size, and a line over a MiB is shown
cut, saying how much was cut (issue 28: 32 MB on one line took 7.6 s, 50 MB in a graded solution was judged a hang).

The work is counted, not timed: tracemalloc's peak, reset before each read, gives the bytes that read allocated;
joining the whole partial line at every read allocates the line so far each time."""

import tracemalloc

import pytest

from labkit.launch import output

READ_NBYTES = 1 << 16  # what labkit.launch._channels reads from a pipe at a time


@pytest.fixture
def shown(monkeypatch):
    """Every line the owner shows, as (stream, rank, line)."""
    lines = []
    monkeypatch.setattr(output, "show_line", lambda stream, rank, line: lines.append((stream, rank, line)))
    return lines


def allocated_per_read(rank_output, reads: list[bytes], stream: str = "stdout") -> list[int]:
    """The bytes each `feed` of `reads` to `stream` allocated: tracemalloc's peak above what was allocated before."""
    allocated = []
    tracemalloc.start()
    try:
        for data in reads:
            tracemalloc.reset_peak()
            before, _ = tracemalloc.get_traced_memory()
            rank_output.feed(stream, data)
            allocated.append(tracemalloc.get_traced_memory()[1] - before)
    finally:
        tracemalloc.stop()
    return allocated


def test_a_long_line_without_a_newline_costs_work_in_proportion_to_its_size(shown):
    reads = [b"x" * READ_NBYTES] * 128 + [b"\n"]  # 8 MiB on one line
    allocated = allocated_per_read(output.RankOutput(0, live=True), reads)
    # each read may copy its own bytes (and the newline's read the line's first MiB, joined once): not the line so far
    assert max(allocated[:-1]) < 2 * READ_NBYTES, allocated
    assert sum(allocated) < 2 * (len(reads) * READ_NBYTES + output.LINE_LIMIT_NBYTES), sum(allocated)
    assert len(shown) == 1


def test_a_line_over_a_mebibyte_is_shown_cut_saying_how_much_was_cut(shown):
    rank_output = output.RankOutput(1, live=True)
    line_nbytes = 3 * output.LINE_LIMIT_NBYTES + 5
    for start in range(0, line_nbytes, READ_NBYTES):
        rank_output.feed("stdout", b"y" * min(READ_NBYTES, line_nbytes - start))
    rank_output.feed("stdout", b"\nnext\n")
    (stream, rank, cut), following = shown
    assert (stream, rank) == ("stdout", 1) and following == ("stdout", 1, "next")
    assert cut.startswith("y" * output.LINE_LIMIT_NBYTES + " [... 2,097,157 more bytes of this line not shown"), \
        cut[output.LINE_LIMIT_NBYTES:]


def test_the_end_of_call_marker_after_a_cut_line_still_ends_the_call(shown):
    rank_output = output.RankOutput(0, live=True)
    marker = output.end_of_call_marker(7)
    data = b"z" * (2 * output.LINE_LIMIT_NBYTES) + marker
    for start in range(0, len(data), 1000):  # the marker itself split between reads
        rank_output.feed("stdout", data[start:start + 1000])
    assert rank_output.ended_call["stdout"] == 7
    assert shown[0][2].endswith(f"[... {output.LINE_LIMIT_NBYTES:,} more bytes of this line not shown: labkit shows "
                                f"the first {output.LINE_LIMIT_NBYTES:,} bytes of a line]")


def test_a_progress_bar_without_newlines_costs_work_per_update_and_shows_its_last_state(shown):
    rank_output = output.RankOutput(0, live=True)
    updates = [f"\r{step:>6} of 20000 |{'#' * (step // 400):<50}|".encode() for step in range(20_000)]  # as tqdm
    allocated = allocated_per_read(rank_output, updates + [b"\r\n"], "stderr")  # about 1.6 MB of updates on one line
    assert max(allocated) < 4096, max(allocated)
    assert shown == [("stderr", 0, f" 19999 of 20000 |{'#' * 49:<50}|")]
    assert list(rank_output.stderr_tail) == [shown[0][2]]
    for data in (b"one\r", b"\ntw", b"o\nthree", b" and more\r\n", b""):  # CRLF, and lines split between reads
        rank_output.feed("stdout", data)
    assert [line for _, _, line in shown[1:]] == ["one", "two", "three and more"]
