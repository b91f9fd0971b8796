"""Runs the buckets that :mod:`fusion` planned: one collective per bucket.

Small tensors are copied into a fusion buffer that is kept and reused (grown on demand), the
collective runs on the buffer, and the results are copied out. A bucket of one tensor runs
directly on the output tensor, with no copy (in place when the user asked for it).
Allgather, broadcast and alltoall move raw bytes (``uint8`` views), so every dtype works and
tensors of different dtypes can share a buffer.

A rank that has joined (``hvd.join()``) still takes part in the collectives of others: it
contributes the op's neutral element (0 for Sum/Average, 1 for Product, the dtype's extreme
for Min/Max, zero rows for allgather/alltoall) and discards the result.

CUDA tensors run on a stream of the engine's own (per device) that first waits for the event
recorded on the submitting stream, so communication overlaps the user's later kernels; a
blocking op run by its caller's thread runs on the caller's stream itself (see
:mod:`.streams`). The handle is completed with an event recorded after the last
kernel that writes the output.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import mmap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from collectives.common import ReduceOp
from collectives.engine import streams
from collectives.engine.fusion import Bucket, Slot
from collectives.engine.reduction import PLAIN_SUM, Reduction, neutral_value
from collectives.engine.requests import Kind, Request, TensorSpec, parse_ragged

__all__ = ["Executor", "Group", "Sums", "check_unchanged", "dense", "reduces_directly"]

_TORCH_OPS: dict[int, Any] = {
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}

_SUM: Any = dist.ReduceOp.SUM
_SUM_OP = int(ReduceOp.SUM)
_AVERAGE = int(ReduceOp.AVERAGE)


def _ar(op: int) -> Any:
    """New allreduce options for ``op`` (a :class:`ReduceOp` value)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = _TORCH_OPS[op]
    return opts


#: The allreduce options of each op, made once (never changed: torch copies what it reads).
_OPTIONS = {op: _ar(op) for op in _TORCH_OPS}
_SUM_OPTIONS = _OPTIONS[_SUM_OP]

# Dtypes the backend cannot reduce natively are reduced in a wider type and cast back.
_UPCAST = {
    "cpu": {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64},
    "cuda": {
        torch.int16: torch.int32,
        torch.bool: torch.int32,
        torch.uint16: torch.int32,
        torch.uint32: torch.int64,
    },
}

Tracer = Callable[[Bucket, str, float, float], None]


def reduces_directly(dtype: torch.dtype, device_type: str) -> bool:
    """Whether an allreduce of one dense tensor runs on the tensor itself, with no buffer
    (its dtype is one the backend reduces; see :meth:`Executor.reduce_in_place`)."""
    upcast = _UPCAST.get(device_type)
    return upcast is not None and dtype not in upcast


@dataclass(frozen=True)
class Group:
    """A registered process set: its id, its members and this rank's place among them.
    Immutable: API threads read it from the engine's table of sets at any time."""

    process_set_id: int
    ranks: list[int]
    index: int  # this rank's position in ``ranks``; -1 if it is not a member

    @property
    def size(self) -> int:
        return len(self.ranks)


def dense(tensor: torch.Tensor) -> bool:
    """Contiguous with unit stride, so flat and byte views of it write through. (A size-1
    dimension may carry any stride, e.g. a gradient expanded from a scalar.)"""
    return tensor.is_contiguous() and (tensor.dim() == 0 or tensor.stride(-1) == 1)


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D unit-stride view of the tensor, or a copy where no such view exists."""
    flat_ = tensor.reshape(-1)
    if flat_.stride(0) == 1 or flat_.numel() == 0:
        return flat_
    return flat_.clone(memory_format=torch.contiguous_format)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the tensor; it writes through when the tensor is dense()."""
    flat_ = flat(tensor)
    return flat_ if flat_.dtype == torch.uint8 else flat_.view(torch.uint8)


