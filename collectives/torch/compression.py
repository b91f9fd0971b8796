"""Gradient compression applied around allreduce (Horovod's ``hvd.Compression``).

Compression trades precision for bandwidth: ``Compression.fp16`` sends floating-point tensors
as float16 and restores the original dtype afterwards. Non-floating tensors pass unchanged,
so the same compressor can be used for any tensor.

A leaf (Horovod's ``horovod.torch.compression``): the op API and the optimizers use it, and it
imports nothing of the package.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """Interface: ``compress`` returns (tensor to send, context); ``decompress`` undoes it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Compresses a tensor and returns it with the context needed to decompress it."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Decompresses a tensor with the context returned by ``compress``."""
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Returns the tensor itself."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Returns the tensor itself."""
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 and casts them back after the collective."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Casts a floating-point tensor to float16; the context is its original dtype."""
        dtype = tensor.dtype
        if tensor.is_floating_point() and dtype != torch.float16:
            return tensor.to(torch.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Casts back to the dtype recorded by ``compress``."""
        if isinstance(ctx, torch.dtype) and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class Compression:
    """The available compressors: ``Compression.none`` and ``Compression.fp16``."""

    none: type[Compressor] = NoneCompressor
    fp16: type[Compressor] = FP16Compressor
