"""Pickling between the owner and its ranks: cloudpickle, with two changes.

- Code keeps its file name. cloudpickle 3 renames every file "<dynamic-code>"; keeping it lets a
  rank's tracebacks and stacks point at the notebook cell or script line the code came from.
- Plain CPU tensors travel as raw bytes. torch's own pickling goes through torch.save and costs
  about a millisecond even for four floats, which would dominate a warm call. The price: tensors
  that share memory (a tensor and its views) arrive as separate copies.
"""

from __future__ import annotations

import io
import marshal
import types
from collections import ChainMap

import cloudpickle
import torch


def _reduce_code(code: types.CodeType):
    return marshal.loads, (marshal.dumps(code),)


def _rebuild_tensor(data: bytearray, dtype: torch.dtype, shape: tuple, requires_grad: bool) -> torch.Tensor:
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape).requires_grad_(requires_grad)


def _reduce_tensor(t: torch.Tensor):
    plain = (type(t) is torch.Tensor and t.layout == torch.strided and t.device.type == "cpu"
             and not t.is_quantized and not t.is_conj() and not t.is_neg() and t.grad_fn is None)
    if not plain:
        return t.__reduce_ex__(5)
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return _rebuild_tensor, (bytearray(raw.numpy().tobytes()), t.dtype, tuple(t.shape), t.requires_grad)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _reduce_code, torch.Tensor: _reduce_tensor},
                              cloudpickle.Pickler.dispatch_table)


def dumps(obj) -> bytes:
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
