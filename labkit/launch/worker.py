"""The rank side: one process per rank, joined to the default process group, serving calls.

A worker talks to the owner (the notebook's kernel, or a script) over two sockets. On the job
socket its main thread receives cloudpickled `(fn, args, kwargs)`, runs it and sends back the
result. On the control socket a second thread answers "where are you?" with the main thread's
stack, even while that thread waits inside a collective (c10d releases the GIL while it waits),
and ends the process when the owner goes away. Output goes to fds 1 and 2, pipes the owner
drains; after each call a marker line on both says "everything before me belongs to that call".
"""

from __future__ import annotations

import ast
import datetime
import gc
import linecache
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from labkit.launch.errors import describe_exception, describe_stack
from labkit.launch.output import end_of_call_marker

STACK_REQUEST = b"stack"
GROUP_TIMEOUT_MARGIN_SECONDS = 15.0

_cell_namespace: dict = {"__name__": "__main__"}


def main(spec: dict, job_fd: int, control_fd: int) -> None:
    """Run rank `spec["rank"]` until the owner closes the job socket; never returns."""
    job, control = Connection(job_fd), Connection(control_fd)
    _prepare_process(spec)
    main_thread = threading.main_thread().ident
    threading.Thread(target=_serve_control, args=(control, main_thread), daemon=True).start()
    try:
        _init_process_group(spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the owner, which raises it
        job.send_bytes(pickle.dumps(("init_error", describe_exception(exc))))
        os._exit(1)
    job.send_bytes(pickle.dumps(("ready", os.getpid())))
    _serve_calls(job)


def _prepare_process(spec: dict) -> None:
    os.environ.update(spec["env"])
    os.chdir(spec["cwd"])
    sys.path[:] = spec["sys_path"]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # see _run
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    import torch

    torch.set_num_threads(spec["threads"])


def _init_process_group(spec: dict) -> None:
    import torch.distributed as dist

    from labkit.launch.backend import init_process_group

    timeout = datetime.timedelta(seconds=spec["pg_timeout_seconds"])
    client = dist.TCPStore(spec["store_host"], spec["store_port"], is_master=False, timeout=timeout)
    store = dist.PrefixStore(spec["store_prefix"], client)
    init_process_group(spec["backend"], local_rank=spec["rank"], store=store, rank=spec["rank"],
                       world_size=spec["world_size"], timeout=timeout)


def _serve_control(control: Connection, main_thread: int) -> None:
    while True:
        try:
            request = control.recv_bytes()
        except (EOFError, OSError):
            os._exit(0)  # the owner is gone: no rank may outlive it
        if request == STACK_REQUEST:
            frame = sys._current_frames().get(main_thread)
            control.send_bytes(pickle.dumps(describe_stack(frame) if frame else []))


def _serve_calls(job: Connection) -> None:
    while True:
        try:
            call_id, timeout_seconds, payload = pickle.loads(job.recv_bytes())
        except (EOFError, OSError):
            os._exit(0)
        _follow_call_timeout(timeout_seconds)
        reply = _run(payload)
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(1, end_of_call_marker(call_id))
        os.write(2, end_of_call_marker(call_id))
        job.send_bytes(pickle.dumps((call_id, *reply, time.time())))


def _run(payload: bytes) -> tuple[str, object]:
    """Run one call: ("ok", pickled result) or ("error" | "interrupted", description)."""
    from labkit.launch import serialize

    try:
        fn, args, kwargs = serialize.loads(payload)
        # Ctrl-C in the notebook reaches a rank as SIGINT, and must stop only the user's code: outside
        # it, SIGINT is ignored, so a rank busy sending its result or idle is never disturbed.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            result = fn(*args, **kwargs)
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
    except KeyboardInterrupt as exc:
        return "interrupted", _forget(exc)
    except BaseException as exc:  # noqa: BLE001 - SystemExit too: a rank must not exit on a whim
        return "error", _forget(exc)
    try:
        return "ok", serialize.dumps(_to_cpu(result))
    except Exception as exc:  # noqa: BLE001
        return "unpicklable", f"{type(result).__name__} cannot be pickled ({type(exc).__name__}: {exc})"


def _forget(exc: BaseException) -> dict:
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


def health_probe() -> float:
    """A tiny all_reduce: it completes, and sums to the world size, only if the group is in step."""
    import torch
    import torch.distributed as dist

    from labkit.launch.context import device

    t = torch.ones(1, device=device())
    dist.all_reduce(t)
    return t.item()


def run_cell(source: str, filename: str):
    """Execute a %%ranks cell in this rank's own namespace, IPython-style: the value of a final
    expression is returned (and shown by the owner)."""
    import torch
    import torch.distributed as dist

    import labkit

    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    _cell_namespace.setdefault("torch", torch)
    _cell_namespace.setdefault("dist", dist)
    _cell_namespace.setdefault("labkit", labkit)
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), _cell_namespace)
    if last is not None:
        return eval(compile(ast.Expression(last.value), filename, "eval"), _cell_namespace)
    return None


def spawned_main() -> None:
    """Entry point where ranks are spawned instead of forked (platforms without a safe fork)."""
    main(pickle.loads(bytes.fromhex(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]))
