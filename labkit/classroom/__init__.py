"""A class on one server: each student's share of it, capped and bounded.

A JupyterHub server gives each student a single-user server, and labkit's ranks run inside it. Two things keep one
student from taking the machine from the others:

- the class caps (caps.py): ranks per call and threads per rank, read from the environment the hub gives each
  student's server (LABKIT_MAX_WORLD_SIZE, LABKIT_MAX_THREADS_PER_RANK), refused with a message that names them;
- the bounds (the hub's side, `confine` and `release`): the spawner puts each student's server in a cgroup of
  their own (memory, processes, CPU), or under resource limits where the host has no cgroups, so that a runaway
  rank is killed by the kernel without touching anyone else's; cgroups.py reads that bound and the OOM kills back,
  for labkit's report of a rank the kernel killed.

The hub's side, which the launcher never imports: spawner.py (CourseSpawner: each student's server as that student,
capped and bounded), singleuser.py (what that server runs first, as the student: a private home, the course copied
in), interpreter.py (a Python every student may run), gradebook.py (`python -m labkit.classroom.gradebook`: every
student's "your turn" cells re-graded in fresh processes run as the student; its private modules _cells, _regrade,
_as_student, _hub). deploy/jupyterhub_config.py puts them together (README, "A class on one server").

This package imports nothing of the launcher: the launcher imports it.
"""

from labkit.classroom._limits import Confinement, confine, prepare_confinement, release
from labkit.classroom.caps import (
    MAX_THREADS_PER_RANK_VARIABLE,
    MAX_WORLD_SIZE_VARIABLE,
    capped_threads,
    capped_world_size,
    max_threads_per_rank,
    max_world_size,
)
from labkit.classroom.cgroups import memory_bound_nbytes, oom_kill_count

__all__ = ["MAX_THREADS_PER_RANK_VARIABLE", "MAX_WORLD_SIZE_VARIABLE", "Confinement", "capped_threads",
           "capped_world_size", "confine", "max_threads_per_rank", "max_world_size", "memory_bound_nbytes",
           "oom_kill_count", "prepare_confinement", "release"]
