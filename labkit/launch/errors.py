"""What went wrong on which rank, told once and in the student's own lines.

A worker turns an exception (or its current stack) into plain data: `describe_exception` and
`describe_stack` (protocol.py holds their types). The kernel fills in source lines from its own
`linecache`, where IPython keeps every cell, and raises one `RankError` that names the failing ranks,
shows the root cause (the earliest failure, as torchelastic's ChildFailedError does) and merges
identical failures ("ranks 0-3: NameError ...").

An exception with the attribute `labkit_follow_on = True` (FOLLOW_ON_ATTRIBUTE) says "I only follow
another rank's failure" (for instance "rank 0 failed to save"): the owner then names another rank's
failure as the root cause, whenever it came.
"""

from __future__ import annotations

import linecache
import os
import pickle
import re
import sys
import traceback
from dataclasses import dataclass, field

from labkit.launch.protocol import Chained, ExceptionDescription, ExceptionLink, Frame, Outcome, Stack, TextEnum

__all__ = ["ARG_PICKLE_LIMIT_BYTES", "ARG_REPR_LIMIT", "FOLLOW_ON_ATTRIBUTE", "CellSyntaxError", "Failure",
           "Interrupted", "NoReply", "RankError", "RankTimeout", "cell_name", "describe_exception", "describe_stack",
           "OWN_CODE_NOTE", "exception_args", "exception_line", "format_exception", "format_frames", "in_own_code",
           "is_user_file",
           "qualified_name", "raised_failure", "rank_list", "still_running", "where"]

FOLLOW_ON_ATTRIBUTE = "labkit_follow_on"
ARG_PICKLE_LIMIT_BYTES = 1 << 16  # an exception carrying a big tensor sends its repr instead
ARG_REPR_LIMIT = 500

_LABKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAUNCH_DIR = os.path.join(_LABKIT_DIR, "launch")


def describe_exception(exc: BaseException) -> ExceptionDescription:
    """Plain, picklable description of `exc` and the chain that caused it, without labkit's own
    launch frames (they sit above every call and say nothing about the student's code)."""
    follow_on = bool(getattr(exc, FOLLOW_ON_ATTRIBUTE, False))
    links, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        after, previous = _previous_in_chain(exc)
        links.append(ExceptionLink(type(exc).__qualname__, type(exc).__module__, _message(exc),
                                   _below_launch(traceback.extract_tb(exc.__traceback__)), after, _portable_args(exc)))
        exc = previous
    return ExceptionDescription(links[::-1], follow_on)  # oldest first, as Python prints them


def _portable_args(exc: BaseException) -> tuple[tuple[bytes | None, str], ...]:
    """Each of `exc.args` as (its pickle, or None where it does not pickle or is over ARG_PICKLE_LIMIT_BYTES; its
    repr, at most ARG_REPR_LIMIT characters): what a grader reads to recognise an exception, without its prose."""
    return tuple((_pickled(arg), _short_repr(arg)) for arg in getattr(exc, "args", ()))


