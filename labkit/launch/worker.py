"""The rank side: one process per rank, joined to the default process group, serving calls.

A worker talks to the owner (the notebook's kernel, or a script) over two sockets, in the messages
of protocol.py. On the job socket its main thread receives each `Call` (a cloudpickled
`(fn, args, kwargs)`), runs it and sends back a `Reply`. On the control socket a second thread
answers a `StackRequest` with the main thread's `Stack` and the collectives the rank has not seen
complete (torch's Flight Recorder, inflight.py), even while that thread waits inside a
collective (c10d releases the GIL while it waits), takes `Interrupt`s, and ends the process when the
owner goes away. Output goes to fds 1 and 2, pipes the owner drains; after each call a marker line on
both says "everything before me belongs to that call".

An interrupt names the call it is meant for. A bare SIGINT carries no such name: one that reached a
rank a moment too early was lost, and one that came late stopped the next call. So the owner sends
`Interrupt(call_id)` on the control socket; the control thread notes the id and signals the main
thread, whose handler raises KeyboardInterrupt only while that very call runs; a call that starts
after its interrupt came stops before the user's code. Each reply also says how many operations
each process group issued during the call, so the owner can tell whether the ranks stopped in step.

What a call does to the rank's process does not outlast it. Fds 1 and 2 (and sys.stdout/stderr)
are put back on the owner's pipes after each call, so a call that redirects them (os.dup2 onto
/dev/null) neither hides later output nor the end-of-call marker. Before replying, a rank that
uses CUDA waits for its queued work (torch.cuda.synchronize), so that a CUDA error or a hung NCCL
collective belongs to the call that caused it. And the reply says whether the call destroyed the
default process group (dist.destroy_process_group()), so the owner can replace the pool.

A `%%ranks` cell is one more call: cells.py runs it in the rank's own namespace.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import NamedTuple

from labkit.groups import device, group_is_up
from labkit.launch import protocol
from labkit.launch.errors import describe_exception, describe_stack
from labkit.launch.inflight import recorded_collectives
from labkit.launch.output import end_of_call_marker
from labkit.launch.protocol import (
    Call,
    ExceptionDescription,
    Interrupt,
    Leave,
    Outcome,
    RankSpec,
    Ready,
    Reply,
    Returning,
    StackRequest,
    StartFailed,
)

__all__ = ["GROUP_TIMEOUT_MARGIN_SECONDS", "health_probe", "main", "prepare_process", "sequence_numbers", "serve",
           "spawned_main"]

GROUP_TIMEOUT_MARGIN_SECONDS = 15.0
RESULT_NOTE_MIN_NBYTES = 1 << 20  # a result this big is announced (protocol.Returning) before it is pickled

_running_call: int | None = None  # the call whose payload and user code the main thread runs now
_interrupt_for: int | None = None  # the latest call the owner asked to stop, until the stop is raised
_interrupted_call: int | None = None  # the call whose stop was raised: a KeyboardInterrupt in any other is the user's
_output_fds: dict[int, int] = {}  # 1 and 2 -> a duplicate of the pipe the owner reads, taken at start


def main(spec: RankSpec, job_fd: int, control_fd: int) -> None:
    """Run rank `spec.rank` until the owner closes the job socket; never returns."""
    job, control = Connection(job_fd), Connection(control_fd)
    os.environ.update(spec.env)
    os.chdir(spec.cwd)
    sys.path[:] = spec.sys_path
    prepare_process(spec.threads)
    serve(job, control, lambda: _init_process_group(spec))


def _mark_end_of_call(call_id: int) -> None:
    os.write(1, end_of_call_marker(call_id))
    os.write(2, end_of_call_marker(call_id))


def serve(job, control, join_group, mark_end_of_call=_mark_end_of_call) -> None:
    """Join the group with `join_group()`, say `Ready` (or `StartFailed`) on `job`, then answer calls until the owner
    goes; never returns. `job` and `control` are Connections: socketpairs for a forked rank, signed TCP connections
    for an attached one (labkit.agent); fds 1 and 2 are already the pipes the owner's side reads.
    `mark_end_of_call(call_id)` puts the end-of-call marker after the call's output: on fds 1 and 2, or where an
    attached rank's output goes."""
    _output_fds.update({fd: os.dup(fd) for fd in (1, 2)})
    main_thread = threading.main_thread().ident
    threading.Thread(target=_serve_control, args=(control, main_thread), daemon=True).start()
    try:
        join_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the owner, which raises it
        protocol.send(job, StartFailed(describe_exception(exc)))
        os._exit(1)
    protocol.send(job, Ready())
    _serve_calls(job, mark_end_of_call)


