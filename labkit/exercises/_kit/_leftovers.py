"""On a rank: what graded code left behind, so that the runner can discard ranks a solution changed.

Graders keep their pools between gradings (starting ranks costs seconds, a graded call milliseconds), so a
solution's leftovers would meet later, unrelated calls: `labkit.rank = lambda: 0` made every later
`labkit.run(labkit.rank)` return zeros, a patched `torch.Tensor.__truediv__` made `torch.ones(1) / 4` give 2.0, a
thread issuing collectives hung the next DDP step, a no-op'd guard restore left every later all_reduce refused.
`take()` notes, before the graded code runs, what such leftovers change: the callables of labkit's and torch's
modules (and builtins), the namespaces of the classes graded code patches (torch.Tensor, nn.Module, the
ProcessGroup, ...; an interceptor's patches land in these too), the live threads, torch's global modes, the
environment, the working directory and the signal handlers. `found()` says what differs now; the runner stops
a pool whose ranks found anything. It guards against accidents, not deliberate tampering: code that means to
can reach this module too.
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

__all__: list[str] = []

_ROOTS = ("labkit", "torch")  # the packages whose modules' callables are compared
_CLASSES = (torch.Tensor, torch._C.TensorBase, torch.nn.Module, torch.nn.Parameter, torch.optim.Optimizer,
            dist.ProcessGroup, dist.Work, torch.nn.parallel.DistributedDataParallel)

_before: dict[str, dict] = {}  # what `take` noted, by kind of state
_modules_before: dict[str, tuple[dict, dict, tuple]] = {}  # module name -> (its namespace, a copy, the copy's ids)


def take() -> None:
    """Note the state graded code may leave changed (module docstring), before it runs: once in a rank's life,
    before its first graded call (a later call meets the same state, or `found` said it did not and the runner
    stopped the pool), so each graded call pays for one look, `found`'s."""
    global _before, _modules_before
    if _before:
        return
    with _no_collection():
        _modules_before = _module_namespaces()
        _before = _state()


def found() -> list[str]:
    """What differs from the state `take` noted, in words ("torch.Tensor.__truediv__ changed", ...); [] if nothing
    (or if nothing was taken)."""
    if not _before:
        return []
    with _no_collection():
        now = _state()
        return _module_changes() + [f"{name} {how}" for kind in _before
                                    for name, how in _differences(_before[kind], now[kind])]


@contextlib.contextmanager
def _no_collection():
    """The garbage collector paused: the copies made here would trigger it, and a full collection of a rank with
    torch loaded costs more than the copies themselves."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _state() -> dict[str, dict]:
    return {"classes": _class_namespaces(), "threads": _threads(), "modes": _torch_modes(),
            "environment": dict(os.environ), "process": _process()}


def _module_namespaces() -> dict[str, tuple[dict, dict, tuple]]:
    """Every loaded module of labkit and torch, and builtins: (its namespace, a copy, the ids of the copy's
    values). Copies and ids are made in C: noting 1,200 modules' 20,000 callables one by one, by name, took 25 ms
    a rank on a loaded machine, twice a graded call. The copy keeps its values alive, so no id is reused."""
    modules = [(n, m) for n, m in list(sys.modules.items()) if m is not None and n.split(".")[0] in _ROOTS]
    noted = {}
    for name, module in modules + [("builtins", builtins)]:
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict):
            copy = dict(namespace)
            noted[name] = (namespace, copy, tuple(map(id, copy.values())))
    return noted


def _module_changes() -> list[str]:
    """The callables added, removed or changed in the modules `take` noted; a module whose names and values are
    all as they were is passed over without a look at them."""
    changes = []
    for name, (namespace, copy, ids) in _modules_before.items():
        now = dict(namespace)
        if tuple(now) == tuple(copy) and tuple(map(id, now.values())) == ids:
            continue
        changes += [f"{name}.{attribute} {how}" for attribute, how in _differences(_callables(copy), _callables(now))]
    return changes


def _callables(namespace: dict) -> dict[str, object]:
    return {name: value for name, value in namespace.items() if callable(value)}


def _class_namespaces() -> dict[str, object]:
    return {f"{cls.__module__}.{cls.__qualname__}.{name}": value for cls in _CLASSES
            for name, value in list(vars(cls).items()) if name != "__doc__"}


def _threads() -> dict[str, object]:
    return {f"thread {t.name!r} ({t.ident})": t for t in threading.enumerate()}


def _torch_modes() -> dict[str, object]:
    return {"torch.is_grad_enabled()": torch.is_grad_enabled(), "torch.get_default_dtype()": torch.get_default_dtype(),
            "torch.is_inference_mode_enabled()": torch.is_inference_mode_enabled(),
            "torch.are_deterministic_algorithms_enabled()": torch.are_deterministic_algorithms_enabled(),
            "torch.get_num_threads()": torch.get_num_threads()}


def _process() -> dict[str, object]:
    handlers = {f"the handler of {s.name}": signal.getsignal(s) for s in signal.valid_signals()
                if isinstance(s, signal.Signals)}
    return {"the working directory": os.getcwd(), **handlers}


_PLAIN = (str, int, float, bool, torch.dtype, signal.Handlers)  # values compared by equality; others by identity


def _differences(before: dict, now: dict) -> list[tuple[str, str]]:
    """(name, how) for each entry added, removed or changed: plain values by equality, objects by identity (an
    object's own == may be a tensor's, or patched)."""
    changed = [(name, "changed") for name in before.keys() & now.keys() if before[name] is not now[name]
               and not (type(before[name]) in _PLAIN and type(now[name]) is type(before[name])
                        and before[name] == now[name])]
    return sorted(changed + [(name, "was added") for name in now.keys() - before.keys()]
                  + [(name, "was removed") for name in before.keys() - now.keys()])
