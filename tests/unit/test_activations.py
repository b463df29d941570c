"""labkit.activations: the bytes a forward leaves for the backward, and what activation checkpointing
(recomputation) does to them: fewer bytes, the same gradients; a TinyGPT's blocks against plan.activation_nbytes."""

import doctest

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import labkit.activations
from labkit.activations import gpt_blocks_nbytes, saved_activation_nbytes, tiny_gpt_nbytes
from labkit.models import TinyGPT, make_classification, mlp
from labkit.plan import activation_nbytes

pytestmark = pytest.mark.numerics  # compares floating-point results: make unit runs it again on other kernels

BATCH, HIDDEN = 32, 64
RELU_OUTPUT = BATCH * HIDDEN * 4  # one hidden activation, float32


def test_a_plain_forward_saves_each_hidden_activation_once():
    # ReLU saves its output and the next Linear saves the same tensor as its input: one storage, counted
    # once. The input x and the weights (the transposed views a Linear saves) are not activations.
    x = torch.randn(BATCH, 16)
    for layers in (1, 2, 4):
        assert saved_activation_nbytes(mlp(layers=layers), x) == layers * RELU_OUTPUT
    assert saved_activation_nbytes(mlp(layers=2, dtype=torch.float64), x.double()) == 2 * 2 * RELU_OUTPUT


def test_checkpointing_saves_fewer_bytes():
    model, x = mlp(layers=4), torch.randn(BATCH, 16)
    plain = saved_activation_nbytes(model, x)
    # Two segments: the first is recomputed, so only its output (the second's input) and the last
    # segment's activations stay: 3 of the 4.
    halves = saved_activation_nbytes(lambda x: checkpoint_sequential(model, 2, x, use_reentrant=False), x)
    whole = saved_activation_nbytes(lambda x: checkpoint(model, x, use_reentrant=False), x)
    assert (plain, halves, whole) == (4 * RELU_OUTPUT, 3 * RELU_OUTPUT, 0)


def test_checkpointing_gives_identical_gradients_dropout_included():
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, HIDDEN), nn.ReLU(), nn.Dropout(0.3), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                             nn.Dropout(0.3), nn.Linear(HIDDEN, 4))
    x, y = make_classification(BATCH)
    grads = []
    for run in (lambda m, x: m(x), lambda m, x: checkpoint_sequential(m, 3, x, use_reentrant=False)):
        model = make()
        torch.manual_seed(1)  # the same dropout masks; checkpoint replays the RNG state when it recomputes
        F.cross_entropy(run(model, x), y).backward()
        grads.append([p.grad for p in model.parameters()])
    # bit for bit: checkpoint recomputes the same forward (the same kernels on the same shapes) and backpropagates
    # through it as the plain run does
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    model = make()
    torch.manual_seed(1)
    saved = saved_activation_nbytes(lambda x: checkpoint_sequential(model, 3, x, use_reentrant=False), x)
    torch.manual_seed(1)
    assert saved < saved_activation_nbytes(model, x)


def test_a_tensor_saved_twice_counts_once_and_inputs_and_parameters_not_at_all():
    x = torch.randn(BATCH, HIDDEN, requires_grad=True)
    assert saved_activation_nbytes(lambda x: x * x, x) == 0  # x is an input: it exists anyway
    assert saved_activation_nbytes(lambda x: x.exp() * x.exp(), x) == 2 * RELU_OUTPUT  # two different tensors

    def square_of_exp(x):
        h = x.exp()  # exp saves its output h; h * h saves h twice more: one storage
        return h * h
    assert saved_activation_nbytes(square_of_exp, x) == RELU_OUTPUT
    linear = nn.Linear(HIDDEN, HIDDEN)
    assert saved_activation_nbytes(linear, x) == 0  # saves x and its weight: neither is an activation
    assert saved_activation_nbytes(linear.forward, x) == 0
    with torch.no_grad():  # it counts what a training forward keeps, even when called under no_grad
        assert saved_activation_nbytes(square_of_exp, x) == RELU_OUTPUT


def test_docstring_example():
    result = doctest.testmod(labkit.activations)
    assert result.attempted > 0 and result.failed == 0


@settings(max_examples=12, deadline=None)
@given(layers=st.integers(1, 3), heads=st.sampled_from([1, 2, 4]), head_dim=st.sampled_from([4, 8, 16]),
       sequence=st.integers(1, 24), micro_batch=st.integers(1, 4))
def test_tiny_gpt_keeps_what_the_plan_predicts_plus_its_layernorm_and_attention_statistics(
        layers, heads, head_dim, sequence, micro_batch):
    d_model = heads * head_dim
    model = TinyGPT(50, d_model=d_model, layers=layers, heads=heads, context=24)
    tokens = torch.randint(50, (micro_batch, sequence))
    shape = dict(layers=layers, d_model=d_model, heads=heads, sequence=sequence, micro_batch=micro_batch)
    for backend, flash in ((SDPBackend.FLASH_ATTENTION, True), (SDPBackend.MATH, False)):
        with sdpa_kernel([backend]):
            assert gpt_blocks_nbytes(model, tokens) == tiny_gpt_nbytes(**shape, flash_attention=flash)
            assert gpt_blocks_nbytes(model, tokens, recompute=True) == tiny_gpt_nbytes(**shape, recompute="full")
    # full recomputation keeps the paper's 2 sbh per layer, in float32: 4 sbh, exactly plan's
    assert tiny_gpt_nbytes(**shape, recompute="full") == activation_nbytes(**shape, recompute="full", bytes_per_value=4)


def test_tiny_gpt_is_the_papers_block_in_float32_without_dropout_to_within_one_percent():
    # the two terms plan leaves out, 4 bs + a bs floats per layer against 16 sbh, are (4 + a) / (16 h) of it
    shape = dict(layers=4, d_model=64, heads=4, sequence=64, micro_batch=8)
    model, tokens = TinyGPT(82, d_model=64, layers=4, heads=4, context=64), torch.randint(82, (8, 64))
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        measured = gpt_blocks_nbytes(model, tokens)
    planned = activation_nbytes(**shape, bytes_per_value=4, dropout=False)
    assert planned < measured and (measured - planned) / planned == (4 + 4) / (16 * 64)
    with pytest.raises(ValueError, match="recompute='selective'"):
        tiny_gpt_nbytes(**shape, recompute="selective")
    with pytest.raises(TypeError, match="pass a labkit.models.TinyGPT"):
        gpt_blocks_nbytes(mlp(), tokens)
