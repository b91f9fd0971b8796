"""TensorFlow tensors to the engine and back, without copies.

The engine's buffer type is the torch tensor. A TensorFlow tensor becomes one through
DLPack (``tf.experimental.dlpack``): the torch tensor is a view of the TensorFlow buffer,
and a result comes back the same way, a TensorFlow tensor over the engine's output. Both
directions take a few microseconds whatever the size (CPU and GPU alike, every numeric
dtype and bool). Inputs are never written to: TensorFlow tensors are immutable, so every op
of this frontend runs out of place. A result that is an unaligned view (a small tensor's
slice of a fused buffer) is copied first: TensorFlow's kernels need aligned buffers.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf
import torch
from torch.utils import dlpack as torch_dlpack

__all__ = ["ALIGNMENT", "check_dense", "from_torch", "to_torch"]

#: Dtypes the engine moves (allgather, broadcast, alltoall): every integer, float, complex
#: and bool type, as raw bytes.
_MOVABLE = frozenset(
    (
        tf.float16,
        tf.bfloat16,
        tf.float32,
        tf.float64,
        tf.complex64,
        tf.complex128,
        tf.uint8,
        tf.uint16,
        tf.uint32,
        tf.uint64,
        tf.int8,
        tf.int16,
        tf.int32,
        tf.int64,
        tf.bool,
    )
)
#: Dtypes the engine reduces (allreduce, reducescatter): 64-bit unsigned integers and complex
#: numbers have no reduction in Gloo or NCCL.
_REDUCIBLE = _MOVABLE - {tf.uint64, tf.complex64, tf.complex128}


def check_dense(value: Any, what: str, reduces: bool = False) -> tf.Tensor:
    """A tf.Tensor of a dtype the engine moves, or reduces for an op that ``reduces`` (a
    Variable is read); a clear error else."""
    if isinstance(value, tf.IndexedSlices):
        raise TypeError(f"{what} expects a dense tensor here, got tf.IndexedSlices")
    if isinstance(value, tf.Tensor):
        tensor = value
    else:
        try:
            tensor = tf.convert_to_tensor(value)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"{what} expects tensors, got {type(value).__name__}: {error}"
            ) from None
    if tensor.dtype not in (_REDUCIBLE if reduces else _MOVABLE):
        raise TypeError(f"{what} does not support tensors of dtype {tensor.dtype.name}")
    return tensor


def to_torch(tensor: tf.Tensor) -> torch.Tensor:
    """A torch view of an eager TensorFlow tensor (no copy)."""
    return torch.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))


#: TensorFlow's kernels require buffers aligned to this many bytes (Eigen's alignment); its
#: DLPack import does not check, and a kernel then aborts the process.
ALIGNMENT = 64


def from_torch(tensor: torch.Tensor) -> tf.Tensor:
    """An eager TensorFlow tensor over a torch tensor's memory: no copy, unless the tensor
    is a view that TensorFlow's kernels cannot take (an unaligned slice of a fused buffer,
    or not contiguous), which is copied into memory of its own first."""
    if tensor.data_ptr() % ALIGNMENT or not tensor.is_contiguous():
        tensor = tensor.clone(memory_format=torch.contiguous_format)
    return tf.experimental.dlpack.from_dlpack(torch_dlpack.to_dlpack(tensor))
