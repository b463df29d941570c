"""Run functions and notebook cells on N ranks: `run`, `%%ranks`, the who-am-I helpers, and the backend choice.

The who-am-I helpers (`rank`, `world_size`, `local_rank`, `device`) live in labkit.groups, a leaf, and are
re-exported here; the backend choice (`choose_backend` and its `BackendChoice`, `usable_gpu_count`, `cpu_count`,
`threads_per_rank`, `init_process_group`) is what notebooks and `labkit.commands` ask for. `pools_apart(whose)`
keeps a grader's calls on ranks of its own, apart from the student's (and their `%%ranks` variables).
"""

from labkit.checks import MAX_WORLD_SIZE
from labkit.groups import device, local_rank, rank, world_size
from labkit.launch.attach import attach, attach_commands, attached
from labkit.launch.backend import (
    BackendChoice,
    choose_backend,
    cpu_count,
    init_process_group,
    threads_per_rank,
    usable_gpu_count,
)
from labkit.launch.errors import RankError, RankTimeout
from labkit.launch.owner import pools_apart, prestart, run, shutdown

__all__ = ["MAX_WORLD_SIZE", "BackendChoice", "RankError", "RankTimeout", "attach", "attach_commands", "attached",
           "choose_backend", "cpu_count", "device", "init_process_group", "local_rank", "pools_apart", "prestart",
           "rank", "run", "shutdown", "threads_per_rank", "usable_gpu_count", "world_size"]
