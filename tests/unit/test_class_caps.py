"""The class caps read from the environment (labkit.classroom.caps): parsing, the refusal's words, the threads."""

import pytest

from labkit.classroom.caps import capped_world_size, class_cap, max_threads_per_rank, max_world_size
from labkit.launch.backend import threads_per_rank
from labkit.launch.owner import MAX_LIVE_RANKS, live_ranks_limit


@pytest.mark.parametrize("environ, cap", [({}, None), ({"LABKIT_MAX_WORLD_SIZE": ""}, None),
                                          ({"LABKIT_MAX_WORLD_SIZE": "  "}, None), ({"LABKIT_MAX_WORLD_SIZE": "4"}, 4),
                                          ({"LABKIT_MAX_WORLD_SIZE": " 2\n"}, 2)])
def test_an_unset_cap_is_none_and_a_set_one_its_number(environ, cap):
    assert max_world_size(environ) == cap


@pytest.mark.parametrize("raw", ["0", "-1", "4.0", "four", "4_0", "+4", "1e3", "٤"])
def test_a_cap_that_is_not_a_whole_number_from_1_says_so(raw):
    with pytest.raises(ValueError) as caught:
        max_threads_per_rank({"LABKIT_MAX_THREADS_PER_RANK": raw})
    assert str(caught.value) == (
        f"LABKIT_MAX_THREADS_PER_RANK={raw!r}: this class cap (torch threads per rank) must be a whole number >= 1. "
        "It comes from your server's environment, set by your instructor for this class: ask them to fix it (or, "
        "on your own machine, unset LABKIT_MAX_THREADS_PER_RANK).")


def test_asking_past_the_cap_names_the_request_the_cap_its_source_and_what_to_do():
    with pytest.raises(ValueError) as caught:
        capped_world_size(16, {"LABKIT_MAX_WORLD_SIZE": "4"})
    assert str(caught.value) == (
        "world_size=16: this class allows at most 4 ranks per call (set by your instructor for this class: "
        "LABKIT_MAX_WORLD_SIZE=4), because every student on this server shares its cores and memory. Ask for 4 or "
        "fewer: labkit.run(..., world_size=4) or %%ranks 4 (a notebook's parameters cell sets its world_size).")
    assert capped_world_size(4, {"LABKIT_MAX_WORLD_SIZE": "4"}) == 4
    assert capped_world_size(16, {}) == 16
    assert class_cap("LABKIT_NO_SUCH_CAP", {}) is None


@pytest.mark.parametrize("cap, world_size, cores, threads", [(None, 1, 8, 8), ("2", 1, 8, 2), ("2", 4, 8, 2),
                                                              ("2", 8, 8, 1), ("16", 2, 8, 4)])
def test_threads_per_rank_are_the_cores_share_within_the_cap(monkeypatch, cap, world_size, cores, threads):
    if cap is None:
        monkeypatch.delenv("LABKIT_MAX_THREADS_PER_RANK", raising=False)
    else:
        monkeypatch.setenv("LABKIT_MAX_THREADS_PER_RANK", cap)
    assert threads_per_rank(world_size, cores) == threads


@pytest.mark.parametrize("cap, limit", [(None, MAX_LIVE_RANKS), ("4", 4), ("64", MAX_LIVE_RANKS)])
def test_the_ranks_kept_warm_are_at_most_the_class_cap(monkeypatch, cap, limit):
    if cap is None:
        monkeypatch.delenv("LABKIT_MAX_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LABKIT_MAX_WORLD_SIZE", cap)
    assert live_ranks_limit() == limit
