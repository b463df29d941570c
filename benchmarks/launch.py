"""What does a call on 4 ranks cost? labkit's warm pool vs starting the ranks for every call.

Two jobs, each timed three ways. The empty job (a function that does nothing) measures the launcher's
own round trip: the owner pickles the call, every rank runs it and replies. The all_reduce job (4 floats)
adds one small collective, which alone takes milliseconds over gloo on a busy laptop. The baselines run the
same job per call: start 4 processes (forked from this one, or spawned as fresh interpreters), join a
gloo group, run the job, meet at a barrier, leave. Then the pool's own start: cold (the fork server imports torch, then
forks 4 ranks) and with the fork server already warm (3 ranks, 5 s later: at its first idle moment the server
imports torch._dynamo, which every optimizer's constructor needs, and a start asked for during those 2-3 s waits
for it). Each per-call time is the median of single
calls timed by labkit.measure.median_seconds; the table is labkit.tables.text_table. Targets: the launcher's warm
round trip under 1 ms (issue 16), the cold start under 3 s (issue 2). A last row runs the same calls on 4 ranks that
torchrun started and that attached to this process (labkit.attach, over signed TCP on loopback): at most 2 ms warm
(issue 29).

    python benchmarks/launch.py
"""

import os
import subprocess
import sys
import tempfile
import textwrap

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 4
WARM_UP_CALLS = 10  # the pool's start, and the first calls' imports and caches


def empty_job():
    """Nothing: what is left of a call is the launcher's own work."""


def all_reduce_four_floats():
    t = torch.ones(4)
    dist.all_reduce(t)
    return t


JOBS = {"empty": empty_job, "all_reduce": all_reduce_four_floats}


def per_call_rank(rank, store_path, job_name):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE)
    JOBS[job_name]()
    dist.barrier()  # no rank leaves while a peer still connects to it (gloo: "Connection closed by peer")
    dist.destroy_process_group()


def one_call_without_a_pool(start_method: str, job_name: str) -> None:
    """Start WORLD_SIZE processes with `start_method`, join a gloo group, run the job, end."""
    store_path = tempfile.mktemp(prefix="labkit-bench-")
    try:
        mp.start_processes(per_call_rank, args=(store_path, job_name), nprocs=WORLD_SIZE, start_method=start_method)
    finally:
        if os.path.exists(store_path):
            os.remove(store_path)


def seconds_per_call_without_a_pool(start_method: str, job_name: str, calls: int) -> float:
    """Median seconds of `calls` single calls of `one_call_without_a_pool` (labkit.measure: no barrier outside
    a rank, the host clock around each call).

    labkit is imported in the functions that use it, not at the top: a spawned baseline rank imports this
    module again, and should pay for torch only, as a script of its own would."""
    from labkit.measure import median_seconds

    return median_seconds(lambda: one_call_without_a_pool(start_method, job_name), repeats=calls, warm_up=False)


COLD_START = """
    import time, torch, labkit
    from benchmarks.launch import all_reduce_four_floats
    start = time.perf_counter(); labkit.run(all_reduce_four_floats, world_size=4); cold = time.perf_counter() - start
    time.sleep(5)  # the server's first idle moments: it imports what optimizers import (forkserver.py)
    start = time.perf_counter(); labkit.run(all_reduce_four_floats, world_size=3); warm = time.perf_counter() - start
    print(cold, warm)
"""


def pool_start_seconds() -> tuple[float, float]:
    """In a fresh process: (cold start for 4 ranks, a 3-rank pool start once the fork server is warm)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(COLD_START)], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    cold, warm = map(float, out.split()[-2:])
    return cold, warm


def warm_round_trip_seconds(job, calls: int) -> float:
    """Median seconds of `calls` single labkit.run calls of `job` on a pool that is already running."""
    import labkit
    from labkit.measure import median_seconds

    for _ in range(WARM_UP_CALLS):
        labkit.run(job, world_size=WORLD_SIZE)
    return median_seconds(lambda: labkit.run(job, world_size=WORLD_SIZE), repeats=calls, warm_up=False)


def attached_round_trip_seconds(calls: dict[str, int]) -> dict[str, float]:
    """Median seconds of single labkit.run calls of each job on WORLD_SIZE ranks that torchrun started on this
    machine and that attached here (labkit.attach on 127.0.0.1)."""
    import contextlib
    import io
    import socket

    import labkit
    from labkit.measure import median_seconds

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    torchrun = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(WORLD_SIZE),
         "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0", "-m", "labkit.agent", "--connect",
         f"127.0.0.1:{port}"], cwd=root, env={**os.environ, "PYTHONPATH": root}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # the instructions and the progress bar
            labkit.attach(world_size=WORLD_SIZE, host="127.0.0.1", port=port, timeout=120)
        seconds = {}
        for name, job in JOBS.items():
            for _ in range(WARM_UP_CALLS):
                labkit.run(job, world_size=WORLD_SIZE)
            seconds[name] = median_seconds(lambda job=job: labkit.run(job, world_size=WORLD_SIZE),
                                           repeats=calls[name], warm_up=False)
        return seconds
    finally:
        labkit.shutdown()
        torchrun.wait(30)


def shown(seconds: float) -> str:
    """Seconds in the unit that reads best: '0.42 ms', '8.6 ms', '1.93 s'."""
    if seconds < 0.01:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _times(ratio: float) -> str:
    """'139', '5,046', or '1.2' below 10, where a rounded ratio would say 1 or 0."""
    return f"{ratio:,.0f}" if ratio >= 10 else f"{ratio:.1f}"


def table(calls: dict[str, int], warm: dict[str, float], fork: dict[str, float], spawn: dict[str, float],
          attached: dict[str, float]) -> str:
    """Per call on WORLD_SIZE ranks, each job a column; a baseline's cells say how many times the warm pool's."""
    from labkit.tables import text_table

    rows = [
        (f"labkit.run, warm pool (median of {calls['empty']} / {calls['all_reduce']})", warm, None),
        ("start_processes(fork) per call, median of 10", fork, warm),
        ("torch.multiprocessing.spawn per call, median of 3", spawn, warm),
        ("labkit.run, 4 ranks attached from torchrun (TCP, loopback)", attached, warm),
    ]
    cells = [[what] + [shown(seconds[name]) + (f" ({_times(seconds[name] / versus[name])} x)" if versus else "")
                       for name in JOBS] for what, seconds, versus in rows]
    return text_table(("per call", "empty function", "all_reduce of 4 floats"), cells, align="<>>")


def main():
    import labkit

    cold, restart = pool_start_seconds()
    calls = {"empty": 1000, "all_reduce": 200}
    warm = {name: warm_round_trip_seconds(JOBS[name], calls[name]) for name in JOBS}
    labkit.shutdown()
    attached = attached_round_trip_seconds(calls)
    fork = {name: seconds_per_call_without_a_pool("fork", name, calls=10) for name in JOBS}
    spawn = {name: seconds_per_call_without_a_pool("spawn", name, calls=3) for name in JOBS}
    print(f"launch: {WORLD_SIZE} ranks, gloo, {os.cpu_count()} cores, torch {torch.__version__}")
    print(table(calls, warm, fork, spawn, attached))
    print(f"labkit.run's own round trip (empty function): {shown(warm['empty'])}, target < 1 ms; "
          f"on 4 attached ranks: {shown(attached['empty'])}, target <= 2 ms")
    print(f"labkit pool, cold start (4 ranks): {shown(cold)}, target <= 3 s; "
          f"with the fork server warm (3 ranks): {shown(restart)}")


if __name__ == "__main__":
    main()