def prepare_process(threads: int) -> None:
    """What every rank sets before it joins a group: the interrupt handler, line-buffered streams, its threads."""
    signal.signal(signal.SIGINT, _on_interrupt)  # only the owner's control message raises: see _run
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    import torch

    torch.set_num_threads(threads)


def _init_process_group(spec: RankSpec) -> None:
    import torch.distributed as dist

    from labkit.launch.backend import init_process_group

    timeout = datetime.timedelta(seconds=spec.pg_timeout_seconds)
    store = dist.FileStore(spec.store_path)  # private to this user: owner.py says why
    store.set_timeout(timeout)
    init_process_group(spec.backend, local_rank=spec.rank, store=store, rank=spec.rank,
                       world_size=spec.world_size, timeout=timeout)


def _serve_control(control: Connection, main_thread: int) -> None:
    while True:
        try:
            request = protocol.receive(control)
        except (EOFError, OSError):
            os._exit(0)  # the owner is gone: no rank may outlive it
        if isinstance(request, StackRequest):
            frame = sys._current_frames().get(main_thread)
            stack = describe_stack(frame) if frame else protocol.Stack([])
            protocol.send(control, stack._replace(collectives=recorded_collectives()))
        elif isinstance(request, Interrupt):
            _interrupt(request.call_id, main_thread)
        elif isinstance(request, Leave):  # an attached rank's pool is done (protocol.Leave says which way)
            os._exit(request.exit_code)


def _interrupt(call_id: int, main_thread: int) -> None:
    """Note which call to stop, then wake the main thread: a signal ends its sleep or select with
    EINTR and runs `_on_interrupt` there (Python runs signal handlers in the main thread only)."""
    global _interrupt_for
    _interrupt_for = call_id
    signal.pthread_kill(main_thread, signal.SIGINT)


def _on_interrupt(signum, frame) -> None:
    """SIGINT handler: raise KeyboardInterrupt in the user's code if its call is the one to stop."""
    if _running_call is not None and _take_interrupt(_running_call):
        raise KeyboardInterrupt


def _take_interrupt(call_id: int) -> bool:
    """True once if the owner asked to stop `call_id`; the request is used up by raising it."""
    global _interrupt_for, _interrupted_call
    if _interrupt_for != call_id:
        return False
    _interrupt_for, _interrupted_call = None, call_id
    return True


def _serve_calls(job: Connection, mark_end_of_call) -> None:
    """Answer each Call with a Reply, forever. The reply says whether the call destroyed the default
    process group (dist.destroy_process_group()): then no group is up any more."""
    while True:
        try:
            call: Call = protocol.receive(job)
        except (EOFError, OSError):
            os._exit(0)
        before = sequence_numbers()
        outcome, body = _run(call, job)
        steps = _steps_since(before)
        _restore_output()
        mark_end_of_call(call.call_id)
        protocol.send(job, Reply(call.call_id, outcome, body, time.time(), steps, not group_is_up()))


