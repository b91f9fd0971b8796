"""The op execution layer: runs collectives on torch.distributed, synchronously.

Every collective of the public API (``mpi_ops``, ``functions``, the optimizer) goes through
the few functions here, which take *lists* of tensors so callers already hand over work that
can be fused. This first version executes at once on the calling thread: tensors are grouped
by device and dtype, flattened into one buffer per group, and reduced with one
``all_reduce`` per buffer, because one small Gloo collective costs about as much as a large
one. The background negotiation engine (named ops, readiness negotiation, fusion across
calls, async handles) will replace this module behind the same functions. Until then,
collectives run in the order they are called, so every rank must call them in the same
order (from one thread); a broadcast or allgather whose tensors differ between ranks is
detected and raises ValueError on every rank.

Semantics follow Horovod:

* ``Average`` is a sum followed by a division by the number of ranks. On integer tensors the
  result keeps the integer dtype and is rounded toward zero (Horovod scales integer buffers
  in double precision and truncates; here the division is exact, so e.g. 49*k/49 is k).
* ``prescale_factor``/``postscale_factor`` multiply before/after the reduction; integer
  tensors are scaled in float64 and truncated toward zero, as Horovod does.
* Failures of the communication layer (a peer died, a timeout) become
  :class:`~collectives.torch.errors.HorovodInternalError`; argument errors are raised before
  anything is sent, identically on every rank, so they never leave a peer waiting.
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from collectives.torch import runtime
from collectives.torch.common import ProcessSet, ReduceOp, global_process_set
from collectives.torch.errors import HorovodInternalError

__all__ = ["allgather", "allreduce_", "barrier", "broadcast_"]

logger = logging.getLogger(__name__)

_TORCH_OPS = {
    ReduceOp.AVERAGE: dist.ReduceOp.SUM,
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
}

# Dtypes the backends cannot reduce natively, reduced in a wider type and cast back.
_REDUCE_UPCAST = {torch.int16: torch.int32}

_REDUCIBLE = {
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
}

# Header of an allgather: ndim, dtype code, then the shape padded to this many dims.
_MAX_DIMS = 64


def _dtype_code(dtype: torch.dtype) -> int:
    """A number naming the dtype, the same in every process."""
    return zlib.crc32(str(dtype).encode())


def _dtype_name(code: int) -> str:
    for dtype in (*_REDUCIBLE, torch.uint16, torch.uint32, torch.uint64):
        if _dtype_code(dtype) == code:
            return str(dtype)
    return "another dtype"


def _check_process_set(process_set: ProcessSet | None) -> None:
    if process_set is not None and not process_set.is_global():
        raise NotImplementedError(
            "only the global process set is supported in this version of hvdrun"
        )


def _describe(op: str, name: str | None) -> str:
    return f"{op} {name!r}" if name else op


@contextlib.contextmanager
def _communication(op: str, name: str | None) -> Iterator[None]:
    """Turns a failure inside torch.distributed into a HorovodInternalError."""
    try:
        yield
    except HorovodInternalError:
        raise
    except RuntimeError as error:  # DistBackendError and friends are RuntimeErrors
        raise HorovodInternalError(
            f"{_describe(op, name)} failed on rank {runtime.rank()}: {error}"
        ) from error


def _scale_(tensor: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    elif tensor.dtype == torch.bool:
        raise TypeError("bool tensors cannot be scaled (prescale/postscale/Average)")
    else:
        tensor.copy_(torch.trunc(tensor.to(torch.float64) * factor))


def _group(tensors: Sequence[torch.Tensor], by_dtype: bool) -> list[list[torch.Tensor]]:
    """Groups tensors by device (and dtype), keeping the order of first appearance."""
    groups: dict[tuple[torch.device, torch.dtype | None], list[torch.Tensor]] = {}
    for tensor in tensors:
        key = (tensor.device, tensor.dtype if by_dtype else None)
        groups.setdefault(key, []).append(tensor)
    return list(groups.values())


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (writes through to it)."""
    flat = tensor.reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    return flat.view(torch.uint8)


