"""How long does the owner take to read a long line without a newline? labkit.launch.output.RankOutput.feed.

A rank's pipe is read 64 KiB at a time (labkit.launch._channels), so a line of n bytes comes in n / 64 KiB reads.
Joining the whole partial line at every read costs n**2 / 64 KiB bytes of copying: 32 MB took 7.4 s before issue 28,
and a graded solution printing 50 MB without a newline was judged a hang. Kept in pieces and joined once at the
newline, it is linear: the target is well under 0.1 s for 32 MB. The line is shown cut to its first MiB (the note
says how much was cut); the printing is left out of the figure (show_line replaced by a no-op).

    python benchmarks/output_lines.py
"""

import time

from labkit.launch import output
from labkit.tables import text_table

READ_NBYTES = 1 << 16  # what labkit._channels reads from a rank's pipe at a time
LINE_MEGABYTES = (8, 32, 50)


def seconds_to_read(line_nbytes: int) -> float:
    """Feed one line of `line_nbytes` bytes, then its newline, to a RankOutput in READ_NBYTES reads."""
    rank_output = output.RankOutput(0, live=True)
    chunk = b"x" * READ_NBYTES
    start = time.perf_counter()
    for _ in range(line_nbytes // READ_NBYTES):
        rank_output.feed("stdout", chunk)
    rank_output.feed("stdout", b"\n")
    return time.perf_counter() - start


def main() -> None:
    output.show_line = lambda stream, rank, line: None  # time the reading, not the terminal
    rows = [[f"{megabytes} MB", f"{seconds_to_read(megabytes * 10**6):.3f} s"] for megabytes in LINE_MEGABYTES]
    print(text_table(["one line of", "read in 64 KiB pieces"], rows))


if __name__ == "__main__":
    main()
