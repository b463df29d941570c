"""The %%ranks cell magic in a real IPython shell: state across cells, values, errors, interrupts."""

import linecache
import os
import re
import signal
import threading
import time

import pytest
from IPython.testing import globalipapp

import labkit


@pytest.fixture(scope="module")
def ip():
    shell = globalipapp.start_ipython() or globalipapp.get_ipython()  # the one shell, whoever started it
    shell.run_cell("%load_ext labkit")
    return shell


def run(ip, source: str):
    result = ip.run_cell(source)
    return result


def test_each_rank_keeps_its_variables_across_cells(ip, capsys):
    assert run(ip, "%%ranks 2\nx = 10 * labkit.rank()").success
    assert run(ip, "%%ranks 2\ny = x + 1\nprint('y is', y)").success
    out = capsys.readouterr().out
    assert "[rank 0] y is 1" in out and "[rank 1] y is 11" in out


def test_last_expression_is_shown_per_rank(ip, capsys):
    assert run(ip, "%%ranks 3\nt = torch.tensor([float(labkit.rank())])\ndist.all_reduce(t)\nt.item()").success
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("[rank")] == [
        "[rank 0] 3.0", "[rank 1] 3.0", "[rank 2] 3.0"]


def test_error_in_one_rank_shows_the_cells_line(ip):
    result = run(ip, "%%ranks 2\nvalue = 1\nif labkit.rank() == 1:\n    raise ValueError('only me')\nvalue")
    error = result.error_in_exec
    assert isinstance(error, labkit.RankError)
    message = str(error)
    assert "rank 1 of 2 failed" in message
    assert "line 4" in message and "raise ValueError('only me')" in message  # line 1 is %%ranks


def test_an_error_names_the_cell_the_notebook_shows(ip):
    for _ in range(2):  # a cell count that has moved on, as in a notebook
        ip.run_cell("x = 1", store_history=True)
    result = ip.run_cell("%%ranks 2\nraise KeyError('here')", store_history=True)
    assert isinstance(result.error_in_exec, labkit.RankError)
    assert f"Cell In[{result.execution_count}], line 2" in str(result.error_in_exec)


def test_bad_arguments_are_usage_errors(ip):
    assert not run(ip, "%%ranks\nx = 1").success
    result = run(ip, "%%ranks 0\nx = 1")
    assert isinstance(result.error_in_exec, ValueError)
    # the same checks, and words, as labkit.run's (labkit.checks)
    assert "world_size=0: pass a whole number >= 1" in str(result.error_in_exec)
    result = run(ip, "%%ranks 2 --timeout 0\nx = 1")
    assert "timeout=0.0: pass a finite number > 0" in str(result.error_in_exec)


def test_a_cell_runs_in_one_namespace_and_gives_back_its_last_expression():
    from labkit.launch.cells import run_cell
    assert run_cell("cell_x = 20\n", "<ranks-cell-9001>") is None
    assert run_cell("cell_y = cell_x + 1\ncell_y * 2", "<ranks-cell-9002>") == 42  # cell_x from the first cell
    assert run_cell("torch.ones(1).item(), dist.is_available(), labkit.rank.__name__", "<ranks-cell-9003>") == (
        1.0, True, "rank")  # what every rank starts with
    assert linecache.getline("<ranks-cell-9002>", 2) == "cell_y * 2"  # for tracebacks and stacks


@pytest.fixture
def fresh(ip):
    """A %%ranks magic that has seen no cell yet (the module's shell is shared)."""
    from labkit.launch.magic import RanksMagics
    ip.register_magics(RanksMagics(ip))
    return ip


def test_a_syntax_error_shows_its_line_and_caret_and_runs_no_rank(fresh, capsys):
    result = fresh.run_cell("%%ranks 2\ny = 2\nprint(\n", store_history=True)
    assert isinstance(result.error_in_exec, labkit.launch.errors.CellSyntaxError)
    shown = capsys.readouterr().out
    assert f"Cell In[{result.execution_count}], line 3" in shown
    assert "    print(\n" in shown and re.search(r"\n +\^\n", shown)
    assert "SyntaxError: '(' was never closed" in shown
    assert "magic.py" not in shown and "interactiveshell" not in shown and "[rank" not in shown


def test_each_world_size_keeps_its_own_variables_and_says_so_once(fresh, capsys):
    assert run(fresh, "%%ranks 2\nx = 5").success
    assert not run(fresh, "%%ranks 3\nprint(x)").success
    captured = capsys.readouterr()
    assert captured.out.startswith("labkit: each world size keeps its own variables: %%ranks 3 starts empty; "
                                   "%%ranks 2's x is still there.\n")  # a note (not stderr's red box), first
    assert "each world size" not in captured.err
    assert run(fresh, "%%ranks 2\nprint(x)").success
    captured = capsys.readouterr()
    assert "[rank 1] 5" in captured.out and "labkit:" not in captured.err + captured.out
    run(fresh, "%%ranks 1\nz = 1")
    assert "each world size" not in capsys.readouterr().out  # once


