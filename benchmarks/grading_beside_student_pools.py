"""How long do gradings take while the student's own pools are running? labkit.launch.owner.Owner._make_room.

Graders grade on pools of their own (issue 28), beside the student's. When both shared one budget of
MAX_LIVE_RANKS (16) ranks, the ring grader's cases (2, 3 and 4 ranks: 9) beside the student's pools of more
than 7 ranks stopped a graders' pool for every case, and a grading paid cold starts: six gradings took 3.7 s
beside no student pools and 66.5 s (36 pool starts) beside pools of 2, 3 and 4 ranks, on 2 cores (fee7e0a).
Now the graders' pools have a budget of their own (MAX_APART_RANKS): the figures should not depend on the
student's pools, and no pool should start during the six gradings.

    python benchmarks/grading_beside_student_pools.py
"""

import sys
import time
from pathlib import Path

import labkit
from labkit.exercises import check_ring_allreduce
from labkit.launch.owner import OWNER
from labkit.tables import text_table

sys.path.insert(0, str(Path(__file__).parent.parent / "tests" / "distributed"))
from test_grader_catalogue import RING_RIGHT  # noqa: E402  (right solutions written differently)

GRADINGS = 6


def gradings_beside(student_world_sizes: tuple[int, ...]) -> tuple[float, int]:
    """(seconds, pools started) for GRADINGS gradings with the student's pools of these sizes running."""
    labkit.shutdown()
    for world_size in student_world_sizes:
        labkit.run(labkit.rank, world_size=world_size)
    check_ring_allreduce(RING_RIGHT[0])  # the graders' pools started once, as in a kernel that graded before
    pools_before, begun = OWNER.pools_started, time.monotonic()
    for i in range(GRADINGS):
        assert check_ring_allreduce(RING_RIGHT[i % len(RING_RIGHT)]).passed
    return time.monotonic() - begun, OWNER.pools_started - pools_before


def main() -> None:
    rows = []
    for sizes in ((), (4,), (2, 3, 4), (2, 3, 4, 8)):
        seconds, started = gradings_beside(sizes)
        rows.append([", ".join(map(str, sizes)) or "none", f"{seconds:.1f}", str(started)])
    print(text_table(["student's pools (ranks)", f"{GRADINGS} gradings (s)", "pools started"], rows))
    labkit.shutdown()


if __name__ == "__main__":
    main()