def split_rows(rows: int, size: int) -> list[int]:
    """Horovod's reducescatter split: even, the first ``rows % size`` ranks get one more."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


#: A CPU allreduce at least this large runs as SPLIT_PARTS concurrent Gloo allreduces of
#: its parts: Gloo's two worker threads then keep the connection and the reduction busy at
#: once (a 64 MiB allreduce on 2 ranks takes 10 to 15% less time; 4 parts gain less).
SPLIT_BYTES = 8 * 1024 * 1024
SPLIT_PARTS = 2


class _Works:
    """Several collectives that finish together."""

    __slots__ = ("_works",)

    def __init__(self, works: list[Any]) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()


#: A CPU Sum of a tensor whose data from all the peers together is at most this many bytes
#: runs as an allgather and a sum on each rank (see :class:`Sums`)...
GATHER_BYTES = 512 * 1024
#: ... when it holds at least this many elements (Gloo's allreduce of one or two is one
#: exchange already, and faster than an allgather).
GATHER_MIN_ELEMENTS = 3
_GATHERED_DTYPES = frozenset(
    (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)
)


class _GatheredSum:
    """An allgather of every rank's tensor whose ``wait()`` sums the gathered rows into
    the tensor."""

    __slots__ = ("_out", "_rows", "_work")

    def __init__(self, work: Any, rows: torch.Tensor, out: torch.Tensor) -> None:
        self._work = work
        self._rows = rows
        self._out = out

    def wait(self) -> bool:
        self._work.wait()
        torch.sum(self._rows, 0, out=self._out)
        return True


class Sums:
    """Sum allreduces of contiguous CPU tensors. A small one runs as an allgather and a sum
    of the gathered rows on every rank: Gloo's ring allreduce takes 2 (N - 1) steps where
    its allgather takes N - 1, and on 2 ranks here an allreduce of 12 B to 1 MiB took two to
    four times as long as the allgather and the sum together (0.3-2 ms, bimodal, against
    0.3 ms for up to 40 KB). Every rank sums the same rows in rank order, so all get the
    same bits (on 2 ranks, the bits of the ring allreduce). The rows land in a scratch
    buffer kept from call to call: one collective at a time per instance."""

    def __init__(self) -> None:
        self._scratch: torch.Tensor | None = None  # flat uint8, grown on demand

    def start(self, pg: Any, size: int, tensor: torch.Tensor, timeout: float | None = None) -> Any:
        """Starts the Sum of ``tensor`` over the ``size`` ranks of ``pg``; returns the work
        to wait on."""
        numel = tensor.numel()
        if (
            numel >= GATHER_MIN_ELEMENTS
            and size > 1
            and (size - 1) * (nbytes := numel * tensor.element_size()) <= GATHER_BYTES
            and tensor.dtype in _GATHERED_DTYPES
            and tensor.is_cpu
            and tensor.is_contiguous()
        ):
            scratch = self._scratch
            if scratch is None or scratch.numel() < size * nbytes:
                scratch = self._scratch = torch.empty(size * nbytes, dtype=torch.uint8)
            rows = scratch[: size * nbytes].view(tensor.dtype)
            flat = tensor.view(-1)
            if timeout is None:
                work = pg._allgather_base(rows, flat)
            else:
                gather_opts = AllgatherOptions()
                gather_opts.timeout = datetime.timedelta(seconds=timeout)
                work = pg._allgather_base(rows, flat, gather_opts)
            return _GatheredSum(work, rows.view(size, numel), flat)
        if timeout is None:
            return pg.allreduce([tensor], _SUM_OPTIONS)  # (the call copies them)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _SUM
        opts.timeout = datetime.timedelta(seconds=timeout)
        return pg.allreduce([tensor], opts)


def _allreduce(
    pg: Any,
    size: int,
    tensor: torch.Tensor,
    opts: Any,
    source: torch.Tensor | None = None,
    fill: Reduction = PLAIN_SUM,
    sums: Sums | None = None,
) -> Any:
    """Starts the allreduce of a dense tensor on ``pg`` (``size`` ranks); split in parts on
    the CPU when large (see ``SPLIT_BYTES``), a small Sum through ``sums``. With ``source``
    (same shape), the tensor is first staged from it by ``fill``, part by part: the copy of a
    part overlaps the reduction of the previous one."""
    if (
        tensor.is_cpu
        and tensor.numel() * tensor.element_size() >= SPLIT_BYTES
        and tensor.is_contiguous()
    ):
        parts = tensor.view(-1).chunk(SPLIT_PARTS)
        if source is None:
            return _Works([pg.allreduce([part], opts) for part in parts])
        works = []
        for part, src in zip(parts, source.reshape(-1).chunk(SPLIT_PARTS), strict=True):
            fill.stage(part, src)
            works.append(pg.allreduce([part], opts))
        return _Works(works)
    if source is not None:
        fill.stage(tensor, source)
    if sums is not None:
        return sums.start(pg, size, tensor)
    return pg.allreduce([tensor], opts)


#: CPU outputs at least this large come from :class:`OutputPool`.
POOLED_BYTES = 4 * 1024 * 1024
#: At most this many bytes of outputs that their users dropped wait in the pool for reuse.
POOL_BYTES = 256 * 1024 * 1024


def _use_count(tensor: torch.Tensor) -> int:
    """How many tensors (and other owners) share the tensor's memory."""
    return int(torch._C._storage_Use_Count(tensor.untyped_storage()._cdata))