def _agree(label: str, signature: list[int], describe: str) -> None:
    """Checks that every rank submitted the same collective; raises ValueError on all of them.

    ``signature`` is a short list of integers summarising the call (root, tensor count, bytes,
    a checksum of the dtypes and shapes); ``describe`` words this rank's part of it.
    """
    rt = runtime.require()
    mine = torch.tensor(signature, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(rt.topology.size)]
    with _communication("consistency check of " + label, None):
        dist.all_gather(everyone, mine)
    differing = [peer for peer, theirs in enumerate(everyone) if not torch.equal(theirs, mine)]
    if differing:
        details = ", ".join(f"rank {peer}: {everyone[peer].tolist()}" for peer in differing[:4])
        raise ValueError(
            f"{label}: ranks submitted different collectives; rank {rt.topology.rank} has "
            f"{describe} (signature {signature}), but {details}"
        )


def allreduce_(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp = ReduceOp.AVERAGE,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = global_process_set,
    name: str | None = None,
) -> None:
    """Reduces every tensor in place across the ranks, one collective per device and dtype."""
    rt = runtime.require("allreduce")
    _check_process_set(process_set)
    op = ReduceOp(op)
    if op == ReduceOp.ADASUM:
        raise NotImplementedError(
            "op=hvd.Adasum is not implemented by hvdrun yet; use hvd.Average or hvd.Sum"
        )
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"allreduce expects tensors, got {type(tensor).__name__}")
        if tensor.dtype not in _REDUCIBLE:
            raise TypeError(f"allreduce does not support tensors of dtype {tensor.dtype}")
        if tensor.is_sparse:
            raise TypeError("allreduce of sparse tensors is not supported; use a dense tensor")
        if tensor.is_complex() and op in (ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT):
            raise TypeError(f"{op.name} is not defined for complex tensors")
        if tensor.dtype == torch.bool and (
            op == ReduceOp.AVERAGE or prescale_factor != 1.0 or postscale_factor != 1.0
        ):
            raise TypeError("bool tensors support only Sum, Min, Max and Product, unscaled")
    world = rt.topology.size
    torch_op = _TORCH_OPS[op]
    with torch.no_grad():
        for group in _group([t.detach() for t in tensors], by_dtype=True):
            dtype = group[0].dtype
            work_dtype = _REDUCE_UPCAST.get(dtype, dtype)
            direct = len(group) == 1 and group[0].is_contiguous() and work_dtype == dtype
            if direct:
                buffer = group[0]
            else:
                buffer = torch.cat([t.reshape(-1).to(work_dtype) for t in group])
            if buffer.numel() == 0:
                continue
            _scale_(buffer, prescale_factor)
            with _communication("allreduce", name):
                dist.all_reduce(buffer, op=torch_op)
            if op == ReduceOp.AVERAGE:
                if buffer.is_floating_point() or buffer.is_complex():
                    _scale_(buffer, postscale_factor / world)
                elif postscale_factor == 1.0:
                    buffer.copy_(torch.div(buffer, world, rounding_mode="trunc"))
                else:
                    _scale_(buffer, postscale_factor / world)
            else:
                _scale_(buffer, postscale_factor)
            if not direct:
                offset = 0
                for tensor in group:
                    count = tensor.numel()
                    tensor.copy_(buffer[offset : offset + count].view(tensor.shape))
                    offset += count


def broadcast_(
    tensors: Sequence[torch.Tensor],
    root_rank: int,
    process_set: ProcessSet | None = global_process_set,
    name: str | None = None,
) -> None:
    """Overwrites every tensor with root_rank's values, one collective per device."""
    rt = runtime.require("broadcast")
    _check_process_set(process_set)
    world = rt.topology.size
    if not 0 <= root_rank < world:
        raise ValueError(f"root_rank {root_rank} is out of range for a job of size {world}")
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"broadcast expects tensors, got {type(tensor).__name__}")
        if tensor.is_sparse:
            raise TypeError("broadcast of sparse tensors is not supported")
    own = rt.topology.rank == root_rank
    # A broadcast whose sizes differ between ranks does not fail in Gloo: the receivers get
    # part of the data. It is rare and usually large (parameters, state), so it is checked.
    total_bytes = sum(t.numel() * t.element_size() for t in tensors)
    layout = ";".join(f"{t.dtype}:{tuple(t.shape)}" for t in tensors)
    _agree(
        _describe("broadcast", name),
        [root_rank, len(tensors), total_bytes, zlib.crc32(layout.encode())],
        f"root_rank {root_rank} and {len(tensors)} tensor(s) of {total_bytes} bytes",
    )
    with torch.no_grad():
        for group in _group([t.detach() for t in tensors], by_dtype=False):
            if len(group) == 1 and group[0].is_contiguous():
                buffer = _as_bytes(group[0])
                direct = True
            else:
                direct = False
                if own:
                    buffer = torch.cat([_as_bytes(t.contiguous()) for t in group])
                else:
                    total = sum(t.numel() * t.element_size() for t in group)
                    buffer = torch.empty(total, dtype=torch.uint8, device=group[0].device)
            if buffer.numel() == 0:
                continue
            with _communication("broadcast", name):
                dist.broadcast(buffer, src=root_rank)
            if not direct and not own:
                offset = 0
                for tensor in group:
                    count = tensor.numel() * tensor.element_size()
                    chunk = buffer[offset : offset + count].view(tensor.dtype)
                    tensor.copy_(chunk.view(tensor.shape))
                    offset += count


