"""The runs two notebooks share, so that each starts from a fresh kernel: labkit.parallel.zero_runs (notebooks 11
and 12: the small MLP under every ZeRO stage and torch's own, against one process on the whole batch) and
labkit.parallel.mesh_runs (notebooks 13 and 14: the GPT on a dp x pp x tp mesh, each rank's MeshRun)."""

import pytest

import labkit
from labkit.parallel import AXES, mesh_runs, zero_runs
from labkit.plan.counts import shard_sizes

WORLD = 2


@pytest.mark.parametrize("strategy", [*zero_runs.STRATEGIES, *zero_runs.TORCH_STRATEGIES])
def test_every_strategy_reaches_one_process_and_holds_its_share_of_adams_state(strategy, capsys):
    parameters = zero_runs.train_alone().numel()
    result = zero_runs.compare(strategy, WORLD)
    assert result.strategy == strategy and result.gap < 1e-5
    if strategy == "DDP":
        assert result.states == [2 * parameters] * WORLD                          # every rank all of it
    else:
        assert sum(result.states) == 2 * parameters                                # sharded: split, not copied
    if strategy in ("ZeRO-1", "ZeRO-2"):
        assert result.states == [2 * size for size in shard_sizes(parameters, WORLD)]
    printed = capsys.readouterr().out
    assert f"{strategy:>6}: largest difference from one process" in printed
    assert all(len(line) <= 100 for line in printed.splitlines())              # labkit.tables.LINE_CHARS


def test_an_unknown_strategy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="DDP, ZeRO-1, ZeRO-2 or ZeRO-3"):
        zero_runs.model_and_optimizer("ZeRO-4")
    with pytest.raises(ValueError, match="torch fully_shard"):
        zero_runs.train_torch("torch FSDP1")


def test_a_mesh_run_names_what_each_rank_computed_sent_and_held():
    steps = 2
    runs = labkit.run(mesh_runs.train_3d, 1, 1, 2, steps=steps, world_size=WORLD)
    alone_losses, alone_params = mesh_runs.train_alone()
    for rank, run in enumerate(runs):
        assert len(run.losses) == steps
        assert max(abs(a - b) for a, b in zip(run.losses, alone_losses[:steps], strict=True)) < 1e-10
        assert (run.params is not None) == (rank == 0) and run.bubble is None
        assert set(run.counted) == set(AXES)
        for axis in AXES:                                          # counted over the steps = plan's per step, x steps
            assert {k: n for k, n in run.counted[axis].items() if n} == \
                {k: steps * n for k, n in run.planned[axis].items()}, (rank, axis)
        assert run.memory["total"] == run.planned_memory["total"] > 0
    assert set(runs[0].params) == set(alone_params)


def test_a_pipelined_mesh_run_with_emulated_compute_measures_its_bubble():
    runs = labkit.run(mesh_runs.train_3d, 1, 2, 1, steps=1, emulate_compute_seconds=(0.01, 0.02), world_size=WORLD)
    assert all(run.bubble is not None and 0 < run.bubble < 1 for run in runs)
