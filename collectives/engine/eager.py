"""Eager small allreduces: the data rides along with the negotiation round.

A small allreduce (a loss, a metric, a burst of small gradients) would otherwise cost two
collectives: the negotiation round and then the fused allreduce. When the small CPU
allreduces of a round fit in the negotiation slot, each rank appends their bytes to its
announcement. If the round turns out to be *agreed* (every rank announced exactly the same
ops, see ``Engine._agreed``), every rank already holds every rank's data and reduces it
locally, in rank order, so all ranks get bit-identical results and the ops cost one
collective. In any other round the data is ignored and the ops run as a normal collective.

The data rides all or nothing: every eligible op of the round, or none. Every rank decides
from the round's records, the slot size and the budget, all identical across ranks in an
agreed round; a rank also checks that every peer sent as many bytes as it did, so that
ranks configured differently fall back to the normal collective together.

The slot only grows to carry data when a round asked for it (see ``Exchange``): the first
burst of a pattern runs as a normal collective, the repetitions ride along. An allgather
moves each rank's data to every other rank, so the budget shrinks with the number of
ranks: ``BUDGET_BYTES / (size - 1)`` per rank, never more than the fusion threshold.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from collectives.common import ReduceOp
from collectives.engine.reduction import Reduction
from collectives.engine.requests import Kind, Request

__all__ = [
    "BUDGET_BYTES",
    "FOLLOW",
    "INLINE",
    "Riders",
    "budget",
    "delivery",
    "eligible",
    "reduce_locally",
    "select",
    "split",
]

#: What one rank may receive from all its peers' data in one round.
BUDGET_BYTES = 512 * 1024

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


class Riders:
    """The requests whose data rides with a round (all eligible ones, or none)."""

    __slots__ = ("inline", "nbytes", "payload", "requests", "want")

    def __init__(self, payload: bytes, requests: list[Request], nbytes: int, room: int) -> None:
        self.payload = payload  # the records, length-prefixed; inline data follows them
        self.requests = requests
        self.nbytes = nbytes
        self.want = len(payload) + nbytes  # the same on every rank that chose alike
        # In the negotiation slot itself, or (too large for it) in a second allgather.
        self.inline = bool(requests) and self.want <= room

    def tensors(self) -> list[torch.Tensor]:
        """The riders' inputs as flat bytes: one copy per run of a dtype (one torch call
        each, not one view per tensor)."""
        return [
            torch._C._nn.flatten_dense_tensors([r.inputs[0] for r in run]).view(torch.uint8)
            for run in _runs(self.requests, same_reduction=False)
        ]


def budget(size: int, fusion_threshold: int) -> int:
    """Data bytes a rank may send in one round."""
    return min(fusion_threshold, BUDGET_BYTES // max(1, size - 1))


def eligible(request: Request, limit: int) -> bool:
    if request.kind != Kind.ALLREDUCE or len(request.specs) != 1:
        return False
    spec = request.specs[0]
    return spec.device_type == "cpu" and 0 < spec.nbytes <= limit and spec.dtype in _DTYPES


def select(records: bytes, requests: Sequence[Request], room: int, limit: int) -> Riders:
    """A round's payload and riders: every eligible request if their data fits the
    budget, else none."""
    payload = _LENGTH.pack(len(records)) + records
    chosen = [r for r in requests if eligible(r, limit)]
    nbytes = sum([r.specs[0].nbytes for r in chosen])
    if nbytes > limit:
        return Riders(payload, [], 0, room)
    return Riders(payload, chosen, nbytes, room)


def _runs(requests: list[Request], same_reduction: bool) -> list[list[Request]]:
    """Consecutive requests with the same dtype (and op and scaling, if ``same_reduction``)."""
    runs: list[list[Request]] = []
    key: tuple[object, ...] | None = None
    for request in requests:
        mine = (request.specs[0].dtype, request.reduction if same_reduction else None)
        if mine != key:
            runs.append([])
            key = mine
        runs[-1].append(request)
    return runs


def split(payload: bytes | memoryview) -> tuple[bytes, bytes | memoryview]:
    """(records, data) of a rank's payload."""
    if not payload:
        return b"", b""
    (length,) = _LENGTH.unpack_from(payload)
    end = _LENGTH.size + length
    return bytes(payload[_LENGTH.size : end]), payload[end:]


INLINE = "inline"
FOLLOW = "follow"


def delivery(riders: Riders, datas: list[bytes | memoryview], wants: list[int]) -> str | None:
    """How the riders' data reaches every rank in an agreed round, the same decision
    everywhere: ``INLINE`` (every rank sent it in the slot), ``FOLLOW`` (too large for the
    slot on every rank: it follows in one allgather of its own, still cheaper than a fused
    allreduce), or None (the ranks chose differently: the ops run as usual)."""
    if not riders.requests:
        return None
    if riders.inline:
        return INLINE if all(len(data) == riders.nbytes for data in datas) else None
    return FOLLOW if all(want == riders.want for want in wants) else None


def reduce_locally(riders: Riders, datas: Sequence[bytes | memoryview | torch.Tensor]) -> None:
    """Computes the riders' allreduces from every rank's data (flat bytes) into their
    outputs; consecutive riders with the same dtype, op and scaling reduce as one."""
    views = [
        d if isinstance(d, torch.Tensor) else torch.frombuffer(d, dtype=torch.uint8) for d in datas
    ]
    offset = 0
    for run in _runs(riders.requests, same_reduction=True):
        dtype = run[0].specs[0].dtype
        counts = [r.specs[0].numel for r in run]
        end = offset + sum(counts) * dtype.itemsize
        stacked = torch.stack([view[offset:end] for view in views]).view(dtype)
        _distribute(run, counts, _reduce(stacked, run[0].reduction, len(views)))
        offset = end


def _reduce(stacked: torch.Tensor, reduction: Reduction, size: int) -> torch.Tensor:
    op = reduction.op
    dtype = stacked.dtype
    # (stacked is the gathered data, no autograd leaf: grad mode does not matter here)
    reduction.stage(stacked)
    if reduction.sums:
        result = stacked.sum(0, dtype=dtype)
    elif op == ReduceOp.MIN:
        result = stacked.amin(0)
    elif op == ReduceOp.MAX:
        result = stacked.amax(0)
    else:
        result = stacked.prod(0, dtype=dtype)
    reduction.finish(result, size)
    return result


def _distribute(run: list[Request], counts: list[int], result: torch.Tensor) -> None:
    """Puts each request's part of ``result`` in its output. Outputs left to the engine
    (see ``execute._copy_out``) become views of ``result``, which nothing else holds."""
    outputs = [r.outputs[0] for r in run]
    if all(out is not None and out.dim() == 1 for out in outputs):
        torch.split_with_sizes_copy(result, counts, out=outputs)  # one call for all
        return
    for request, out, piece in zip(run, outputs, result.split(counts), strict=True):
        shape = request.specs[0].shape
        if out is None:
            request.outputs[0] = piece if len(shape) == 1 else piece.view(shape)
        else:
            out.copy_(piece if out.dim() == 1 else piece.view(out.shape))