def _restore_output() -> None:
    """Flush what the call printed, then put sys.stdout/stderr and fds 1 and 2 back on the owner's
    pipes, wherever the call left them."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # replaced by None, or closed, by the call
            pass
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    for fd, saved in _output_fds.items():
        os.dup2(saved, fd)


def _run(call: Call, job: Connection) -> tuple[Outcome, bytes | ExceptionDescription | str]:
    """Run one call: (OK, the pickled result), (ERROR or INTERRUPTED, what was raised), or
    (UNPICKLABLE, why the result cannot be sent).

    An interrupt for this call raises KeyboardInterrupt anywhere between the two assignments to
    `_running_call`, and nowhere else: a rank idle or sending its result is never disturbed."""
    global _running_call
    from labkit.launch import serialize

    try:
        try:
            _running_call = call.call_id
            if _take_interrupt(call.call_id):  # it came before the call did
                raise KeyboardInterrupt
            _follow_call_timeout(call.timeout_seconds)
            fn, args, kwargs = serialize.loads(call.payload)
            try:
                result = fn(*args, **kwargs)
            finally:
                _synchronize_device()
        finally:
            _running_call = None
    except KeyboardInterrupt as exc:
        if _interrupted_call == call.call_id:
            return Outcome.INTERRUPTED, _forget(exc)
        return Outcome.ERROR, _forget(exc)  # raised by the user's code itself: their error, not labkit's stop
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: a rank must not exit on a whim
        return Outcome.ERROR, _forget(exc)
    _announce_result(job, call.call_id, result)
    try:
        return Outcome.OK, serialize.dumps(_to_cpu(result))
    except Exception as exc:  # noqa: BLE001
        return Outcome.UNPICKLABLE, f"{type(result).__name__} cannot be pickled ({type(exc).__name__}: {exc})"


def _announce_result(job: Connection, call_id: int, result) -> None:
    """Tell the owner that call `call_id` returned a result of RESULT_NOTE_MIN_NBYTES or more, before pickling it:
    800 MB take seconds to pickle, and a timeout meanwhile would otherwise say the rank was still running."""
    nbytes = _result_nbytes(result)
    if nbytes >= RESULT_NOTE_MIN_NBYTES:
        protocol.send(job, Returning(call_id, nbytes))


def _result_nbytes(result) -> int:
    """About how many bytes `result` pickles to: its tensors', bytes' and strings' sizes, in lists, tuples and
    dicts (torch's pytree); 0 where it cannot say."""
    import torch
    from torch.utils._pytree import tree_leaves

    def nbytes(leaf) -> int:
        if isinstance(leaf, torch.Tensor):
            return leaf.nbytes
        return len(leaf) if isinstance(leaf, (bytes, bytearray, str)) else 0
    try:
        return sum(map(nbytes, tree_leaves(result)))
    except Exception:  # noqa: BLE001 - an odd container: the note is only a help
        return 0


def _synchronize_device() -> None:
    """Wait for the CUDA work this rank queued, if it uses CUDA: kernels and NCCL collectives run
    asynchronously (PyTorch docs, "CUDA semantics: asynchronous execution"), so without this a rank
    would reply "ok" before its work ended, and an error or a hang would surface in a later call."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _forget(exc: BaseException) -> ExceptionDescription:
    """Describe `exc`, then drop its frames so a failed call does not pin tensors in memory."""
    description = describe_exception(exc)
    traceback.clear_frames(exc.__traceback__)
    gc.collect()
    return description


def _to_cpu(result):
    import torch
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.cpu() if t.is_cuda else t, result)


_group_timeout_seconds = 0.0


def _follow_call_timeout(call_timeout_seconds: float) -> None:
    """Keep the process group's own timeout a little longer than the call's, so that a hang is
    reported by labkit (with every rank's stack) rather than by gloo's or NCCL's timeout first."""
    global _group_timeout_seconds
    wanted = call_timeout_seconds + GROUP_TIMEOUT_MARGIN_SECONDS
    if wanted != _group_timeout_seconds:
        import torch.distributed as dist

        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=wanted))
        _group_timeout_seconds = wanted


def sequence_numbers() -> dict[str, int] | None:
    """How many operations each of this rank's process groups has issued, per backend: c10d counts
    them on the rank that issues them, whether or not a peer ever matched them. None where c10d
    cannot say."""
    try:
        return {key: backend._get_sequence_number_for_group() for key, backend in _group_backends()}
    except Exception:  # noqa: BLE001 - a group c10d cannot count: the owner then trusts nothing
        return None


class _GroupBackends(NamedTuple):
    """The c10d backends of this rank's process groups, as last looked up."""

    groups: tuple  # (group, name) for each group, as c10d listed them then
    backends: list  # ("group name/device type", backend) for each group and device type


_backends = _GroupBackends((), [])


def _group_backends() -> list:
    """("group name/device type", backend) for each of this rank's groups; looked up again only
    when the groups change, since c10d's `_get_backend` costs about 10 us and every call asks."""
    global _backends
    import torch
    import torch.distributed as dist

    groups = tuple(dist.distributed_c10d._world.pg_names.items())
    if groups != _backends.groups:
        _backends = _GroupBackends(groups, [(f"{name}/{device_type}", group._get_backend(torch.device(device_type)))
                                            for group, name in groups for device_type in group._device_types])
    return _backends.backends


def _steps_since(before: dict[str, int] | None) -> dict[str, int] | None:
    """Operations each group issued since `before`: equal on every member rank when they are in step."""
    after = sequence_numbers()
    if before is None or after is None:
        return None
    return {key: count - before.get(key, 0) for key, count in after.items()}


def health_probe() -> float:
    """A tiny all_reduce: it completes, and sums to the world size, only if the group is in step."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1, device=device())
    dist.all_reduce(t)
    return t.item()


def spawned_main() -> None:
    """Entry point where ranks are spawned instead of forked (platforms without a safe fork): argv names the fds
    of the pickled RankSpec (an unlinked file: argv is every user's to read), the job and the control socket."""
    with os.fdopen(int(sys.argv[1]), "rb") as spec_file:
        spec = pickle.load(spec_file)
    main(spec, int(sys.argv[2]), int(sys.argv[3]))
