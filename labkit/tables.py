"""Plain text for what labkit prints in a terminal or a notebook's text output: tables, and progress bars.

    text_table(header, rows)     columns aligned with spaces
    progress_bar(iterable, ...)  tqdm's text bar, on stdout, LINE_CHARS wide at most
    wrapped(text, indent)        a sentence in lines of LINE_CHARS at most, broken between words
    print_line(text)             print on stdout, on a line of its own even while a progress bar is drawn there

text_table has one copy, used by the worked example's table (labkit.plan.worked_example), `make gpu-check`
(labkit.commands.gpu_check), tests/gpu/run_notebooks.py and the benchmarks in benchmarks/. No torch here:
labkit.plan imports it and stays torch-free.

Why a text bar in a notebook, not tqdm.auto's widget: a notebook saved with a widget bar and opened again shows
"Error displaying widget: model not found" where the bar was (its model lived in the kernel that ran it); a text
bar is saved as the text it last showed ("6/6 runs"), and reads the same when reopened. On stdout, not tqdm's
stderr, which JupyterLab draws as a red box.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["LINE_CHARS", "print_line", "progress_bar", "text_table", "wrapped"]

LINE_CHARS = 100  # a printed line this long fits a notebook at 1280 px with the file browser open
ALIGNMENTS = {"<": str.ljust, ">": str.rjust}  # as in format specs: "<" left, ">" right


def text_table(header: Sequence, rows: Iterable[Sequence], *, align: str = "", indent: str = "",
               rule: bool = True) -> str:
    """`header` and `rows` as lines of columns two spaces apart, each column as wide as its widest cell.

    Cells are shown with str(). `align` has one character per column, "<" (left, the default for columns it
    does not reach) or ">" (right: numbers line up on their last digit). `rule` puts a line of dashes under the
    header. Every line starts with `indent` and ends without trailing spaces.

    >>> print(text_table(("rank", "ms"), [(0, "1.50"), (12, "10.25")], align="<>"))
    rank     ms
    ----  -----
    0      1.50
    12    10.25
    """
    header = [str(cell) for cell in header]
    body = [[str(cell) for cell in row] for row in rows]
    _check_shape(header, body, align)
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    lines = [header, ["-" * width for width in widths]] if rule else [header]
    pads = [ALIGNMENTS[a] for a in align.ljust(len(header), "<")]
    return "\n".join(indent + "  ".join(pad(cell, width) for pad, cell, width in zip(pads, row, widths, strict=True))
                     .rstrip() for row in [*lines, *body])


def _check_shape(header: list[str], body: list[list[str]], align: str) -> None:
    """ValueError naming the row or the `align` that does not fit the header's columns."""
    for number, row in enumerate(body):
        if len(row) != len(header):
            raise ValueError(f"text_table: row {number} has {len(row)} cells ({row!r}) but the header has "
                             f"{len(header)} ({header!r}); give every row one cell per column.")
    if len(align) > len(header) or set(align) - set(ALIGNMENTS):
        raise ValueError(f"text_table: align={align!r} does not fit {len(header)} columns; pass at most one "
                         "character per column, each '<' (left) or '>' (right).")


def progress_bar(iterable: Iterable | None = None, **options):
    """tqdm's text progress bar over `iterable` (or, without one, updated by hand: `bar.update()`), written to
    stdout and LINE_CHARS wide at most; `options` are tqdm's (desc, total, unit, ...).

    >>> import io
    >>> out = io.StringIO()
    >>> for _ in progress_bar(range(3), desc="sizes", file=out, mininterval=0): pass
    >>> out.getvalue().rsplit("\\r", 1)[-1].startswith("sizes: 100%")
    True
    """
    import sys

    from tqdm.std import tqdm  # the text bar (tqdm.auto would pick the widget in a notebook)

    return tqdm(iterable, **{"file": sys.stdout, "ncols": LINE_CHARS, "ascii": False, **options})


def wrapped(text: str, indent: str = "  ") -> str:
    """`text` broken between words into lines of at most LINE_CHARS characters, the lines after the first indented
    by `indent`; its own line breaks are kept. JupyterLab breaks a long printed line at any character, mid-word
    (its text output is word-break: break-all), so a sentence a notebook prints goes through this first.

    >>> print(wrapped("the AllReduce takes 1.67 s " * 5))
    the AllReduce takes 1.67 s the AllReduce takes 1.67 s the AllReduce takes 1.67 s the AllReduce takes
      1.67 s the AllReduce takes 1.67 s
    """
    import textwrap

    return "\n".join(textwrap.fill(line, LINE_CHARS, subsequent_indent=indent, break_long_words=False,
                                    break_on_hyphens=False) or line for line in text.split("\n"))


def print_line(text: str) -> None:
    """Print `text` on stdout on a line of its own, also while a progress_bar is drawn there (labkit.run's "labkit:
    4 ranks, gloo on CPU ..." while a sweep's bar counts its runs). A bar redraws its line after a carriage return
    and ends it only when done, so a plain print lands on the bar's line, after it; tqdm.write clears the bar,
    prints, and draws the bar again below.

    >>> print_line("labkit: 2 ranks")
    labkit: 2 ranks
    """
    import sys

    from tqdm.std import tqdm

    tqdm.write(text, file=sys.stdout)

