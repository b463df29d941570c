"""labkit: the Distributed Training Lab's toolkit.

`labkit.run(fn, world_size=4)` calls `fn` on four ranks joined in a torch.distributed process
group; `%load_ext labkit` adds the `%%ranks N` cell magic. The subpackages hold the course's
kernels (`comm`, `parallel`), arithmetic (`plan`) and figures (`viz`).

Who am I (`labkit.rank()`, `world_size()`, `local_rank()`, `device()`) comes from labkit.groups, a leaf. The
launcher's names (`run`, `shutdown`, `prestart`, `RankError`, `RankTimeout`, and `labkit.launch` itself) are
imported on first use (PEP 562's module `__getattr__`): importing labkit, which every `import labkit.parallel`
does first, then loads no pool, fork server or worker, so kernels run under torchrun without the launcher.
"""

from typing import TYPE_CHECKING

from labkit.checks import MAX_WORLD_SIZE
from labkit.groups import device, local_rank, rank, world_size
from labkit.version import VERSION

if TYPE_CHECKING:  # for readers and type checkers; at run time `__getattr__` below imports them on first use
    from labkit.launch import RankError, RankTimeout, attach, attached, prestart, run, shutdown

__all__ = ["MAX_WORLD_SIZE", "RankError", "RankTimeout", "attach", "attached", "device", "load_ipython_extension",
           "local_rank", "prestart", "rank", "run", "shutdown", "world_size"]
__version__ = VERSION

_FROM_LAUNCH = ("RankError", "RankTimeout", "attach", "attached", "prestart", "run", "shutdown")  # from labkit.launch


def __getattr__(name: str):
    """`labkit.run`, `labkit.RankError`, ... and `labkit.launch`: imported from labkit.launch when first asked for
    (PEP 562), then kept in this module, so later lookups cost what any attribute does."""
    if name not in (*_FROM_LAUNCH, "launch"):
        raise AttributeError(f"module 'labkit' has no attribute {name!r}")
    import labkit.launch  # not `from labkit import launch`: that would ask this function for "launch" again

    value = labkit.launch if name == "launch" else getattr(labkit.launch, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """What `dir(labkit)` and tab completion show: the names already here and the launcher's, not yet imported."""
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython) -> None:
    """`%load_ext labkit`: adds the %%ranks cell magic."""
    from labkit.launch.magic import load_ipython_extension as load

    load(ipython)
