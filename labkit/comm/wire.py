"""How a tensor travels between ranks, and the signature every rank compares before a collective starts.

The algorithms reduce on the rank itself, so the network only has to move bytes. `carriage` says how
a tensor travels over the backend that carries it: a dtype NCCL has no type for moves as the same
bytes under one it has, and a CUDA tensor on gloo, which has no point-to-point for CUDA tensors,
moves through host memory. The CUDA rules follow PyTorch's documentation and ProcessGroupNCCL's
dtype table; this machine checks them as pure functions, and tests/gpu on a GPU machine.

A tensor's `signature` (dtype, number of dimensions, shape) is a fixed-length list of ints, so that
ranks can exchange it as a small tensor and fail with an error, instead of a hang, when they disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DTYPES", "MAX_DIMS", "NCCL_DTYPES", "Carriage", "carriage", "carrier", "describe_signature",
           "dtype_index", "on_the_wire", "signature"]

MAX_DIMS = 8  # a signature holds a shape of up to this many dimensions
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
# The dtypes ProcessGroupNCCL maps to an NCCL type (its ncclDataType table; bool travels as ncclUint8). NCCL
# has no 16-bit integer and no complex type: torch.distributed.all_reduce sends complex as
# torch.view_as_real, and ProcessGroupNCCL refuses the rest.
NCCL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                         torch.int32, torch.int64, torch.bool})
_REAL_OF = {torch.complex64: torch.float32, torch.complex128: torch.float64}


@dataclass(frozen=True)
class Carriage:
    """How a tensor of one dtype and device travels between ranks.

    backend: what carries it ("gloo", "nccl", another name, or None if the group has no backend for the
    device); wire_dtype: the dtype of the view the backend is given (the same memory, reinterpreted);
    via_host: staged through a CPU copy; batched: a ring step's send and receive are posted together as
    one dist.batch_isend_irecv."""

    backend: str | None
    wire_dtype: torch.dtype
    via_host: bool
    batched: bool


def carrier(backend_config: str, device_type: str) -> str | None:
    """The backend that carries tensors on `device_type` in a group configured as `backend_config`.

    `backend_config` is what dist.get_backend_config(group) returns: "cpu:gloo,cuda:nccl" for labkit's
    NCCL pools (CPU tensors over gloo, CUDA tensors over NCCL), "cpu:gloo,cuda:gloo" for plain gloo; a
    bare name ("nccl") stands for every device.

    >>> carrier("cpu:gloo,cuda:nccl", "cuda"), carrier("cpu:gloo,cuda:nccl", "cpu"), carrier("cuda:nccl", "cpu")
    ('nccl', 'gloo', None)
    """
    backends = {}
    for part in backend_config.lower().split(","):
        device, _, backend = part.strip().rpartition(":")
        backends[device or "*"] = backend
    return backends.get(device_type, backends.get("*"))


def carriage(dtype: torch.dtype, device_type: str, backend_config: str, batched: bool | None = None) -> Carriage:
    """How a `dtype` tensor on `device_type` travels in a group configured as `backend_config`.

    - NCCL: a dtype ProcessGroupNCCL has no NCCL type for travels as the same bytes under one it has:
      complex as its real and imaginary parts (the float view torch.view_as_real gives, as
      torch.distributed.all_reduce sends complex), int16 as its raw bytes (uint8). Neither widening
      (twice the traffic, and the 2(N-1)/N byte count no longer holds) nor refusing is needed: the
      reduction happens on the rank, in the tensor's own dtype.
    - gloo: every dtype as it is; a CUDA tensor goes through host memory, because gloo's send and recv
      take CPU tensors only (PyTorch's distributed docs: gloo on GPU has broadcast and all_reduce).
    - `batched` (None: decide here): NCCL yes, otherwise no. On NCCL, a send and a receive posted one
      after the other can be serialised on one stream; NCCL progresses the operations of one group
      together (NCCL user guide, "Point-to-point communication"), which dist.batch_isend_irecv issues.
      On gloo batch_isend_irecv only posts each operation in turn, and it has hung in some releases.

    >>> carriage(torch.complex64, "cuda", "cpu:gloo,cuda:nccl").wire_dtype
    torch.float32
    >>> carriage(torch.float32, "cuda", "cpu:gloo,cuda:gloo").via_host
    True
    """
    backend = carrier(backend_config, device_type)
    wire = dtype
    if backend == "nccl" and dtype not in NCCL_DTYPES:
        wire = _REAL_OF.get(dtype, torch.uint8)
    via_host = backend == "gloo" and device_type != "cpu"
    return Carriage(backend, wire, via_host, backend == "nccl" if batched is None else batched)


def on_the_wire(tensor: torch.Tensor, wire_dtype: torch.dtype) -> torch.Tensor:
    """`tensor`'s memory seen as `wire_dtype` (complex64 as float32 pairs, int16 as bytes): no copy."""
    return tensor if tensor.dtype == wire_dtype else tensor.view(wire_dtype)


def dtype_index(dtype: torch.dtype) -> int:
    """`dtype`'s position in DTYPES: how a signature, a list of ints, names it. ValueError for another dtype."""
    if dtype not in DTYPES:
        raise ValueError(f"labkit.comm does not handle {dtype}; use one of "
                         f"{', '.join(str(d).removeprefix('torch.') for d in DTYPES)}.")
    return DTYPES.index(dtype)


def signature(tensor: torch.Tensor) -> list[int]:
    """[dtype index, ndim, shape padded to 8 dims with -1]: what must agree across ranks."""
    shape = list(tensor.shape)
    if len(shape) > MAX_DIMS:
        shape = [tensor.numel()]  # compare the element count only
    return [dtype_index(tensor.dtype), len(shape), *shape, *[-1] * (MAX_DIMS - len(shape))]


def describe_signature(sig: list[int]) -> str:
    """A signature as an error message shows it.

    >>> describe_signature(signature(torch.zeros(2, 3)))
    'float32[2, 3]'
    """
    dtype = str(DTYPES[sig[0]]).removeprefix("torch.")
    return f"{dtype}{list(sig[2:2 + sig[1]])}"
