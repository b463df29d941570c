"""What is running out names the strategy (the lesson's L1 and its worked 7B example's Step 6)."""

import pytest

from labkit.plan import parallelism_for
from labkit.widgets import what_is_running_out


@pytest.mark.parametrize("params,layer,gpu,expected", [
    (1e9, 0.05e9, 80e9, "data parallelism"),                    # 16 GB of state fits: time runs out
    (5e9, 0.2e9, 80e9, "data parallelism"),                     # exactly 80 GB still fits
    (7e9, 0.2e9, 150e9, "data parallelism"),                    # the 7B on a GPU of 150 GB
    (70e9, 0.86e9, 80e9, "pipeline parallelism or ZeRO-3/FSDP"),   # 140 GB of weights, 13.8 GB per layer
    (175e9, 6e9, 80e9, "tensor parallelism"),                   # one layer's state is 96 GB: one layer too big
    (7e9, 0.2e9, 80e9, "sharded data parallelism or LoRA"),     # the lesson's 7B: 14 GB weights, 112 GB state
    (40e9, 0.5e9, 80e9, "sharded data parallelism or LoRA"),    # weights exactly 80 GB still fit
])
def test_the_constraint_names_the_strategy(params, layer, gpu, expected):
    assert parallelism_for(params, layer, gpu).strategy == expected


def test_the_7b_case_says_why_with_its_bytes():
    strategy, why = parallelism_for(7e9, 0.2e9, 80e9)
    assert strategy == "sharded data parallelism or LoRA"
    assert "14.0 GB" in why and "112.0 GB" in why and "LoRA" in why and "FSDP" in why
    assert "replicated data parallelism (DDP)" in why


def test_each_answer_names_its_deciding_bytes():
    assert "16.0 GB" in parallelism_for(1e9, 0.05e9, 80e9).why
    assert "140.0 GB" in parallelism_for(70e9, 0.86e9, 80e9).why
    assert "96.0 GB" in parallelism_for(175e9, 6e9, 80e9).why


def test_too_many_layers_offers_the_pipeline_and_sharded_weights():
    # the course's own answer for a model whose weights do not fit (notebook 12): ZeRO-3 shards them too
    strategy, why = parallelism_for(70e9, 0.86e9, 80e9)
    assert strategy == "pipeline parallelism or ZeRO-3/FSDP"
    assert "pipeline parallelism" in why and "ZeRO-3, PyTorch FSDP" in why and "tensor parallelism" in why


def test_bytes_per_parameter_move_the_boundary():
    # 5e9 params: 80 GB at 16 bytes/param fits an 80 GB GPU, 90 GB at 18 (fp32 gradients) does not
    assert parallelism_for(5e9, 0.2e9, 80e9, grad_bytes=4).strategy == "sharded data parallelism or LoRA"
    # fp32 weights: 7e9 x 4 = 28 GB still fit
    assert parallelism_for(7e9, 0.2e9, 80e9, weight_bytes=4).strategy == "sharded data parallelism or LoRA"
    assert parallelism_for(25e9, 0.2e9, 80e9, weight_bytes=4).strategy == "pipeline parallelism or ZeRO-3/FSDP"


def test_nonsense_is_refused():
    with pytest.raises(ValueError, match=r"largest_layer_params=2000000000.0 exceeds params=1000000000.0"):
        parallelism_for(1e9, 2e9, 80e9)
    with pytest.raises(ValueError, match="gpu_nbytes"):
        parallelism_for(1e9, 1e8, 0)
    with pytest.raises(ValueError, match="params"):
        parallelism_for(0, 0, 80e9)


def test_widget_follows_its_sliders():
    app = what_is_running_out()
    params, layer, gpu, answer = app.children
    assert "sharded data parallelism or LoRA" in answer.value and "112.0 GB" in answer.value
    params.value = 1.0
    assert "<b>data parallelism</b>" in answer.value
    params.value, layer.value = 70.0, 0.86
    assert "<b>pipeline parallelism or ZeRO-3/FSDP</b>" in answer.value
    layer.value = 6.0
    assert "tensor parallelism" in answer.value
    gpu.value = 192.0
    assert "sharded data parallelism" in answer.value            # 140 GB of weights fit on 192 GB
    layer.value = 100.0                                            # a layer larger than the whole model
    assert "cannot hold more than the whole model" in answer.value
    assert "(100 billion parameters)" in answer.value and "(70 billion)" in answer.value
    assert "<b>" not in answer.value                               # no strategy for nonsense
    layer.value = 70.0                                             # a one-layer model is a model
    assert "cannot hold more" not in answer.value and "<b>" in answer.value
