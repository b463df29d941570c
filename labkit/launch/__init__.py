"""Run functions and notebook cells on N ranks: `run`, `%%ranks`, and who-am-I helpers."""

from labkit.checks import MAX_WORLD_SIZE
from labkit.launch.context import device, local_rank, rank, world_size
from labkit.launch.errors import RankError, RankTimeout
from labkit.launch.owner import prestart, run, shutdown

__all__ = ["MAX_WORLD_SIZE", "RankError", "RankTimeout", "device", "local_rank", "prestart", "rank", "run",
           "shutdown", "world_size"]
