"""CourseSpawner: each student's single-user server runs as that student, in bounds of their own, with the course.

JupyterHub's LocalProcessSpawner already starts a student's server as the student's Unix user (setuid in the
child, before exec: https://jupyterhub.readthedocs.io/en/stable/reference/spawners.html). This adds what a class
on one machine needs, set by the instructor in deploy/jupyterhub_config.py:
- the class's caps in the server's environment, so every kernel and rank of the student's sees them:
  LABKIT_MAX_WORLD_SIZE (ranks per call) and LABKIT_MAX_THREADS_PER_RANK (labkit.launch reads both, and says
  which cap a request went past); LABKIT_MIN_START_SECONDS and LABKIT_GRADING_TIME_SCALE, since on a shared
  server a pool's start and a right solution wait on everyone's processes;
- the student's bounds, applied in the child as root just before it drops to the student: a cgroup of their own
  (memory, processes, CPU) where the host has cgroups, resource limits otherwise (labkit.classroom._limits);
  everything the server starts (kernels, the fork server, ranks) inherits them, so one student's runaway rank
  is killed by their own bound and no one else's;
- `python -m labkit.classroom.singleuser` as the command: a private home and the course copied in, as the student.
The caps in the environment are the friendly layer (a clear message before anything starts); the bounds are what
the kernel enforces whatever a student's code does to its own environment.
"""

from __future__ import annotations

import random
import socket
import sys

from jupyterhub.spawner import LocalProcessSpawner
from traitlets import Float, Integer, Unicode, default

from labkit.classroom import _limits
from labkit.classroom.singleuser import COURSE_ENV, FOLDER_ENV

__all__ = ["CourseSpawner"]

GiB = 1024**3


class CourseSpawner(LocalProcessSpawner):
    """LocalProcessSpawner with the class's caps, each student's bounds, and the course copied in."""

    max_world_size = Integer(4, config=True, help="Ranks per labkit.run or %%ranks call (LABKIT_MAX_WORLD_SIZE).")
    threads_per_rank = Integer(1, config=True, help="torch threads per rank (LABKIT_MAX_THREADS_PER_RANK).")
    memory_nbytes = Integer(4 * GiB, config=True, help="Memory of all of a student's processes together.")
    max_processes = Integer(512, config=True, help="Processes and threads of one student together.")
    cpu_cores = Float(2.0, config=True, help="CPU time of one student, in cores (0: no CPU bound).")
    course_notebooks = Unicode(config=True, help="The course's notebooks/ folder, copied into each student's.")
    notebook_folder = Unicode("my-notebooks", config=True, help="The student's copy, relative to their home.")
    min_start_seconds = Float(60.0, config=True, help="How long a pool's start may take (LABKIT_MIN_START_SECONDS): "
                              "on a shared server it waits on every student's processes.")
    grading_time_scale = Float(4.0, config=True, help="The graders' time limits, times this "
                               "(LABKIT_GRADING_TIME_SCALE): on a shared server a right solution takes longer.")
    python = Unicode(sys.executable, config=True,
                     help="The students' interpreter: labkit.classroom.interpreter.class_python's answer.")

    @default("cmd")
    def _default_cmd(self):
        return [self.python, "-m", "labkit.classroom.singleuser"]

    def get_env(self):
        env = super().get_env()
        env.update({
            "LABKIT_MAX_WORLD_SIZE": str(self.max_world_size),
            "LABKIT_MAX_THREADS_PER_RANK": str(self.threads_per_rank),
            "LABKIT_MIN_START_SECONDS": str(self.min_start_seconds),
            "LABKIT_GRADING_TIME_SCALE": str(self.grading_time_scale),
            COURSE_ENV: self.course_notebooks,
            FOLDER_ENV: self.notebook_folder,
        })
        return env

    def make_preexec_fn(self, name):
        drop_to_student = super().make_preexec_fn(name)
        # The work that may fail (directories, limits) here, in the hub, where it can be logged; the child only
        # writes its pid into the cgroup (or sets its limits), between fork and exec, then drops to the student.
        confinement = _limits.prepare_confinement(name, self.memory_nbytes, self.max_processes,
                                                  self.cpu_cores or None)
        self.log.info("%s's bounds: %s", name, confinement)

        def preexec():
            confinement.enter()
            drop_to_student()
        return preexec

    async def start(self):
        if self.port == 0:
            self.port = _server_port(self.user.name)
        return await super().start()

    async def stop(self, now=False):
        await super().stop(now=now)
        _PORTS_IN_USE.pop(self.user.name, None)
        try:
            _limits.release(self.user.name)
        except OSError as error:  # a process that would not leave: the cgroup stays, the hub goes on
            self.log.warning("%s's cgroup was not removed: %s", self.user.name, error)


# JupyterHub's own choice of a server's port (random_port: bind port 0, close, hand the number on) lies in the
# kernel's ephemeral range, where every kernel's ZMQ sockets are bound too: with 8 students at once a kernel took a
# server's port before the server bound it (tests/hub), and the hub waited on a ZMQ socket for 3 minutes. A port
# below the ephemeral range (ip_local_port_range, 32768-60999 by default) is never handed out by bind(0).
SERVER_PORTS = range(20000, 32000)
_PORTS_IN_USE: dict[str, int] = {}  # student: their server's port, for this hub's spawners starting at once


def _server_port(name: str) -> int:
    """A free port for `name`'s server, below the ephemeral range and not given to another student's server."""
    for port in random.sample(SERVER_PORTS, 200):
        if port in _PORTS_IN_USE.values():
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_IN_USE[name] = port
        return port
    raise RuntimeError(f"no free port in {SERVER_PORTS.start}-{SERVER_PORTS.stop - 1} for {name}'s server")
