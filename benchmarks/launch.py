"""How long does it take to run a tiny collective on 4 ranks? labkit's pool vs starting ranks per call.

Prints one table: the cold start of labkit's pool (fork server importing torch, then forking 4 ranks),
a pool start once the fork server is warm, the warm round trip of labkit.run (an all_reduce of 4 floats
on 4 ranks, median of 100 calls), and the same job per call under torch.multiprocessing.spawn and under
start_processes with fork. Targets (issue 2): warm median <= 15 ms, cold start <= 3 s.

    python benchmarks/launch.py
"""

import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD_SIZE = 4


def all_reduce_four_floats():
    t = torch.ones(4)
    dist.all_reduce(t)
    return t


def per_call_rank(rank, store_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE)
    all_reduce_four_floats()
    dist.destroy_process_group()


def seconds_per_call_without_a_pool(start_method: str, calls: int) -> float:
    times = []
    for _ in range(calls):
        store_path = tempfile.mktemp(prefix="labkit-bench-")
        start = time.perf_counter()
        mp.start_processes(per_call_rank, args=(store_path,), nprocs=WORLD_SIZE, start_method=start_method)
        times.append(time.perf_counter() - start)
        if os.path.exists(store_path):
            os.remove(store_path)
    return statistics.median(times)


COLD_START = """
    import time, torch, labkit
    from benchmarks.launch import all_reduce_four_floats
    start = time.perf_counter(); labkit.run(all_reduce_four_floats, world_size=4); cold = time.perf_counter() - start
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


def warm_round_trip_seconds(calls: int) -> float:
    import labkit

    labkit.run(all_reduce_four_floats, world_size=WORLD_SIZE)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        labkit.run(all_reduce_four_floats, world_size=WORLD_SIZE)
        times.append(time.perf_counter() - start)
    labkit.shutdown()
    return statistics.median(times)


def main():
    cold, restart = pool_start_seconds()
    warm = warm_round_trip_seconds(calls=100)
    fork = seconds_per_call_without_a_pool("fork", calls=10)
    spawn = seconds_per_call_without_a_pool("spawn", calls=3)
    rows = [
        ("labkit pool, cold start (4 ranks)", cold, "target <= 3 s"),
        ("labkit pool start, fork server warm (3 ranks)", restart, ""),
        ("labkit.run warm round trip, median of 100", warm, "target <= 15 ms"),
        ("start_processes(fork) per call, median of 10", fork, f"{fork / warm:,.0f} x labkit warm"),
        ("torch.multiprocessing.spawn per call, median of 3", spawn, f"{spawn / warm:,.0f} x labkit warm"),
    ]
    print(f"launch: {WORLD_SIZE} ranks, all_reduce of 4 floats, gloo, {os.cpu_count()} cores, "
          f"torch {torch.__version__}")
    print(f"{'what':52} {'time':>10}  note")
    for what, seconds, note in rows:
        shown = f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"
        print(f"{what:52} {shown:>10}  {note}")


if __name__ == "__main__":
    main()
