"""Bad input to labkit.run gets a clear ValueError or TypeError, before any rank starts."""

import threading

import pytest

import labkit


def ok():
    return 1


@pytest.mark.parametrize("world_size, error, words", [
    (0, ValueError, r"world_size=0: pass a whole number >= 1"),
    (-2, ValueError, r"world_size=-2: pass a whole number >= 1"),
    (labkit.MAX_WORLD_SIZE + 1, ValueError, r"world_size=17: pass a whole number from 1 to 16; for more ranks, run a "
                                            r"script under torchrun"),
    # labkit.checks' rule: TypeError for no number at all, ValueError for a number that cannot be a count
    (2.5, ValueError, r"world_size=2.5: pass a whole number >= 1 \(an int, not a bool\)"),
    ("4", TypeError, r"world_size='4': pass a whole number >= 1 \(an int, not a bool\), not a str"),
    (True, ValueError, r"world_size=True: pass a whole number >= 1 \(an int, not a bool\)"),
])
def test_bad_world_size(world_size, error, words):
    with pytest.raises(error, match=words):
        labkit.run(ok, world_size=world_size)


@pytest.mark.parametrize("timeout, error", [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                            (float("inf"), ValueError), (True, ValueError), ("5", TypeError)])
def test_bad_timeout(timeout, error):
    with pytest.raises(error, match=r"^timeout=.*: pass a (finite )?number"):
        labkit.run(ok, timeout=timeout)


@pytest.mark.parametrize("timeout", [1e13, 1e300, 10**400, 7 * 24 * 3600 + 1])
def test_a_timeout_beyond_a_week_is_refused_plainly(timeout):
    # 1e13 s overflowed gloo's millisecond timeouts and crashed the ranks; 10**400 raised OverflowError
    with pytest.raises(ValueError, match=r"^timeout=.*: pass a number of seconds > 0 and at most a week \(604800 s\)"):
        labkit.run(ok, timeout=timeout)


def test_a_week_is_accepted():
    assert labkit.run(ok, world_size=1, timeout=7 * 24 * 3600) == [1]


def test_the_first_call_names_each_ranks_device(capsys):
    from labkit.launch.backend import choose_backend
    from labkit.launch.owner import Owner
    owner = Owner()
    owner.announce(2, choose_backend("auto", 2, 1))  # one GPU, two ranks
    owner.announce(2, choose_backend("auto", 2, 2))
    owner.announce(8, choose_backend("nccl", 8, 8))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("labkit: 2 ranks, gloo on CPU: 2 ranks but only 1 CUDA GPU, and NCCL needs one GPU "
                        "per rank; every rank computes on cpu.")
    assert lines[1].endswith("; rank 0 on cuda:0, rank 1 on cuda:1.")
    assert lines[2].endswith("; rank i on cuda:i (i = 0..7).")


def test_not_callable():
    with pytest.raises(TypeError, match="needs a function to call, got int"):
        labkit.run(42)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend='mpi' is not one of"):
        labkit.run(ok, backend="mpi")


def test_nccl_without_gpus_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(labkit.launch.owner.OWNER, "gpu_count", lambda: 0)
    with pytest.raises(ValueError, match="needs one CUDA GPU per rank: 2 ranks, 0 CUDA GPUs found"):
        labkit.run(ok, world_size=2, backend="nccl")


def test_unpicklable_argument_is_named():
    with pytest.raises(TypeError, match=r"cannot send argument 1 \(lock\) to the ranks"):
        labkit.run(lambda a, b: None, 1, threading.Lock())


def test_unpicklable_result_is_a_type_error_and_the_pool_survives():
    def make_generator():
        return (i for i in range(3))
    with pytest.raises(TypeError, match="ranks 0-1 returned a value that cannot be sent back: generator"):
        labkit.run(make_generator, world_size=2)
    assert labkit.run(ok, world_size=2) == [1, 1]


@pytest.mark.parametrize("helper", [labkit.rank, labkit.world_size, labkit.device])
def test_rank_helpers_outside_a_rank_say_where_they_work(helper):
    # the one message of labkit.groups.require_group, naming the helper
    with pytest.raises(RuntimeError, match=rf"^labkit\.{helper.__name__}\(\) needs a torch.distributed process group: "
                                           r"call it inside a rank \(in a function given to labkit.run, in a %%ranks"):
        helper()


def test_run_inside_a_rank_is_refused():
    with pytest.raises(labkit.RankError, match="cannot be called from inside a rank"):
        labkit.run(lambda: labkit.run(ok), world_size=1)
