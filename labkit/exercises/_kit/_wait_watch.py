"""Which collectives graded code waited for, through their handles or their futures: `WaitWatch`, shared by the
guards of every grader that lets the student start a collective with async_op=True (allreduce, average,
ddp_hook, bug_zoo_fix, megatron, sharded_step). It replaces methods of torch's Work and Future through the guard's
interceptor (labkit.exercises._kit._intercept), which puts them back when the guard ends.
"""

from __future__ import annotations

import threading

import torch

__all__: list[str] = []

FUTURE_POLLS = ("A loop on the future's done(), or reading its value(), is no wait either: on GPUs done() is True as "
                "soon as the all_reduce is queued, and value() does not synchronise (torch.futures docs), so only "
                "wait() makes what follows run after the sum.")


def watch_waits(works: list, interceptor) -> None:
    """Mark a recorded collective waited (its `.waited`) only when the student's code waited for it (WaitWatch).
    `works` holds (handle, call) pairs as they are launched; the methods are replaced through `interceptor` (a
    guard), which puts them back when it ends."""
    WaitWatch(works).install(interceptor)


class WaitWatch:
    """Which recorded all_reduces the student's code waited for, counting only what orders the device's stream
    after the collective, so that the verdict holds on NCCL as on gloo: the handle's wait() (on CUDA it makes
    the current stream wait for the collective), an is_completed() that answered True (on CUDA: the collective
    has run, its output usable without more synchronisation), or the wait() of a future that stands for the
    handle: handle.get_future(), a then() chained on one, torch.futures.collect_all (wait_all) of them
    (torch.futures docs: a chained or collected future completes after the futures it comes from; wait()
    "will insert the necessary instructions in the current streams").

    Not waits: a future's done() and value(). The torch.futures docs say that done() returns True for a value
    on GPUs "even if the asynchronous kernels that are populating those tensors haven't yet completed running
    on the device", and that value() "will not perform any additional synchronization". On gloo both happen
    to follow the collective's end; on NCCL a loop on done() ends once the all_reduce is queued. Designed from
    those documented semantics (no GPU here). Taking a future is no wait either (it only sets the call's
    `.future`), and neither is a wait inside a then() or add_done_callback() callback, which runs once the
    future is done whoever waits."""

    def __init__(self, works: list):
        self._works = works
        self._standing: list[tuple[object, list]] = []  # (future, the calls it stands for); keeps futures alive
        self._callbacks = threading.local()  # .depth > 0 while a callback runs on this thread

    def install(self, interceptor) -> None:
        """Replace the handle's and the future's methods (and torch._C._collect_all) for the interceptor's time."""
        import torch.distributed as dist

        future = torch._C.Future
        replacements = (
            (dist.Work, "wait", lambda wait: _after(wait, self._handle_waited)),
            (dist.Work, "is_completed", lambda ask: _after(ask, self._handle_waited, if_true=True)),
            (dist.Work, "get_future", lambda get: _after(get, self._taken)),
            (future, "wait", lambda wait: _after(wait, self._future_waited)),
            (future, "then", lambda then: _after(self._quiet_callbacks(then), self._chained)),
            (future, "add_done_callback", self._quiet_callbacks),
            (torch._C, "_collect_all", lambda collect: _after(collect, self._collected)),
        )
        for owner, name, replace in replacements:
            interceptor.wrap(owner, name, replace)

    def _counts(self) -> bool:
        return not getattr(self._callbacks, "depth", 0)

    def _handle_waited(self, work, _result=None) -> None:
        for handle, call in self._works:
            call.waited = call.waited or (handle is work and self._counts())

    def _calls(self, future) -> list:
        return [call for stands, calls in self._standing if stands is future for call in calls]

    def _future_waited(self, future, _result=None) -> None:
        for call in self._calls(future) if self._counts() else ():
            call.waited = True

    def _taken(self, work, future) -> None:
        calls = [call for handle, call in self._works if handle is work]
        for call in calls:
            call.future = True
        self._standing.append((future, calls))

    def _chained(self, future, child) -> None:
        self._standing.append((child, self._calls(future)))

    def _collected(self, futures, child) -> None:
        self._standing.append((child, [call for future in futures for call in self._calls(future)]))

    def _quiet_callbacks(self, original):
        """original(future, callback) with the callback run so that its waits are not the student's."""
        def replacement(future, callback, *args, **kwargs):
            def quiet(done):
                self._callbacks.depth = getattr(self._callbacks, "depth", 0) + 1
                try:
                    return callback(done)
                finally:
                    self._callbacks.depth -= 1
            return original(future, quiet, *args, **kwargs)
        return replacement


def _after(original, note, if_true: bool = False):
    """original(obj, ...), then note(obj, what it returned) (only when that is True, with `if_true`)."""
    def replacement(obj, *args, **kwargs):
        result = original(obj, *args, **kwargs)
        if result is True or not if_true:
            note(obj, result)
        return result
    return replacement
