"""Which of a test's processes are still running: the check behind every "no process is left behind" test."""
import time

import psutil


def alive(pids) -> list[int]:
    """The pids in `pids` still running: not exited and not a zombie (one that exits while we look is gone)."""
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    return [pid for pid in pids if running(pid)]


def alive_after(pids, seconds: float) -> list[int]:
    """The pids in `pids` still running after waiting up to `seconds` for all of them to go."""
    deadline = time.monotonic() + seconds
    while (still := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return still
