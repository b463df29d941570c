"""The ring grader's reading of wrong values (labkit.exercises.diagnosis.wrong_values): one right chunk is a
missing all-gather only where the other chunks hold what a reduce-scatter leaves, partial sums with the rank's own
input in them. With chunks of one element, a wrong value can equal the sum by chance (the catalogue's
ring_recomputes_the_inputs was once told its all-gather was missing)."""

import torch

from labkit.exercises.diagnosis import Outcome, wrong_values

# three ranks' inputs, three elements: one per chunk of tensor_split(3)
INPUTS = [torch.tensor([10.0, 1.0, 1.0]), torch.tensor([20.0, 3.0, 4.0]), torch.tensor([30.0, 7.0, 7.0])]
TOTAL = sum(INPUTS)  # [60, 11, 12]


def told(rank_0_holds: torch.Tensor) -> str:
    """What the grader says when rank 0 (and every rank) ends with `rank_0_holds`."""
    outcomes = [Outcome(rank_0_holds.tolist(), None, True) for _ in INPUTS]
    return wrong_values(outcomes, INPUTS, ring=True)


def test_a_chunk_right_by_chance_is_not_called_a_missing_all_gather():
    got = 6 * INPUTS[0]  # [60, 6, 6]: chunk 0 equals its sum by chance; 6 is no sum of rank 0's input and others'
    assert told(got) == ("rank 0 got [60.0, 6.0, 6.0], expected [60.0, 11.0, 12.0]. Chunks [1, 2] of "
                         "t.tensor_split(3) are wrong (chunks [0] are right): some step sent, or added into, another "
                         "chunk than the ring's. Check which chunk each step sends and which it adds into.")


def test_a_reduce_scatter_without_its_all_gather_is_named():
    got = torch.stack([TOTAL[0], INPUTS[0][1] + INPUTS[2][1], INPUTS[0][2]])  # chunk 0 done, 1 and 2 partial
    assert told(got) == ("on rank 0 only chunk 0 is fully reduced: the reduce-scatter worked; the all-gather that "
                         "passes the finished chunks around the ring is missing.")


def test_a_partial_sum_without_the_ranks_own_input_is_not_a_reduce_scatters():
    got = torch.stack([TOTAL[0], INPUTS[1][1] + INPUTS[2][1], INPUTS[0][2]])  # chunk 1 lacks rank 0's own input
    assert "Chunks [1, 2] of t.tensor_split(3) are wrong (chunks [0] are right)" in told(got)
