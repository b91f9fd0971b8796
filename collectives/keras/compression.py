"""Gradient compression for Keras values on any backend (Horovod's ``hvd.Compression``):
``Compression.fp16`` sends floating-point values as float16 and casts them back."""

from __future__ import annotations

from typing import Any

from collectives.keras import backend as keras_backend

__all__ = ["Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """Interface: ``compress`` returns (value to send, context); ``decompress`` undoes it."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        raise NotImplementedError


class NoneCompressor(Compressor):
    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        return tensor


class FP16Compressor(Compressor):
    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        keras = keras_backend.current().keras
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if dtype.startswith("float") and dtype != "float16":
            return keras.ops.cast(tensor, "float16"), dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        if ctx is None:
            return tensor
        return keras_backend.current().keras.ops.cast(tensor, ctx)


class Compression:
    none = NoneCompressor
    fp16 = FP16Compressor
