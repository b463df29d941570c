"""Pickling between the owner and its ranks: cloudpickle, with three changes.

- Code keeps its file name. cloudpickle 3 renames every file "<dynamic-code>"; keeping it lets a
  rank's tracebacks and stacks point at the notebook cell or script line the code came from.
- Plain CPU tensors travel as raw bytes. torch's own pickling goes through torch.save and costs
  about a millisecond even for four floats, which would dominate a warm call. The price: tensors
  that share memory (a tensor and its views) arrive as separate copies.
- CUDA tensors travel as the same raw bytes and land on the receiving rank's own device,
  labkit.device() (cuda:LOCAL_RANK under NCCL, the CPU under gloo), or on the CPU outside a rank.
  torch's pickling keeps the device index, so a tensor captured from the notebook's cuda:0 would
  otherwise land on cuda:0 on every rank, beside rank 0's work.
"""

from __future__ import annotations

import io
import marshal
import types
from collections import ChainMap

import cloudpickle
import torch

from labkit.groups import device, group_is_up

__all__ = ["dumps", "landing_device", "lands_on_rank_device", "load_result", "loads"]


def _reduce_code(code: types.CodeType):
    return marshal.loads, (marshal.dumps(code),)


def _rebuild_tensor(data: bytearray, dtype: torch.dtype, shape: tuple, requires_grad: bool) -> torch.Tensor:
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape).requires_grad_(requires_grad)


def _rebuild_on_rank_device(data: bytearray, dtype: torch.dtype, shape: tuple, requires_grad: bool) -> torch.Tensor:
    """A GPU tensor's bytes, rebuilt on the device of the rank that unpickles them."""
    return _rebuild_tensor(data, dtype, shape, False).to(landing_device()).requires_grad_(requires_grad)


def landing_device() -> torch.device:
    """Where a GPU tensor unpickled in this process lands: labkit.device() inside a rank (its own GPU under
    NCCL), the CPU anywhere else."""
    if group_is_up():
        return device()
    return torch.device("cpu")


def lands_on_rank_device(t: torch.Tensor) -> bool:
    """True for a tensor that travels as bytes and lands on the receiving rank's device (`landing_device`):
    a CUDA tensor. A CPU tensor lands on the CPU."""
    return t.device.type == "cuda"


def _reduce_tensor(t: torch.Tensor):
    plain = (type(t) is torch.Tensor and t.layout == torch.strided
             and (t.device.type == "cpu" or lands_on_rank_device(t))
             and not t.is_quantized and not t.is_conj() and not t.is_neg() and t.grad_fn is None)
    if not plain:
        return t.__reduce_ex__(5)
    rebuild = _rebuild_on_rank_device if lands_on_rank_device(t) else _rebuild_tensor
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return rebuild, (bytearray(raw.numpy().tobytes()), t.dtype, tuple(t.shape), t.requires_grad)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _reduce_code, torch.Tensor: _reduce_tensor},
                              cloudpickle.Pickler.dispatch_table)


def dumps(obj) -> bytes:
    """`obj` pickled with cloudpickle and the changes above."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=5).dump(obj)
    return buffer.getvalue()


loads = cloudpickle.loads


def load_result(rank: int, data: bytes):
    """Unpickle rank `rank`'s result here, or raise a TypeError that names the rank."""
    try:
        return loads(data)
    except Exception as exc:
        raise TypeError(f"rank {rank}'s result reached this process but cannot be unpickled here "
                        f"({type(exc).__name__}: {exc}). Return plain data (tensors, numbers, lists, dicts), "
                        "or define its class in a module both sides can import.") from exc
