"""expert_balance_chart draws each run's load-balancing loss per step, with the balanced and the all-to-one levels."""

from labkit.viz.experts_chart import expert_balance_chart


def test_one_line_per_run_and_the_two_levels():
    figure = expert_balance_chart({"without": [3.0, 3.5, 3.8], "with": [3.0, 2.0, 1.2]}, experts=8)
    assert [t.name for t in figure.data] == ["without", "with"]
    assert list(figure.data[1].y) == [3.0, 2.0, 1.2] and list(figure.data[1].x) == [0, 1, 2]
    levels = sorted(shape.y0 for shape in figure.layout.shapes)
    assert levels == [1, 8]
    assert figure.layout.yaxis.range[1] > 8