def _pickled(value) -> bytes | None:
    try:
        data = pickle.dumps(_on_cpu(value), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - whatever fails to pickle travels as its repr
        return None
    return data if len(data) <= ARG_PICKLE_LIMIT_BYTES else None


def _on_cpu(value):
    """`value` with its CUDA tensors copied to the CPU, as a result is (worker.py): unpickling a CUDA tensor would
    initialise CUDA in the owner, which must stay free of it."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.cpu() if t.is_cuda else t, value)


def _short_repr(value) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the error itself
        text = f"<{type(value).__name__} whose repr failed>"
    return text if len(text) <= ARG_REPR_LIMIT else text[:ARG_REPR_LIMIT] + "..."


def exception_args(link: ExceptionLink) -> tuple:
    """The arguments `link`'s exception was raised with: each unpickled where it can be, else its repr (a str)."""
    return tuple(_unpickled(data, text) for data, text in link.args)


def _unpickled(data: bytes | None, text: str):
    if data is None:
        return text
    try:
        return pickle.loads(data)
    except Exception:  # noqa: BLE001 - e.g. its class exists on the rank only
        return text


def qualified_name(cls: type) -> str:
    """'builtins.ValueError', 'labkit._refusals.ForbiddenCall': how `Failure.exception_type` names a class.

    >>> qualified_name(ValueError)
    'builtins.ValueError'
    """
    return f"{cls.__module__}.{cls.__qualname__}"


def _previous_in_chain(exc: BaseException) -> tuple[Chained | None, BaseException | None]:
    """The exception Python prints before `exc`, and how `exc` follows it; (None, None) if none."""
    if exc.__cause__ is not None:
        return Chained.CAUSE, exc.__cause__
    if not exc.__suppress_context__ and exc.__context__ is not None:
        return Chained.CONTEXT, exc.__context__
    return None, None


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the error itself
        return f"<{type(exc).__name__} whose message could not be printed>"


def describe_stack(frame) -> Stack:
    """The call stack ending at `frame`, outermost first, without labkit's own launch frames.

    A rank that has finished the call and is writing its result to the owner would show only
    multiprocessing's `_send`; that stack says the result's size instead. One that has returned and waits for
    the GPU work it queued (worker.py's `_synchronize_device`) says so: its frames are torch's only."""
    nbytes = _result_being_sent(frame)
    if nbytes is not None:
        return Stack([], sending_result_nbytes=nbytes)
    summary = traceback.extract_stack(frame)
    synchronizing = any(f.name == "_synchronize_device" and f.filename.startswith(_LAUNCH_DIR) for f in summary)
    return Stack(_below_launch(summary), synchronizing=synchronizing)


def _result_being_sent(frame) -> int | None:
    """The size of the reply if `frame` is inside Connection.send_bytes called by the worker."""
    while frame is not None:
        caller = frame.f_back
        if (frame.f_code.co_name == "send_bytes" and caller is not None
                and caller.f_code.co_filename.startswith(_LAUNCH_DIR)):
            try:
                return memoryview(frame.f_locals["buf"]).nbytes
            except (KeyError, TypeError):
                return None
        frame = caller
    return None


def still_running(stack: Stack | None, collective: str = "", result_nbytes: int | None = None) -> tuple[str, str]:
    """(summary, detail) for a rank that had not answered when the call was abandoned; `stack` is
    where it was (None: it did not say), `collective` the collective it is in ("in all_reduce #5 of the
    default group", labkit.launch.inflight), if any; `result_nbytes`, the size of the result it said it had
    returned and was pickling to send (protocol.Returning), if it did."""
    also = f"; it is {collective}" if collective else ""
    if stack is not None and stack.sending_result_nbytes is not None:
        return f"was sending its result ({stack.sending_result_nbytes / 1e6:.1f} MB) when the timeout passed", ""
    if result_nbytes is not None:
        return (f"had returned; its result ({result_nbytes / 1e6:.1f} MB) was being pickled and sent when the "
                "timeout passed"), ""
    if stack is not None and stack.synchronizing:
        return ("had returned and was waiting for the GPU work it queued (labkit's torch.cuda.synchronize before "
                f"it replies){also}", format_frames(stack.frames))
    if stack is not None and stack.frames:
        own = OWN_CODE_NOTE if in_own_code(stack, collective) else ""
        return f"was still running {where(stack.frames)}{also}{own}", format_frames(stack.frames)
    return f"was still running and did not say where{also}", ""


OWN_CODE_NOTE = " (the rank's own code: it was not waiting for a message or a collective)"


def in_own_code(stack: Stack | None, collective: str = "") -> bool:
    """True for a rank whose innermost frame is the student's own code (a time.sleep, a loop), outside any
    collective (`collective`, as for `still_running`): not waiting for another rank at all."""
    return bool(stack and stack.frames and not collective and is_user_file(stack.frames[-1].filename))


def _below_launch(summary: traceback.StackSummary) -> list[Frame]:
    """The frames under labkit's launch code: those of the call itself."""
    frames = [Frame(f.filename, f.lineno, f.name) for f in summary]
    launch = [i for i, f in enumerate(frames) if f.filename.startswith(_LAUNCH_DIR)]
    return frames[launch[-1] + 1:] if launch else frames


def cell_name(filename: str) -> str | None:
    """'Cell In[12]' for code from notebook cell 12 (as IPython names it), else None."""
    ranks_cell = re.fullmatch(r"<ranks-cell-(\d+)(\.\d+)?>", filename)
    if ranks_cell:
        return f"Cell In[{ranks_cell.group(1)}]"
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    count = getattr(getattr(shell, "compile", None), "_filename_map", {}).get(filename)
    return f"Cell In[{count}]" if count is not None else None


def _place(filename: str, lineno: int) -> str:
    cell = cell_name(filename)
    return f"{cell}, line {lineno}" if cell else f'File "{filename}", line {lineno}'


def format_frames(frames: list[Frame]) -> str:
    """Render frames like a Python traceback, taking source lines from this process's linecache."""
    lines = []
    for frame in frames:
        lines.append(f"  {_place(frame.filename, frame.lineno)}, in {frame.function}\n")
        source = linecache.getline(frame.filename, frame.lineno).strip()
        if source:
            lines.append(f"    {source}\n")
    return "".join(lines)


_CHAIN_TEXT = {
    Chained.CAUSE: "\nThe above exception was the direct cause of the following exception:\n\n",
    Chained.CONTEXT: "\nDuring handling of the above exception, another exception occurred:\n\n",
}


def format_exception(description: ExceptionDescription) -> str:
    """Render a `describe_exception` result the way Python would print the original."""
    parts = []
    for link in description.chain:
        if link.after:
            parts.append(_CHAIN_TEXT[link.after])
        if link.frames:
            parts.append("Traceback (most recent call last):\n" + format_frames(link.frames))
        parts.append(exception_line(link) + "\n")
    return "".join(parts)


def exception_line(link: ExceptionLink) -> str:
    """The exception's last line, as Python prints it: 'ValueError: bad', 'torch.AcceleratorError: ...'."""
    name = link.type_name if link.module in ("builtins", "__main__") else f"{link.module}.{link.type_name}"
    return f"{name}: {link.message}" if link.message else name


def is_user_file(filename: str) -> bool:
    """True for code the student wrote: notebook cells, %%ranks cells, their own scripts."""
    if cell_name(filename) or filename.startswith("<ipython"):
        return True
    if filename.startswith("<") or filename.startswith(_LABKIT_DIR):
        return False
    library_roots = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    return "site-packages" not in filename and not any(filename.startswith(r) for r in library_roots)


def where(frames: list[Frame]) -> str:
    """One line saying where a stack is: 'in all_reduce, called from <cell> line 4: <source>'."""
    if not frames:
        return "idle"
    innermost = frames[-1]
    user = next((f for f in reversed(frames) if is_user_file(f.filename)), None)
    text = f"in {innermost.function}"
    if user is not None and user is not innermost:
        source = linecache.getline(user.filename, user.lineno).strip()
        text += f", called from {_place(user.filename, user.lineno)}" + (f": {source}" if source else "")
    elif user is not None:
        source = linecache.getline(user.filename, user.lineno).strip()
        text += f" at {_place(user.filename, user.lineno)}" + (f": {source}" if source else "")
    return text


def rank_list(ranks) -> str:
    """'rank 2', 'ranks 0-3', 'ranks 0, 2, 5': compact names for a set of ranks."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans = []
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    return "ranks " + ", ".join(spans)


class NoReply(TextEnum):
    """How a rank failed without replying to the call (a rank that replied says how in its `Outcome`)."""

    DIED = "died"  # its process ended: an exit or a signal
    STOPPED = "stopped"  # still running (or still starting) when the call was given up


@dataclass
class Failure:
    """One rank's bad outcome. `kind`: what its reply said (Outcome.ERROR: it raised; INTERRUPTED;
    UNPICKLABLE: its result), or why there was none (NoReply.DIED, NoReply.STOPPED).

    Where the rank raised (ERROR, INTERRUPTED, a failed start): `exception_type`, the exception's class as
    `qualified_name` writes it, and `exception_args`, the arguments it was raised with (each as far as it
    pickles, else its repr), so that a grader recognises an exception by its type and data, not its text;
    "" and () otherwise. `raised(cls)` asks for one class. `in_own_code`: a rank stopped (NoReply.STOPPED) while in
    the student's own code, outside any collective (`in_own_code` says how it is told)."""

    rank: int
    kind: Outcome | NoReply
    summary: str
    detail: str = ""
    time: float = float("inf")
    stderr_tail: list[str] = field(default_factory=list)
    exception_type: str = ""
    exception_args: tuple = ()
    in_own_code: bool = False

    def raised(self, cls: type) -> bool:
        """True if this rank raised an exception of class `cls` itself (not a subclass: only its name travels)."""
        return self.exception_type == qualified_name(cls)