class OutputPool:
    """Memory for large out-of-place CPU results, reused once their users dropped them.

    Fresh memory from malloc costs a page fault per 4 KB on first touch, which for a
    64 MiB result took as long as the allreduce itself. The pool keeps the results it
    handed out; one whose memory nobody else references any more (the caller dropped the
    result, as ``x = hvd.allreduce(x)`` does every step) is handed out again, already
    mapped. New memory is mapped with transparent huge pages where the kernel offers them
    (``madvise``), so even a first touch costs few faults. At most ``POOL_BYTES`` of
    results are kept (the oldest go first; whoever still holds one keeps it).
    """

    def __init__(self) -> None:
        self._kept: list[torch.Tensor] = []  # flat uint8, oldest first

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < POOLED_BYTES:
            return torch.empty(tuple(shape), dtype=dtype)
        memory = None
        for index, kept in enumerate(self._kept):
            # 2: the pool's own tensor and the storage object asked about it.
            if kept.numel() == nbytes and _use_count(kept) <= 2:
                memory = self._kept.pop(index)
                break
        if memory is None:
            memory = _mapped(nbytes)
        self._kept.append(memory)
        total = sum(kept.numel() for kept in self._kept)
        while total > POOL_BYTES and len(self._kept) > 1:
            total -= self._kept.pop(0).numel()
        return memory.view(dtype).view(tuple(shape))

    def clear(self) -> None:
        self._kept.clear()


def _mapped(nbytes: int) -> torch.Tensor:
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP here: 4 KB pages then
        memory.madvise(mmap.MADV_HUGEPAGE)
    # The tensor keeps the mmap object alive: the memory is unmapped with its last view.
    return torch.frombuffer(memory, dtype=torch.uint8)


def _copy_in(slots: Sequence[Slot], buf: torch.Tensor) -> None:
    """Packs the slots' inputs into ``buf``, back to back, in one torch call."""
    torch.cat([_flat_in(slot) for slot in slots], out=buf)


def _copy_out(slots: Sequence[Slot], buf: torch.Tensor, counts: list[int]) -> None:
    """Copies consecutive regions of ``buf`` into the slots' outputs (one torch call).

    Out-of-place allreduces leave their outputs to this point (None until then): one
    ``split_with_sizes_copy`` allocates them all at once, far cheaper than one allocation
    per op at submission."""
    requests = [slot.request for slot in slots]
    if buf.dtype == slots[0].spec.dtype and all(
        request is not None and request.outputs[slot.index] is None
        for request, slot in zip(requests, slots, strict=True)
    ):
        # (torch's stubs only know the out= form, which returns nothing)
        pieces: list[torch.Tensor] = torch.split_with_sizes_copy(buf, counts)  # type: ignore[func-returns-value,assignment]
        for request, slot, piece in zip(requests, slots, pieces, strict=True):
            shape = slot.spec.shape
            request.outputs[slot.index] = piece if len(shape) == 1 else piece.view(shape)  # type: ignore[union-attr]
        return
    targets = [_output(slot) for slot in slots]
    if buf.dtype == slots[0].spec.dtype and all(out.dim() == 1 for out in targets):
        torch.split_with_sizes_copy(buf, counts, out=targets)
    else:  # shaped outputs, or a buffer in a wider dtype (int16 reduces as int32)
        views = [v.view(t.shape) for v, t in zip(buf.split(counts), targets, strict=True)]
        torch._foreach_copy_(targets, views)


