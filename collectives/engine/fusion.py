"""Tensor fusion: which ready tensors travel together in one collective.

Every rank runs :func:`plan` on the same ordered list of ready ops and so gets the same
buckets in the same order; a rank then runs the buckets of the process sets it belongs to.
Tensors share a bucket when they have the same kind, process set, device type and what the
collective combines them with (dtype, op and scaling for reductions; the root for a
broadcast). A bucket holds at most ``fusion_threshold`` bytes; a tensor larger than that
gets a bucket of its own and runs in place. Alltoall is never fused (its splits are
per-tensor), as in Horovod.

CUDA reductions have a threshold of their own (``cuda_threshold``; see
:mod:`.config`): a fused bucket waits on the GPU for the last of its tensors, so a bucket
that packs a whole backward pass's gradients starts only once backward ended, where
smaller ones overlap it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from collectives.engine.reduction import PLAIN_SUM, Reduction
from collectives.engine.requests import (
    ALLGATHER,
    ALLREDUCE,
    ALLTOALL,
    REDUCESCATTER,
    Kind,
    Request,
    TensorSpec,
    parse_ragged,
    parse_signature,
)

__all__ = ["Bucket", "Slot", "Work", "plan"]


@dataclass(eq=False, slots=True)
class Work:
    """A ready op as this rank sees it."""

    kind: Kind
    name: str
    process_set_id: int
    # This rank's own request; None when it takes part without having submitted the op
    # (it has joined): it then contributes neutral values and discards the result.
    request: Request | None
    reduction: Reduction  # allreduce, reducescatter (as in Request)
    root: int  # broadcast (as in Request)
    specs: Sequence[TensorSpec]
    vars: dict[int, str]  # each submitting rank's per-rank part
    order: int
    remaining: int = 0

    @classmethod
    def of(cls, request: Request, vars_: dict[int, str], order: int) -> Work:
        """The work of this rank's own request."""
        return cls(
            request.kind,
            request.name,
            request.process_set_id,
            request,
            request.reduction,
            request.root,
            request.specs,
            vars_,
            order,
        )

    @classmethod
    def joined(
        cls, kind: Kind, name: str, process_set_id: int, sig: str, vars_: dict[int, str], order: int
    ) -> Work:
        """The work of a rank that has joined (it did not submit the op): decoded from a
        submitter's signature."""
        parsed = parse_signature(kind, sig)
        reduction = parsed.reduction() if kind in _REDUCING else PLAIN_SUM
        root = parsed.root() if kind == Kind.BROADCAST else 0
        return cls(
            kind, name, process_set_id, None, reduction, root, list(parsed.tensors), vars_, order
        )

    def dims(self, rank: int) -> list[int]:
        """A member's first dimension per tensor (0 for a rank that did not submit)."""
        var = self.vars.get(rank)
        if var is None:
            return [0] * len(self.specs)
        return parse_ragged(self.kind, var)[0]


@dataclass(eq=False, slots=True)
class Slot:
    work: Work
    index: int
    nbytes: int

    @property
    def spec(self) -> TensorSpec:
        return self.work.specs[self.index]

    @property
    def request(self) -> Request | None:
        return self.work.request


@dataclass(eq=False, slots=True)
class Bucket:
    kind: Kind
    process_set_id: int
    device_type: str
    slots: list[Slot]
    nbytes: int = 0

    def requests(self) -> list[Request]:
        seen: dict[int, Request] = {}
        for slot in self.slots:
            request = slot.request
            if request is not None:
                seen.setdefault(id(request), request)
        return list(seen.values())


_REDUCING = (ALLREDUCE, REDUCESCATTER)


def _row_bytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape[1:]) * spec.dtype.itemsize


def _allgather_bytes(work: Work, index: int, members: list[int]) -> int:
    """What an allgather tensor takes in a buffer: its longest contribution, per member."""
    rows = max((work.dims(r)[index] for r in members), default=0)
    return rows * _row_bytes(work.specs[index]) * len(members)


def plan(
    works: list[Work],
    members_of: dict[int, list[int]],
    threshold: int,
    cuda_threshold: int | None = None,
) -> list[Bucket]:
    """Packs the tensors of ready ops into buckets, identically on every rank
    (``cuda_threshold``: the bytes of a bucket of CUDA reductions; None: ``threshold``)."""
    cuda_limit = threshold if cuda_threshold is None else cuda_threshold
    buckets: list[Bucket] = []
    open_buckets: dict[tuple[object, ...], Bucket] = {}
    for work in works:
        kind = work.kind
        if kind > REDUCESCATTER:  # control ops move no data
            continue
        set_id = work.process_set_id
        if kind == ALLTOALL:
            work.remaining += 1
            slot = Slot(work, 0, 0)
            buckets.append(Bucket(kind, set_id, work.specs[0].device_type, [slot]))
            continue
        # Reductions combine by dtype, op and scaling; a broadcast by its root; an
        # allgather moves bytes, so any dtypes can share its buffer.
        by_dtype = kind in _REDUCING
        reduction, root = work.reduction, work.root
        specs = work.specs
        work.remaining += len(specs)
        for index, spec in enumerate(specs):
            if kind == ALLGATHER:
                nbytes = _allgather_bytes(work, index, members_of[set_id])
            else:
                nbytes = spec.nbytes
            key = (
                kind,
                set_id,
                reduction,
                root,
                spec.device_type,
                spec.dtype if by_dtype else None,
            )
            limit = cuda_limit if by_dtype and spec.device_type == "cuda" else threshold
            bucket = open_buckets.get(key)
            if bucket is None or bucket.nbytes + nbytes > limit:
                bucket = Bucket(kind, set_id, spec.device_type, [])
                buckets.append(bucket)
                open_buckets[key] = bucket
            bucket.slots.append(Slot(work, index, nbytes))
            bucket.nbytes += nbytes
    return buckets