def raised_failure(rank: int, kind: Outcome, error: ExceptionDescription, summary: str | None = None,
                   time: float = float("inf")) -> Failure:
    """Rank `rank`'s failure that raised `error`: its last line (or `summary`), its traceback, its type and args."""
    last = error.chain[-1] if error.chain else None
    return Failure(rank, kind, summary if summary is not None else exception_line(last) if last else "",
                   format_exception(error), time=time,
                   exception_type=f"{last.module}.{last.type_name}" if last else "",
                   exception_args=exception_args(last) if last else ())


class RankError(RuntimeError):
    """A call on N ranks failed. `failures` holds one `Failure` per rank that went wrong; `notes`, lines
    shown under the headline (for a hang: which collective each group's ranks are in, labkit.launch.inflight);
    `pool_stopped`, whether labkit stopped the call's ranks (the next call starts a fresh pool, and variables
    of %%ranks cells are gone) or kept them, in step, for the next call."""

    def __init__(self, headline: str, failures: list[Failure], notes: list[str] | None = None, *,
                 pool_stopped: bool = False):
        self.failures = failures
        self.headline = headline
        self.notes = list(notes or [])
        self.pool_stopped = pool_stopped
        super().__init__(self._render())

    def _render(self) -> str:
        lines = [self.headline]
        if self.notes:
            lines.append(_COLLECTIVES_TITLE)
            lines.extend("  " + note for note in self.notes)
        # A dead rank makes its peers fail ("connection closed by peer"), so it goes first.
        ordered = sorted(self.failures, key=lambda f: (f.kind != NoReply.DIED, f.time, f.rank))
        root = ordered[0] if ordered and ordered[0].kind in (Outcome.ERROR, NoReply.DIED) else None
        groups: dict[tuple, list[int]] = {}
        for f in ordered:
            groups.setdefault((f.kind, f.summary, f.detail, tuple(f.stderr_tail)), []).append(f.rank)
        for (kind, summary, detail, tail), ranks in groups.items():
            is_root = root is not None and root.rank in ranks
            label = "root cause, " if is_root and len(groups) > 1 else ""
            lines.append(f"\n--- {label}{rank_list(ranks)}: {summary}")
            if detail and (is_root or kind != Outcome.ERROR or len(groups) == 1):
                lines.append(detail.rstrip("\n"))
            if tail:
                lines.append("last lines of stderr:")
                lines.extend("    " + t for t in tail)
        return "\n".join(lines)

    def _render_traceback_(self):
        """IPython shows this instead of the kernel-side frames, which say nothing useful."""
        return [f"{type(self).__name__}: {self.args[0]}"]