class Executor:
    """Runs one process set's buckets on its data process group; keeps the set's fusion
    buffers and CUDA streams. Used only by whoever holds the set's cycle lock."""

    def __init__(self, tracer: Tracer, group: Group, pg: Any) -> None:
        self._group = group
        self._pg = pg  # the torch ProcessGroup carrying the set's data (None once released)
        self._buffers: dict[torch.device, torch.Tensor] = {}
        self._streams = streams.EngineStreams()
        self._trace = tracer
        self.outputs = OutputPool()
        self._sums = Sums()
        # CUDA tensors go to NCCL, or to Gloo where the job runs them through host memory
        # (hvdrun --cuda-backend gloo).
        self._cuda_nccl = "nccl" in _backend_name(pg)
        self._cuda_phase = "NCCL_" if self._cuda_nccl else "GLOO_"

    @property
    def process_group(self) -> Any:
        """The set's data process group (None once released)."""
        return self._pg

    def buffer(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A view of ``numel`` elements of the device's fusion buffer."""
        nbytes = numel * dtype.itemsize
        current = self._buffers.get(device)
        if current is None or current.numel() < nbytes:
            size = max(nbytes, int(current.numel() * 1.5) if current is not None else 0)
            if current is not None and device.type == "cuda":
                # Used on the stream of each bucket (streams.py): a buffer replaced by a
                # larger one is freed once the latest bucket's kernels ended.
                self._streams.retire(device, current)
            current = torch.empty(size, dtype=torch.uint8, device=device)
            self._buffers[device] = current
        return current[:nbytes].view(dtype)

    def let_go(self) -> None:
        """Drops what buckets whose kernels ended held on the GPU (``EngineStreams.keep``)."""
        self._streams.let_go()

    def release(self) -> Any:
        """Drops the buffers and the process group; returns the group (to destroy)."""
        for device, buffer in self._buffers.items():
            if device.type == "cuda":
                self._streams.retire(device, buffer)
        self._streams.release()
        self._buffers.clear()
        self.outputs.clear()
        pg, self._pg = self._pg, None
        return pg

    def _device(self, bucket: Bucket) -> torch.device:
        for slot in bucket.slots:
            if slot.request is not None:
                return slot.request.inputs[slot.index].device
        if bucket.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(bucket.device_type)

    def run(self, bucket: Bucket) -> Any:
        """Runs one bucket; returns the CUDA event after its last kernel (None on CPU)."""
        device = self._device(bucket)
        runner = {
            Kind.ALLREDUCE: self._allreduce,
            Kind.REDUCESCATTER: self._reducescatter,
            Kind.ALLGATHER: self._allgather,
            Kind.BROADCAST: self._broadcast,
            Kind.ALLTOALL: self._alltoall,
        }[bucket.kind]
        for slot in bucket.slots:
            check_unchanged(slot.request, slot.index)
        # (Grad mode is off: buckets run inside the engine's cycles, see _guarded_cycle.)
        if device.type != "cuda":
            runner(bucket, self._group, device)
            return None
        with self._streams.running(bucket.requests(), device) as done:
            runner(bucket, self._group, device)
        return done[0]

    def _collective(self, bucket: Bucket, device: torch.device, call: Callable[[], Any]) -> None:
        start = time.monotonic()
        call().wait()
        phase = (self._cuda_phase if device.type == "cuda" else "GLOO_") + bucket.kind.label.upper()
        self._trace(bucket, phase, start, time.monotonic())

    # ---- reductions ------------------------------------------------------------------

    def _allreduce(self, bucket: Bucket, group: Group, device: torch.device) -> None:
        slots = bucket.slots
        reduction = slots[0].work.reduction
        op = reduction.op
        dtype = slots[0].spec.dtype
        work_dtype = _UPCAST[device.type].get(dtype, dtype)
        opts = _OPTIONS[op]
        pg, size = self._pg, group.size
        counts = [slot.spec.numel for slot in slots]
        sums = self._sums if device.type == "cpu" and opts.reduceOp == _SUM else None
        request = slots[0].request
        if len(slots) == 1 and request is not None and work_dtype == dtype:
            index = slots[0].index
            inp = request.inputs[index]
            out = request.outputs[index]
            if out is None:  # out of place, left to the engine
                out = request.outputs[index] = self.outputs.empty(inp.shape, inp.dtype)
            if dense(out):
                copy = out.data_ptr() != inp.data_ptr() or out.shape != inp.shape
                self._reduce_one(out, inp if copy else None, reduction, opts, bucket)
                return
        total = sum(counts)
        if total == 0:  # empty tensors only: nothing to reduce, but results to hand out
            for slot in slots:
                if slot.request is not None:
                    _output(slot)
            return
        buf = self.buffer(device, work_dtype, total)
        start = time.monotonic()
        real = [slot for slot in slots if slot.request is not None]
        if len(real) == len(slots) and work_dtype == dtype:
            _copy_in(slots, buf)
            views = None
        else:
            views = buf.split(counts)
            for view, slot in zip(views, slots, strict=True):
                if slot.request is not None:
                    view.copy_(_flat_in(slot))
        self._trace(bucket, "MEMCPY_IN_FUSION_BUFFER", start, time.monotonic())
        reduction.stage(buf)
        if views is not None and len(real) < len(slots):
            neutral = neutral_value(op, dtype)
            for view, slot in zip(views, slots, strict=True):
                if slot.request is None:
                    view.fill_(neutral)
        self._collective(bucket, device, lambda: _allreduce(pg, size, buf, opts, sums=sums))
        reduction.finish(buf, size)
        start = time.monotonic()
        if len(real) == len(slots):
            _copy_out(slots, buf, counts)
        else:
            assert views is not None
            for view, slot in zip(views, slots, strict=True):
                if slot.request is not None:
                    out = _output(slot)
                    out.copy_(view.view(out.shape))
        self._trace(bucket, "MEMCPY_OUT_FUSION_BUFFER", start, time.monotonic())

    def reduce_in_place(self, tensor: torch.Tensor, reduction: Reduction) -> None:
        """The hot lane's allreduce of one dense tensor that does not ride the cache's rounds
        (see :mod:`.lanes`), on the calling thread (a CUDA tensor: on its current stream):
        the collectives of that op's bucket of one, which other members may run in a cycle."""
        self._reduce_one(tensor, None, reduction, _OPTIONS[reduction.op], None)

    def _reduce_one(
        self,
        out: torch.Tensor,
        source: torch.Tensor | None,
        reduction: Reduction,
        opts: Any,
        bucket: Bucket | None,
    ) -> None:
        """The allreduce of one dense tensor into ``out`` (from ``source``; None: in place),
        with no fusion buffer; ``bucket`` for the timeline (None: a lane's, untraced)."""
        if out.numel() == 0:
            return
        if reduction.prescale != 1.0:  # scaled on the way in: one pass over the data
            reduction.stage(out, source)
            source = None
        pg, size = self._pg, self._group.size
        sums = self._sums if out.is_cpu and opts.reduceOp == _SUM else None
        fill = PLAIN_SUM
        if (
            source is not None
            and reduction.op == _AVERAGE
            and reduction.postscale == 1.0
            and out.is_floating_point()
            and out.dtype is not torch.float16
            and size & (size - 1) == 0
        ):
            # Dividing by a power of two is exact (but for subnormals): divide on the way
            # in; the sum is then the average, with no pass of its own. Not for float16,
            # whose gradients are often subnormal (below 6.1e-5): those would flush to zero,
            # where the sum divided afterwards, as Horovod does, keeps them.
            fill, reduction = Reduction(_SUM_OP, 1.0 / size), PLAIN_SUM
        if bucket is None:
            _allreduce(pg, size, out, opts, source, fill, sums).wait()
        else:
            self._collective(
                bucket, out.device, lambda: _allreduce(pg, size, out, opts, source, fill, sums)
            )
        reduction.finish(out, size)

    def _reducescatter(self, bucket: Bucket, group: Group, device: torch.device) -> None:
        slots, size, me = bucket.slots, group.size, group.index
        reduction = slots[0].work.reduction
        op = reduction.op
        dtype = slots[0].spec.dtype
        work_dtype = _UPCAST[device.type].get(dtype, dtype)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _TORCH_OPS[op]
        rows = [split_rows(slot.spec.shape[0], size) for slot in slots]
        row_numel = [math.prod(slot.spec.shape[1:]) for slot in slots]
        chunk_counts = [
            sum(r[rank_] * n for r, n in zip(rows, row_numel, strict=True)) for rank_ in range(size)
        ]
        total = sum(chunk_counts)
        if total == 0:
            return
        # NCCL wants equal chunks, and Gloo's reduce-scatter of CUDA tensors differs between
        # torch versions: those reduce the whole buffer (an allreduce, which both have for
        # CUDA tensors) and keep this rank's part.
        reduce_whole = device.type == "cuda" and (not self._cuda_nccl or len(set(chunk_counts)) > 1)
        request = slots[0].request
        if (
            len(slots) == 1
            and request is not None
            and work_dtype == dtype
            and reduction.prescale == 1.0
            and not reduce_whole
            and dense(_input(slots[0]))
            and dense(_output(slots[0]))
        ):
            chunks = list(_input(slots[0]).reshape(-1).split(chunk_counts))
            out = _output(slots[0]).view(-1)
            self._collective(bucket, device, lambda: self._pg.reduce_scatter([out], [chunks], opts))
            reduction.finish(out, size)
            return
        buf = self.buffer(device, work_dtype, total + chunk_counts[me])
        chunks = list(buf[:total].split(chunk_counts))
        mine = buf[total:]
        start = time.monotonic()
        for rank_, chunk in enumerate(chunks):
            offset = 0
            for slot, slot_rows, numel in zip(slots, rows, row_numel, strict=True):
                count = slot_rows[rank_] * numel
                part = chunk[offset : offset + count]
                offset += count
                if slot.request is None:
                    continue
                first = sum(slot_rows[:rank_])
                part.copy_(_input(slot).narrow(0, first, slot_rows[rank_]).reshape(-1))
        self._trace(bucket, "MEMCPY_IN_FUSION_BUFFER", start, time.monotonic())
        reduction.stage(buf[:total])
        if any(slot.request is None for slot in slots):
            fill = neutral_value(op, dtype)
            for rank_, chunk in enumerate(chunks):
                offset = 0
                for slot, slot_rows, numel in zip(slots, rows, row_numel, strict=True):
                    count = slot_rows[rank_] * numel
                    if slot.request is None:
                        chunk[offset : offset + count].fill_(fill)
                    offset += count
        if reduce_whole:
            whole = buf[:total]
            self._collective(bucket, device, lambda: self._pg.allreduce([whole], _OPTIONS[op]))
            mine.copy_(chunks[me])
        else:
            self._collective(
                bucket, device, lambda: self._pg.reduce_scatter([mine], [chunks], opts)
            )
        reduction.finish(mine, size)
        start = time.monotonic()
        offset = 0
        for slot, slot_rows, numel in zip(slots, rows, row_numel, strict=True):
            count = slot_rows[me] * numel
            if slot.request is not None:
                out = _output(slot)
                out.copy_(mine[offset : offset + count].view(out.shape))
            offset += count
        self._trace(bucket, "MEMCPY_OUT_FUSION_BUFFER", start, time.monotonic())

    # ---- data movement ---------------------------------------------------------------

    def _allgather(self, bucket: Bucket, group: Group, device: torch.device) -> None:
        slots, size, me = bucket.slots, group.size, group.index
        dims = [[slot.work.dims(rank_)[slot.index] for slot in slots] for rank_ in group.ranks]
        row_bytes = [_row_bytes(slot.spec) for slot in slots]
        contrib = [sum(d * b for d, b in zip(row, row_bytes, strict=True)) for row in dims]
        outputs: list[torch.Tensor | None] = []
        for column, slot in enumerate(slots):
            request = slot.request
            if request is None:
                outputs.append(None)
                continue
            rows = sum(dims[rank_][column] for rank_ in range(size))
            out = engine_output(request, (rows, *slot.spec.shape[1:]), slot.spec.dtype, device)
            request.outputs[slot.index] = out
            if request.rank_dims is None:
                request.rank_dims = [[] for _ in request.inputs]
            request.rank_dims[slot.index] = [dims[rank_][column] for rank_ in range(size)]
            outputs.append(out)
        longest = max(contrib)
        if longest == 0:
            return
        single = outputs[0]
        if len(slots) == 1 and single is not None and len(set(contrib)) == 1:
            assert single is not None
            source = _bytes(_input(slots[0]))
            target = _bytes(single)
            self._collective(bucket, device, lambda: self._pg._allgather_base(target, source))
            return
        buf = self.buffer(device, torch.uint8, (size + 1) * longest)
        received, send = buf[: size * longest], buf[size * longest :]
        start = time.monotonic()
        mine = [_bytes(_input(s)) for s in slots if s.request is not None]
        if mine:
            torch.cat(mine, out=send[: contrib[me]])
        self._trace(bucket, "MEMCPY_IN_FUSION_BUFFER", start, time.monotonic())
        self._collective(bucket, device, lambda: self._pg._allgather_base(received, send))
        start = time.monotonic()
        offsets = [rank_ * longest for rank_ in range(size)]
        for column, target_out in enumerate(outputs):
            pieces = []
            for rank_ in range(size):
                count = dims[rank_][column] * row_bytes[column]
                pieces.append(received[offsets[rank_] : offsets[rank_] + count])
                offsets[rank_] += count
            if target_out is not None:
                torch.cat(pieces, out=_bytes(target_out))
        self._trace(bucket, "MEMCPY_OUT_FUSION_BUFFER", start, time.monotonic())

    def _broadcast(self, bucket: Bucket, group: Group, device: torch.device) -> None:
        slots = bucket.slots
        root = slots[0].work.root
        is_root = group.index == root
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        counts = [math.prod(s.spec.shape) * s.spec.dtype.itemsize for s in slots]
        total = sum(counts)
        real = [slot for slot in slots if slot.request is not None]
        if is_root:
            for slot in real:
                if _output(slot).data_ptr() != _input(slot).data_ptr():
                    _output(slot).copy_(_input(slot))
        if total == 0:
            return
        if len(slots) == 1 and real and dense(_output(slots[0])):
            target = _bytes(_output(slots[0]))
            self._collective(bucket, device, lambda: self._pg.broadcast([target], opts))
            return
        buf = self.buffer(device, torch.uint8, total)
        views = buf.split(counts)
        start = time.monotonic()
        if is_root:
            torch.cat([_bytes(_output(slot)) for slot in slots], out=buf)
        self._trace(bucket, "MEMCPY_IN_FUSION_BUFFER", start, time.monotonic())
        self._collective(bucket, device, lambda: self._pg.broadcast([buf], opts))
        start = time.monotonic()
        if not is_root:
            pairs = [(_output(s), v) for s, v in zip(slots, views, strict=True) if s.request]
            for out, view in pairs:
                if dense(out):
                    _bytes(out).copy_(view)
                else:
                    out.copy_(view.view(out.dtype).view(out.shape))
        self._trace(bucket, "MEMCPY_OUT_FUSION_BUFFER", start, time.monotonic())

    def _alltoall(self, bucket: Bucket, group: Group, device: torch.device) -> None:
        slot = bucket.slots[0]
        work, size, me = slot.work, group.size, group.index
        sends: list[list[int]] = []
        for rank_ in group.ranks:
            var = work.vars.get(rank_)
            if var is None:
                sends.append([0] * size)
                continue
            (dim0,), splits = parse_ragged(Kind.ALLTOALL, var)
            sends.append(splits if splits is not None else [dim0 // size] * size)
        received = [sends[rank_][me] for rank_ in range(size)]
        row_bytes = _row_bytes(slot.spec)
        request = slot.request
        shape = (sum(received), *slot.spec.shape[1:])
        out = engine_output(request, shape, slot.spec.dtype, device)
        if request is not None:
            request.outputs[0] = out
            request.extra = received
        if row_bytes == 0 or not any(any(row) for row in sends):
            return
        if request is not None:
            source = _bytes(_input(slot))
        else:
            source = torch.empty(0, dtype=torch.uint8, device=device)
        target = _bytes(out)
        out_sizes = [count * row_bytes for count in received]
        in_sizes = [count * row_bytes for count in sends[me]]
        self._collective(
            bucket,
            device,
            lambda: self._pg.alltoall_base(
                target, source, out_sizes, in_sizes, dist.AllToAllOptions()
            ),
        )


def _backend_name(pg: Any) -> str:
    """The data group's backend ("gloo", "cpu:gloo,cuda:nccl", ...); "" when unknown."""
    if not isinstance(pg, dist.ProcessGroup):
        return ""
    try:
        return str(dist.get_backend(pg))
    except (RuntimeError, ValueError):  # destroyed already, or not a group torch knows
        return ""


def _row_bytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape[1:]) * spec.dtype.itemsize


def check_unchanged(request: Request | None, index: int) -> None:
    """Raises when an op's input tensor changed size since it was submitted (resized while
    in flight): a collective of another size than the peers' would make Gloo abort the
    process; this rank fails instead, with the op named."""
    if request is None:
        return
    tensor = request.inputs[index]
    spec = request.specs[index]
    if tensor.nbytes != spec.nbytes:
        raise RuntimeError(
            f"{request.label}: its tensor was resized while the op was in flight (now "
            f"{list(tensor.shape)}, submitted as {list(spec.shape)}); a tensor must keep its "
            "size until its op completes"
        )


def _input(slot: Slot) -> torch.Tensor:
    request = slot.request
    assert request is not None
    return request.inputs[slot.index]


def _output(slot: Slot) -> torch.Tensor:
    request: Request | None = slot.request
    assert request is not None
    out: torch.Tensor | None = request.outputs[slot.index]
    return out if out is not None else _new_output(slot)


def engine_output(
    request: Request | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An output whose size only the negotiation told (allgather, alltoall), allocated on the
    stream that writes it (the bucket's: the engine's, which waited for the op's position on
    its submitting stream, no later). Where the op was submitted from another stream, which
    uses and frees the output, that stream's use is recorded too: the caching allocator then
    reuses its memory only after the work queued there by the time it is freed. (Allocated
    on the submitting stream instead, it could get memory that stream's later kernels still
    use.)"""
    out = torch.empty(shape, dtype=dtype, device=device)
    home = None if request is None else request.home
    if home is not None and home is not streams.current(home.device_index):
        out.record_stream(home)
    return out


def _new_output(slot: Slot) -> torch.Tensor:
    """Allocates the output of an out-of-place allreduce that was left to the engine."""
    request = slot.request
    assert request is not None
    inp = request.inputs[slot.index]
    out = torch.empty(inp.shape, dtype=inp.dtype, device=inp.device)
    request.outputs[slot.index] = out
    return out


def _flat_in(slot: Slot) -> torch.Tensor:
    """The input as a 1-D tensor (cat reads any strides; a 1-D input needs no view)."""
    tensor = _input(slot)
    return tensor if tensor.dim() == 1 else tensor.reshape(-1)