def allgather(
    tensor: torch.Tensor,
    process_set: ProcessSet | None = global_process_set,
    name: str | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Concatenates every rank's tensor along dim 0 (sizes may differ there).

    Returns the result and the dim-0 size of each rank's contribution.
    """
    rt = runtime.require("allgather")
    _check_process_set(process_set)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"allgather expects a tensor, got {type(tensor).__name__}")
    if tensor.is_sparse:
        raise TypeError("allgather of sparse tensors is not supported")
    if tensor.dim() == 0:
        raise ValueError("allgather needs a tensor with at least one dimension")
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"allgather supports at most {_MAX_DIMS} dimensions")
    world = rt.topology.size
    label = _describe("allgather", name)
    with torch.no_grad():
        local = tensor.detach().contiguous()
        # One small collective exchanges every rank's dtype and shape, so a mismatch becomes
        # the same clear error on every rank instead of a garbled result or a hang.
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
        header[0] = local.dim()
        header[1] = _dtype_code(local.dtype)
        header[2 : 2 + local.dim()] = torch.tensor(local.shape, dtype=torch.int64)
        headers = [torch.empty_like(header) for _ in range(world)]
        with _communication("allgather", name):
            dist.all_gather(headers, header)
        mine = header.tolist()
        for peer, peer_header in enumerate(headers):
            theirs = peer_header.tolist()
            if theirs[0] != mine[0] or theirs[1] != mine[1]:
                raise ValueError(
                    f"{label}: ranks disagree on the tensor's dtype or number of dimensions "
                    f"(rank {rt.topology.rank}: {local.dtype} with {mine[0]} dims; rank {peer}: "
                    f"{_dtype_name(theirs[1])} with {theirs[0]} dims)"
                )
            if theirs[3 : 2 + mine[0]] != mine[3 : 2 + mine[0]]:
                raise ValueError(
                    f"{label}: all dimensions but the first must match across ranks "
                    f"(rank {rt.topology.rank} has shape {list(local.shape)}, rank {peer} "
                    f"has {theirs[2 : 2 + mine[0]]})"
                )
        firsts = [int(h[2]) for h in headers]
        longest = max(firsts)
        row_shape = list(local.shape[1:])
        row_bytes = local.element_size()
        for dim in row_shape:
            row_bytes *= dim
        padded = torch.zeros(longest * row_bytes, dtype=torch.uint8, device=local.device)
        if local.numel() > 0:
            padded[: local.numel() * local.element_size()] = _as_bytes(local)
        gathered = [torch.empty_like(padded) for _ in range(world)]
        if padded.numel() > 0:
            with _communication("allgather", name):
                dist.all_gather(gathered, padded)
        pieces = [buf[: n * row_bytes] for buf, n in zip(gathered, firsts, strict=True)]
        flat = torch.cat(pieces) if pieces else padded[:0]
        total = sum(firsts)
        if flat.numel() == 0:
            result = torch.empty([total, *row_shape], dtype=local.dtype, device=local.device)
        else:
            result = flat.view(local.dtype).view([total, *row_shape])
    return result, firsts


def barrier(process_set: ProcessSet | None = global_process_set) -> None:
    """Returns once every rank has reached the barrier."""
    runtime.require("barrier")
    _check_process_set(process_set)
    token = torch.zeros(1)
    with _communication("barrier", None):
        dist.all_reduce(token)
