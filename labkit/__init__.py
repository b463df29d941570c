"""labkit: the Distributed Training Lab's toolkit.

`labkit.run(fn, world_size=4)` calls `fn` on four ranks joined in a torch.distributed process
group; `%load_ext labkit` adds the `%%ranks N` cell magic. The subpackages hold the course's
kernels (`comm`, `parallel`), arithmetic (`plan`) and figures (`viz`).
"""

from labkit.launch import (
    MAX_WORLD_SIZE,
    RankError,
    RankTimeout,
    device,
    local_rank,
    prestart,
    rank,
    run,
    shutdown,
    world_size,
)

__all__ = ["MAX_WORLD_SIZE", "RankError", "RankTimeout", "device", "load_ipython_extension", "local_rank",
           "prestart", "rank", "run", "shutdown", "world_size"]
__version__ = "0.1.0"


def load_ipython_extension(ipython) -> None:
    """`%load_ext labkit`: adds the %%ranks cell magic."""
    from labkit.launch.magic import load_ipython_extension as load

    load(ipython)
