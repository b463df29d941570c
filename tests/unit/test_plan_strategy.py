"""What is running out names the strategy (the lesson's L1)."""

import pytest

from labkit.plan import parallelism_for
from labkit.widgets import what_is_running_out


@pytest.mark.parametrize("state,layer,gpu,expected", [
    (14e9, 0.5e9, 80e9, "data parallelism"),         # fits: time is what runs out
    (112e9, 2e9, 80e9, "pipeline parallelism"),      # too many layers
    (400e9, 100e9, 80e9, "tensor parallelism"),      # one layer too big
    (80e9, 1e9, 80e9, "data parallelism"),           # exactly full still fits
])
def test_the_constraint_names_the_strategy(state, layer, gpu, expected):
    assert parallelism_for(state, layer, gpu)[0] == expected


def test_nonsense_is_refused():
    with pytest.raises(ValueError, match="largest_layer_nbytes"):
        parallelism_for(1e9, 2e9, 80e9)
    with pytest.raises(ValueError, match="gpu_nbytes"):
        parallelism_for(1e9, 1e8, 0)


def test_widget_follows_its_sliders():
    app = what_is_running_out()
    state, layer, gpu, answer = app.children
    assert "data parallelism" in answer.value
    state.value = 200.0
    assert "pipeline parallelism" in answer.value
    layer.value = 100.0
    assert "tensor parallelism" in answer.value
    layer.value = 300.0
    assert "cannot hold more" in answer.value