def test_a_rank_that_died_while_idle_is_announced_once(fresh, capsys):
    from labkit.launch.owner import OWNER
    assert run(fresh, "%%ranks 2\nkept = 1").success
    pool = OWNER.kept_pool(2, "gloo")
    os.kill(pool.pids()[1], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pool.healthy() and time.monotonic() < deadline:
        time.sleep(0.05)
    capsys.readouterr()
    assert not run(fresh, "%%ranks 2\nkept").success
    assert ("labkit: the 2-rank pool was restarted (rank 1 died while idle (killed by SIGKILL)): "
            "variables from earlier %%ranks 2 cells are gone.") in capsys.readouterr().err
    run(fresh, "%%ranks 2\nkept = 2")
    assert "restarted" not in capsys.readouterr().err


def test_a_pool_stopped_to_make_room_is_announced(fresh, capsys, monkeypatch):
    from labkit.launch import owner
    monkeypatch.setattr(owner, "MAX_LIVE_RANKS", 4)
    labkit.shutdown()  # no pool kept from earlier tests
    assert run(fresh, "%%ranks 2\nv = 1").success
    labkit.run(labkit.rank, world_size=3)  # 2 + 3 > 4: the 2-rank pool makes room
    capsys.readouterr()
    run(fresh, "%%ranks 2\nv = 2")
    assert ("labkit: the 2-rank pool was restarted (it was stopped to make room for 3 ranks: labkit keeps "
            "at most 4 ranks running): variables from earlier %%ranks 2 cells are gone.") in capsys.readouterr().err


def test_graders_pools_and_the_students_make_room_each_in_their_own_budget(fresh, capsys, monkeypatch):
    """A grader's pools never stop the student's (their %%ranks variables), nor the student's a grader's: with one
    budget for both, each case of a grading beside the student's pools stopped the previous case's pool."""
    from labkit.launch import owner, pools_apart
    monkeypatch.setattr(owner, "MAX_LIVE_RANKS", 5)
    monkeypatch.setattr(owner, "MAX_APART_RANKS", 5)
    labkit.shutdown()
    assert run(fresh, "%%ranks 2\nv = 1").success
    labkit.run(labkit.rank, world_size=3)  # the student's 5 ranks: full
    started = owner.OWNER.pools_started
    with pools_apart("graders"):
        for _ in range(2):  # twice: the second time both pools are still warm
            labkit.run(labkit.rank, world_size=2)
            labkit.run(labkit.rank, world_size=3)
    assert owner.OWNER.pools_started == started + 2
    capsys.readouterr()
    assert run(fresh, "%%ranks 2\nassert v == 1").success  # the student's 2 ranks kept their variable
    assert "restarted" not in capsys.readouterr().err
    with pools_apart("graders"):
        labkit.run(labkit.rank, world_size=4)  # 2 + 3 + 4 > 5: the graders' two pools make room, not the student's
        assert owner.OWNER.pools_started == started + 3
    labkit.run(labkit.rank, world_size=3)
    assert run(fresh, "%%ranks 2\nassert v == 1").success
    assert owner.OWNER.pools_started == started + 3
    assert "restarted" not in capsys.readouterr().err


@pytest.fixture
def ctrl_c_after():
    """Ctrl-C to this process after some seconds, with Python's own SIGINT handler (as ipykernel's)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timers = []

    def arm(seconds):
        timers.append(threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT)))
        timers[-1].start()
    yield arm
    for timer in timers:
        timer.cancel()
    signal.signal(signal.SIGINT, previous)


def test_an_interrupted_ranks_cell_ends_with_one_line(fresh, capsys, ctrl_c_after):
    """A %%ranks cell's lines ran on the ranks: after the pool's message, one line, no traceback through
    IPython's run_cell_magic (the only frame the notebook's side has)."""
    fresh.run_cell("%%ranks 2\n1")  # started, so that the interrupt reaches the call
    capsys.readouterr()
    ctrl_c_after(1.5)
    result = fresh.run_cell("%%ranks 2\nimport time\ntime.sleep(20)", store_history=True)
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    captured = capsys.readouterr()
    assert "labkit: interrupted; every rank stopped cleanly and the pool is kept." in captured.err
    assert captured.out.strip().splitlines() == [
        "KeyboardInterrupt: the %%ranks cell was stopped (the line above says what became of its ranks)"]


def test_an_interrupted_run_shows_the_message_and_the_students_lines_only(fresh, capsys, ctrl_c_after):
    fresh.run_cell("%%ranks 2\n1")  # started, so that the interrupt reaches the call
    capsys.readouterr()
    ctrl_c_after(1.5)
    cell = "import labkit, time\ndef f():\n    time.sleep(20)\nlabkit.run(f, world_size=2)"
    result = fresh.run_cell(cell, store_history=True)
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    captured = capsys.readouterr()
    assert "labkit: interrupted; every rank stopped cleanly and the pool is kept." in captured.err
    assert "labkit.run(f, world_size=2)" in captured.out and captured.out.rstrip().endswith("KeyboardInterrupt:")
    for internal in ("selectors", "pool.py", "owner.py", "magic.py", "hidden", "run_cell_magic"):
        assert internal not in captured.out, captured.out
    assert len(captured.out.strip().splitlines()) <= 8, captured.out


def test_a_ranks_cell_holds_the_turn_for_the_whole_cell(ip, tmp_path):
    """Another thread's labkit.run waits for the cell (issue 28: two callers at once took each other's replies),
    bounded by its own timeout, and says that a %%ranks cell holds the turn."""
    started, release = tmp_path / "started", tmp_path / "release"
    cell = (f"%%ranks 2\nimport os, time, pathlib\nif labkit.rank() == 0: pathlib.Path({str(started)!r}).touch()\n"
            f"while not os.path.exists({str(release)!r}): time.sleep(0.01)")
    results = []
    cell_thread = threading.Thread(target=lambda: results.append(ip.run_cell(cell)), daemon=True)
    cell_thread.start()
    try:
        while not started.exists():
            time.sleep(0.01)
        with pytest.raises(TimeoutError, match=r"%%ranks 2 cell"):
            labkit.run(os.getpid, world_size=2, timeout=1)
    finally:
        release.touch()
        cell_thread.join(120)
    assert results and results[0].success, results
