"""Gradient compression around allreduce, for TensorFlow tensors (Horovod's
``hvd.Compression``): ``Compression.fp16`` sends floating-point tensors as float16 and
casts them back afterwards; other tensors pass unchanged."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """Interface: ``compress`` returns (tensor to send, context); ``decompress`` undoes it."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Sends floating-point tensors as float16 and casts them back after the collective."""

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, Any]:
        dtype = tensor.dtype
        if dtype.is_floating and dtype != tf.float16:
            return tf.cast(tensor, tf.float16), dtype
        return tensor, dtype

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: Any) -> tf.Tensor:
        if ctx is not None and tensor.dtype != ctx:
            return tf.cast(tensor, ctx)
        return tensor


class Compression:
    """The compressors, as Horovod names them."""

    none = NoneCompressor
    fp16 = FP16Compressor