_COLLECTIVES_TITLE = ("Collectives not completed, as torch's Flight Recorder recorded them on each rank (#k: the "
                      "k-th collective of that process group since the pool started):")


class RankTimeout(RankError, TimeoutError):
    """A call on N ranks passed its timeout; each rank's stack says where it was waiting."""


def _without_launch_frames(tb):
    """`tb` without labkit's launch frames and IPython's own (those that set __tracebackhide__):
    what is left are the student's lines. IPython always shows an exception's innermost frame,
    hidden or not, so hiding needs a traceback rebuilt without them."""
    import types

    kept = []
    while tb is not None:
        frame = tb.tb_frame
        hidden = frame.f_code.co_filename.startswith(_LAUNCH_DIR) or frame.f_locals.get("__tracebackhide__")
        if not hidden and "IPython" not in frame.f_code.co_filename:
            kept.append(tb)
        tb = tb.tb_next
    rebuilt = None
    for entry in reversed(kept):
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return rebuilt


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a call, raised afresh by the owner once the ranks have been dealt with.

    IPython shows it as a KeyboardInterrupt in the student's own lines only. `in_ranks_cell`: raised for a
    %%ranks cell, whose lines ran on the ranks: the notebook's side has none of the student's lines (only
    IPython's `run_cell_magic` call), so it shows as one line under the pool's own "labkit: interrupted; ..."."""

    def __init__(self, *args, in_ranks_cell: bool = False):
        super().__init__(*args)
        self.in_ranks_cell = in_ranks_cell

    def _render_traceback_(self):
        if self.in_ranks_cell:
            return ["KeyboardInterrupt: the %%ranks cell was stopped (the line above says what became of its ranks)"]
        from IPython import get_ipython

        traceback_tool = get_ipython().InteractiveTB
        return traceback_tool.structured_traceback(KeyboardInterrupt, self, _without_launch_frames(self.__traceback__))


class CellSyntaxError(Exception):
    """A %%ranks cell that does not parse, found on the owner before any rank runs it.

    Not a SyntaxError subclass: IPython shows a SyntaxError raised while code runs with every frame
    above it (its own and labkit's); this one shows like a syntax error in an ordinary cell: the
    cell's line and a caret."""

    def __init__(self, error: SyntaxError):
        super().__init__(f"{error.msg} ({cell_name(error.filename) or error.filename}, line {error.lineno})")
        self.error = error

    def _render_traceback_(self):
        from IPython import get_ipython

        return get_ipython().SyntaxTB.structured_traceback(SyntaxError, self.error, [])
