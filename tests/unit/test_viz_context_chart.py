"""causal_work_map draws what its caption says: every pair the causal mask keeps, in the colour of the rank whose
query it is, the masked half of each diagonal chunk pale (computed, then masked), and each panel's title the
busiest rank's share from labkit.plan.attention_work, whose count the coloured and pale cells make up."""

import pytest

from labkit.plan import attention_work, context_layout
from labkit.viz.context_chart import causal_work_map


@pytest.mark.parametrize("length,cp", [(16, 4), (13, 3), (10, 2)])
def test_each_rank_colours_the_pairs_of_its_queries_the_mask_keeps(length, cp):
    figure = causal_work_map(length, cp)
    heatmaps = [t for t in figure.data if t.type == "heatmap"]
    for heatmap, zigzag in zip(heatmaps, (False, True), strict=True):
        owner = {p: r for r, chunks in enumerate(context_layout(length, cp, zigzag))
                 for start, stop in chunks for p in range(start, stop)}
        for q, row in enumerate(heatmap.z):
            assert [cell if cell is None or cell < cp else None for cell in row] == \
                [owner[q] if k <= q else None for k in range(length)]
            assert all(cell is None or cell in (owner[q], owner[q] + cp) for cell in row)
        kept = [sum(cell == r for row in heatmap.z for cell in row) for r in range(cp)]
        assert sum(kept) == length * (length + 1) // 2  # the mask's lower triangle, each pair once
        computed = [sum(cell in (r, r + cp) for row in heatmap.z for cell in row) for r in range(cp)]
        assert computed == attention_work(length, cp, zigzag)  # coloured and pale: what each rank computes
    contiguous, zigzag = (attention_work(length, cp, z) for z in (False, True))
    titles = [a.text for a in figure.layout.annotations]
    assert titles[0] == f"contiguous: busiest rank {max(contiguous) / (sum(contiguous) / cp):.2f}x the mean"
    assert titles[1].startswith("zig-zag: busiest rank 1.0")  # 1.00x when 2 cp divides the length
    assert [t.name for t in figure.data if t.type == "scatter"] == [f"rank {r}" for r in range(cp)]
