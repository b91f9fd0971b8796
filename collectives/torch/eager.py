"""Eager small allreduces: the data rides along with the negotiation round.

A lone small allreduce (a loss, a metric, a flag) would otherwise cost two collectives: the
negotiation round and then the allreduce itself. When a round carries only a few requests,
each rank appends the bytes of its small CPU allreduce inputs to its announcement. If the
round turns out to be *agreed* (every rank announced exactly the same ops, see
``Engine._agreed``), every rank already holds every rank's data and reduces it locally, in
rank order, so all ranks get bit-identical results and the op costs one collective. In any
other round the data is ignored and the op runs as a normal collective.

Every rank decides eligibility from the request's signature alone and the number of
requests in the round, both identical across ranks in an agreed round.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from collectives.torch.common import ReduceOp
from collectives.torch.execute import finish_, flat, scale_
from collectives.torch.requests import Kind, Request

__all__ = ["MAX_BYTES", "MAX_OPS", "eligible", "pack", "reduce_locally", "split"]

#: Largest input (bytes) that travels with the negotiation.
MAX_BYTES = 64
#: Rounds with more requests than this use the fused collective (it is cheaper then).
MAX_OPS = 4

_DTYPES = {
    torch.uint8,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
}
_LENGTH = struct.Struct("<I")


def eligible(request: Request) -> bool:
    if request.kind != Kind.ALLREDUCE or len(request.specs) != 1:
        return False
    spec = request.specs[0]
    return spec.device_type == "cpu" and spec.nbytes <= MAX_BYTES and spec.dtype in _DTYPES


def pack(records: bytes, requests: Sequence[Request]) -> bytes:
    """A round's payload: the records, then the data of the eligible requests."""
    data = b""
    if 0 < len(requests) <= MAX_OPS:
        parts = [
            bytes(flat(r.inputs[0]).view(torch.uint8).tolist()) for r in requests if eligible(r)
        ]
        data = b"".join(parts)
    return _LENGTH.pack(len(records)) + records + data


def split(payload: bytes) -> tuple[bytes, bytes]:
    """(records, data) of a rank's payload."""
    if not payload:
        return b"", b""
    (length,) = _LENGTH.unpack_from(payload)
    end = _LENGTH.size + length
    return payload[_LENGTH.size : end], payload[end:]


def reduce_locally(request: Request, datas: list[bytes], offset: int) -> int:
    """Computes the allreduce from every rank's data; returns the next data offset."""
    spec = request.specs[0]
    size = spec.nbytes
    values = [
        torch.frombuffer(bytearray(data[offset : offset + size]), dtype=spec.dtype)
        if size
        else torch.empty(0, dtype=spec.dtype)
        for data in datas
    ]
    op = ReduceOp(request.common[0])
    prescale, postscale = request.common[1], request.common[2]
    with torch.no_grad():
        stacked = torch.stack(values)
        scale_(stacked, prescale)
        if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
            result = stacked.sum(0, dtype=spec.dtype)
        elif op == ReduceOp.MIN:
            result = stacked.amin(0)
        elif op == ReduceOp.MAX:
            result = stacked.amax(0)
        else:
            result = stacked.prod(0, dtype=spec.dtype)
        finish_(result, op, postscale, len(datas))
        out = request.outputs[0]
        if out is None:  # out of place: the result is the output
            request.outputs[0] = result.view(request.inputs[0].shape)
        else:
            out.copy_(result.view(out.shape))
    return offset + size
