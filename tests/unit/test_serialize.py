"""What travels between the owner and its ranks comes back equal, and code keeps its file name."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.launch import serialize

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.int8,
          torch.bool, torch.complex64]


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 4), max_size=3), dtype=st.sampled_from(DTYPES), transpose=st.booleans())
def test_tensors_round_trip_exactly(shape, dtype, transpose):
    t = (torch.randn(shape) * 10).to(dtype)
    if transpose and t.dim() >= 2:
        t = t.transpose(0, 1)  # not contiguous
    back = serialize.loads(serialize.dumps(t))
    assert back.dtype == t.dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_scalars_grads_and_parameters_survive():
    scalar = torch.tensor(3.5)
    leaf = torch.ones(3, requires_grad=True)
    parameter = torch.nn.Parameter(torch.zeros(2))
    back = serialize.loads(serialize.dumps([scalar, leaf, parameter, {"nested": scalar}]))
    assert back[0].item() == 3.5 and back[0].shape == () and back[3]["nested"].item() == 3.5
    assert back[1].requires_grad
    assert isinstance(back[2], torch.nn.Parameter)


def test_functions_keep_their_file_name():
    def f():
        return 1
    g = serialize.loads(serialize.dumps(f))
    assert g() == 1
    assert g.__code__.co_filename == __file__
