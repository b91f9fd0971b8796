"""The submission layer: every collective goes through it on its way to the engine.

It checks the caller's arguments (so mistakes raise at the call, on the rank that made them),
builds the :class:`~collectives.engine.requests.Request` with its negotiated signature,
and submits it to the running engine (found through the runtime). An allreduce with
``op=hvd.Adasum`` is submitted here too, as an allgather whose result is combined with the
math of :mod:`collectives.adasum`. The list-based synchronous helpers at the bottom
serve ``functions`` and the optimizers, which hand over many tensors at once as one grouped
op.

Layering: this module is the framework-neutral way to the engine. It sits between the
frontends (``collectives.torch``'s ``mpi_ops``, ``autograd``, ``functions``, the optimizers)
and ``collectives.process_sets``, which all submit through it, and the runtime and the
engine below; it imports nothing above itself. Tensors here are torch tensors, the engine's
buffer type: a frontend of another framework converts its tensors first.

Semantics follow Horovod:

* ``Average`` is a sum divided by the process set's size. Integer tensors keep their dtype and
  are rounded toward zero.
* ``prescale_factor``/``postscale_factor`` multiply before/after the reduction; integer
  tensors are scaled in float64 and truncated toward zero.
* A broadcast's ``root_rank`` is a global rank, also within a process set; a root that is
  not a member of the set is a ``ValueError`` at the call.
* Unnamed ops get the names ``allreduce.noname.0``, ``allreduce.noname.1``, ... counted per
  process set and kind, so ranks calling the same ops in the same order agree on them. The
  counter is drawn only once every check here passed: an op refused at the call draws none
  (see :mod:`collectives.engine.names`).
"""

from __future__ import annotations

import operator
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import increment_version

from collectives import runtime
from collectives.adasum import (
    adasum_tree,
    combine_range,
    halving_ranges,
    partial_dots,
    work_dtype,
)
from collectives.common import ProcessSet, ReduceOp, global_process_set
from collectives.engine import streams
from collectives.engine.execute import Group, split_rows
from collectives.engine.handles import Handle
from collectives.engine.reduction import PLAIN_SUM, Reduction
from collectives.engine.requests import (
    ALLREDUCE,
    BROADCAST,
    FIELD,
    RECORD,
    Computing,
    Kind,
    Request,
    TensorSpec,
    noname,
    signature,
)
from collectives.errors import InvalidSplitsError, SharedGpuError

__all__ = [
    "allgather",
    "allreduce_",
    "barrier",
    "broadcast_",
    "resolve_process_set",
    "root_index",
    "submit",
]

REDUCIBLE = {
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
}


def resolve_process_set(process_set: ProcessSet | None, what: str) -> tuple[Any, Group]:
    """The engine and the registered process set; this rank must be a member."""
    engine = runtime.engine(what)
    if process_set is None or process_set is global_process_set:
        return engine, engine.groups[0]
    if not isinstance(process_set, ProcessSet):
        raise TypeError(
            f"{what}: process_set must be a hvd.ProcessSet, got {type(process_set).__name__}"
        )
    set_id = process_set.process_set_id
    group = engine.groups.get(set_id) if set_id is not None else None
    if group is None or (not process_set.is_global() and group.ranks != process_set.ranks):
        raise ValueError(
            f"{what}: {process_set!r} is not registered; register it on every rank with "
            "hvd.add_process_set() (or hvd.init(process_sets=[...])) first"
        )
    if group.index < 0:
        raise ValueError(
            f"{what}: rank {engine.rank} is not a member of {process_set!r}; only its members "
            "may run collectives on it"
        )
    return engine, group


def check_tensor(tensor: Any, what: str, min_dims: int = 0) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} expects tensors, got {type(tensor).__name__}")
    if tensor.layout is not torch.strided:
        raise TypeError(
            f"{what} of sparse tensors is not supported; use a dense tensor (in torch, "
            "hvd.sparse_allreduce_async reduces a sparse one)"
        )
    if min_dims and tensor.dim() < min_dims:
        raise ValueError(f"{what} needs a tensor with at least one dimension")
    # Not detached (that costs a torch call per op): the engine runs under no_grad.
    return tensor


def unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor, or, where it is contiguous but its last stride is not 1, the same memory
    viewed with contiguous strides. A dimension of size 1 may carry any stride (``x[:, 1]``
    of a one-row ``x`` has shape ``(1,)`` and stride ``(3,)``): torch calls such a tensor
    contiguous, but the engine's flat byte views of it (a small allreduce riding the
    negotiation) need a unit last stride, and failed there. Its elements are where the
    restrided view has them, so reading and writing through it is reading and writing the
    tensor. (Only a last dimension of size 0 or 1, or an empty tensor, leaves torch free to
    call other strides contiguous: the shape rules out the rest before ``stride()``, a far
    dearer call.)"""
    shape = tensor.shape
    if (
        shape
        and (shape[-1] < 2 or 0 in shape)
        and tensor.stride(-1) != 1
        and tensor.is_contiguous()
    ):
        strides = [1] * tensor.dim()
        for axis in range(tensor.dim() - 2, -1, -1):
            strides[axis] = strides[axis + 1] * tensor.shape[axis + 1]
        return tensor.as_strided(tensor.shape, strides)
    return tensor


def written_in_place(outputs: Sequence[torch.Tensor], what: str) -> None:
    """Checks the tensors an op will write in place and marks them modified, as torch's own
    in-place ops (``dist.broadcast`` among them) do at the call.

    A tensor made under ``torch.inference_mode()`` (a metric computed in a validation step)
    may be written only inside that mode, which is a thread's own: the engine's thread, which
    writes the results, is not in it, and torch's refusal there would stop every collective
    of the job on this rank.

    A tensor written in place may not have elements that share memory (an expanded view):
    torch refuses the write, which inside the engine would stop every collective of the
    job on this rank; refused here, at the call, the job stays usable. Marking bumps
    autograd's version counter: a tensor that autograd saved for backward and a collective
    then overwrote makes ``backward()`` raise, instead of computing gradients from values
    it never saw (the engine writes some outputs by the collective itself, which torch does
    not count)."""
    for tensor in outputs:
        if tensor.is_inference():
            raise RuntimeError(  # (torch's own type for this refusal)
                f"{what}: the tensor to write in place was made under torch.inference_mode(), "
                "and torch refuses writes to it outside that mode, which the engine's thread "
                "is not in: use the out-of-place op (hvd.allreduce(t) for hvd.allreduce_(t))"
            )
        # (a contiguous tensor has no such elements: one flag read, a quarter of the check)
        if not tensor.is_contiguous() and torch._debug_has_internal_overlap(tensor) == 1:
            raise ValueError(
                f"{what}: the tensor to write in place has elements that share memory (an "
                "expanded or broadcast view, stride 0); write into a tensor of its own "
                "(.clone()), or use the out-of-place op"
            )
    increment_version(outputs)


def check_devices(tensors: Sequence[torch.Tensor], what: str) -> None:
    """The tensors of one op must share a device (checked before an unnamed op's counter is
    drawn: see ``submit``)."""
    if len(tensors) > 1:
        device = tensors[0].device
        if any(t.device != device for t in tensors):
            raise ValueError(f"{what}: all tensors of one op must be on the same device")


def check_reduction(
    tensors: Sequence[torch.Tensor], op: ReduceOp, prescale: float, postscale: float, what: str
) -> None:
    if op == _ADASUM:
        raise NotImplementedError(
            f"{what} does not support op=hvd.Adasum (only allreduce does); use hvd.Average "
            "or hvd.Sum"
        )
    for tensor in tensors:
        if tensor.dtype not in REDUCIBLE:
            raise TypeError(f"{what} does not support tensors of dtype {tensor.dtype}")
        if tensor.dtype == torch.bool and (op == _AVERAGE or prescale != 1.0 or postscale != 1.0):
            raise TypeError(
                f"{what}: bool tensors support only Sum, Min, Max and Product, unscaled"
            )


def _check_name(name: str) -> str:
    if not isinstance(name, str):
        raise TypeError(f"op names are strings, got {type(name).__name__}")
    if FIELD in name or RECORD in name:
        raise ValueError(f"op name {name!r} contains a control character")
    return name


_reductions: dict[tuple[int, float, float], Reduction] = {}


def reduction_of(op: ReduceOp, prescale: float, postscale: float) -> Reduction:
    """The request's Reduction, one object per (op, prescale, postscale): built once (a
    NamedTuple's constructor runs Python), then a dict lookup."""
    key = (int(op), float(prescale), float(postscale))
    found = _reductions.get(key)
    if found is None:
        if len(_reductions) >= 4096:
            _reductions.clear()
        found = _reductions[key] = Reduction(*key)
    return found


_described: dict[tuple[Any, ...], tuple[str, list[TensorSpec]]] = {}

# (read per op: an enum member read through its class costs ~0.1 µs on Python 3.11)
_ADASUM, _AVERAGE = ReduceOp.ADASUM, ReduceOp.AVERAGE


def _describe(
    kind: Kind, common: tuple[Any, ...], inputs: list[torch.Tensor]
) -> tuple[str, list[TensorSpec]]:
    """The request's signature and tensor specs, cached: training submits the same shapes
    step after step, and building the text is a large part of an op's submission cost."""
    if len(inputs) == 1:
        t = inputs[0]
        key: tuple[Any, ...] = (kind, common, t.dtype, t.shape, t.is_cpu, t.is_cuda)
    else:
        key = (kind, common, *[(t.dtype, t.shape, t.is_cpu, t.is_cuda) for t in inputs])
    found = _described.get(key)
    if found is None:
        if len(_described) >= 4096:
            _described.clear()
        specs = [TensorSpec.of(t.dtype, tuple(t.shape), t.device.type) for t in inputs]
        found = (signature(kind, common, inputs), specs)
        _described[key] = found
    return found


def submit(
    kind: Kind,
    name: str | None,
    process_set: ProcessSet | None,
    inputs: list[torch.Tensor],
    outputs: list[Any],
    common: tuple[Any, ...] = (),
    var: str = "",
    finish: Callable[[Request], Any] | None = None,
    blocking: bool = False,
) -> Handle:
    """Builds and submits a request; returns its handle. ``common``: the values every rank
    must agree on besides the tensors (a :class:`Reduction` for allreduce and
    reducescatter, ``(root,)`` for a broadcast, a control op's argument). ``blocking``: the
    caller waits on the handle right away (see ``Submissions.add``)."""
    label = kind.label
    engine, group = resolve_process_set(process_set, label)
    set_id = group.process_set_id
    controller = engine.controller(set_id)
    full = "" if name is None else f"{label}.{_check_name(name)}"
    request = _request(
        controller, kind, full, -1, set_id, inputs, outputs, common, var, finish, blocking
    )
    if name is None:
        # Drawn last, once nothing on this rank can refuse the op any more: an op refused
        # here on one rank must not move its counter on (see engine/names.py).
        request.name = noname(kind, engine.next_counter(kind, set_id))
    if blocking and controller.run_now(request):
        return request.handle
    return controller.submit(request, blocking)


def _request(
    controller: Any,
    kind: Kind,
    full: str | None,
    counter: int,
    set_id: int,
    inputs: list[torch.Tensor],
    outputs: list[Any],
    common: tuple[Any, ...],
    var: str,
    finish: Callable[[Request], Any] | None,
    blocking: bool = False,
) -> Request:
    """A submission's request to ``controller`` (its process set's; ``full`` None: the
    unnamed op of ``counter``; ``blocking``: its caller waits on it at once)."""
    if full is None:
        full = noname(kind, counter)
    if len(inputs) > 1:
        check_devices(inputs, kind.label)
    sig, specs = _describe(kind, common, inputs)
    reduction = common if isinstance(common, Reduction) else PLAIN_SUM
    root = common[0] if kind == BROADCAST else 0
    # (positional: a dataclass's __init__ takes them faster than keywords, per op)
    request = Request(
        kind,
        full,
        set_id,
        inputs,
        outputs,
        Handle(controller.flush_bound),
        reduction,
        root,
        None,
        finish,
        sig,
        var,
        specs,
        time.monotonic(),
    )
    if inputs and inputs[0].is_cuda:
        refusal = runtime.cuda_refusal()
        if refusal is not None:
            raise SharedGpuError(refusal)
        request.stream, request.ready = streams.ready(inputs[0], blocking)
        request.home = request.stream
    return request


def outputs_of(request: Request) -> list[torch.Tensor]:
    return list(request.outputs)


def first_output(request: Request) -> torch.Tensor:
    out: torch.Tensor = request.outputs[0]
    return out


# ---- submissions shared by the public API ----------------------------------------------


def _same(outputs: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> bool:
    """Whether an op is in place (its outputs are its input tensors)."""
    if len(outputs) == 1 == len(tensors):
        return outputs[0] is tensors[0]
    return len(outputs) == len(tensors) and all(
        o is t for o, t in zip(outputs, tensors, strict=True)
    )


_ALLREDUCE = Kind.ALLREDUCE.label


def allreduce_in_place(
    tensor: torch.Tensor,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    process_set: ProcessSet | None,
    name: str | None,
) -> Handle:
    """``hvd.allreduce_``: an allreduce of one tensor in place, waited on at once. On the
    global process set it tries the engine's hot lane first (see :meth:`Engine.run_hot`),
    which checks the tensor and the op against the alike op that ran before."""
    if isinstance(tensor, torch.Tensor) and tensor.layout is torch.strided:
        tensor = unit_stride(tensor)
    if (process_set is None or process_set is global_process_set) and op is not _ADASUM:
        engine = runtime.engine(_ALLREDUCE)
        full = None if name is None else f"{_ALLREDUCE}.{_check_name(name)}"
        key = (int(op), float(prescale), float(postscale))
        common = _reductions.get(key) or reduction_of(op, prescale, postscale)  # (no call)
        handle = engine.run_hot(
            full,
            tensor,
            common,
            lambda counter: _request(
                engine.controller(0),
                Kind.ALLREDUCE,
                full,
                counter,
                0,
                [tensor],
                [tensor],
                common,
                "",
                first_output,
                blocking=True,
            ),
        )
        if handle is not None:
            increment_version(tensor)  # (as written_in_place does; the hot lane checked it)
            return handle
    return submit_allreduce(
        [tensor], [tensor], op, prescale, postscale, process_set, name, first_output, True
    )


def submit_allreduce(
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor] | None,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    process_set: ProcessSet | None,
    name: str | None,
    finish: Callable[[Request], Any],
    blocking: bool = False,
) -> Handle:
    """Allreduce of one or more tensors; ``outputs`` None means new output tensors (in
    place, the engine's outputs may be restrided views of the tensors: see unit_stride)."""
    inputs = [unit_stride(check_tensor(t, "allreduce")) for t in tensors]
    if type(op) is not ReduceOp:
        op = ReduceOp(op)
    if op == _ADASUM:
        return submit_adasum_allreduce(
            inputs, outputs, prescale, postscale, process_set, name, finish
        )
    check_reduction(inputs, op, prescale, postscale, "allreduce")
    key = (int(op), float(prescale), float(postscale))
    common = _reductions.get(key) or reduction_of(op, prescale, postscale)  # (no call)
    if outputs is None:
        if inputs and inputs[0].is_cpu:
            # Allocated by the engine once the result is ready (see execute._copy_out). CUDA
            # outputs are allocated here, on the caller's stream, for the caching allocator.
            outs: list[Any] = [None] * len(inputs)
        else:
            outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs]
        return submit(ALLREDUCE, name, process_set, inputs, outs, common, "", finish, blocking)
    outs = inputs if _same(outputs, tensors) else [unit_stride(t) for t in outputs]
    written_in_place(outs, "allreduce")
    return submit(ALLREDUCE, name, process_set, inputs, outs, common, "", finish, blocking)


def submit_adasum_allreduce(
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor] | None,
    prescale: float,
    postscale: float,
    process_set: ProcessSet | None,
    name: str | None,
    finish: Callable[[Request], Any],
) -> Handle:
    """An allreduce with op=Adasum: one allgather of the tensors, then Adasum's
    tree (:func:`collectives.adasum.adasum_tree`) on every rank; ``outputs`` None
    means new output tensors, as for other ops."""
    inputs = [check_tensor(t, "allreduce") for t in tensors]
    for tensor in inputs:
        if not tensor.is_floating_point():
            raise TypeError(
                f"allreduce with op=hvd.Adasum needs floating-point tensors, got {tensor.dtype}"
            )
    check_devices(inputs, "allreduce")
    engine, group = resolve_process_set(process_set, "allreduce")
    if name is None:
        # From the allreduce counter, so unnamed Adasum ops number like other allreduces
        # (drawn after the checks: see submit).
        name = engine.auto_name(Kind.ALLREDUCE, group.process_set_id)
    targets = list(outputs) if outputs is not None else None
    shapes = [t.shape for t in inputs]
    scale = float(prescale) * float(postscale)
    if by_halving(group.size, inputs):
        return _adasum_by_halving(inputs, targets, scale, process_set, group, name, finish)

    def combine(request: Request) -> Any:
        results: list[torch.Tensor] = []
        with torch.no_grad():
            for index, gathered in enumerate(request.outputs):
                parts = [part.reshape(-1) for part in gathered.unbind(0)]
                combined = adasum_tree(parts, scale).reshape(shapes[index])
                if targets is not None:
                    targets[index].copy_(combined)
                    combined = targets[index]
                results.append(combined)
        request.outputs = results
        return finish(request)

    # One row per rank, in the tensor's own shape: the allgather checks the ranks' shapes.
    rows = [t.detach().reshape(1, *t.shape) for t in inputs]
    return submit_allgather(rows, process_set, f"adasum.{name}", Computing(combine))


#: Adasum by vector halving (see collectives.adasum) from this many ranks (a power of two)
#: and once the gathering way would bring each rank at least this many bytes: with fewer,
#: the one allgather costs less than the halving's 2 log2(size) + 2 collectives in a row
#: (two ranks send as much either way). See docs/engine.md for the figures.
HALVING_MIN_RANKS = 4
HALVING_MIN_BYTES = 32 << 20


def by_halving(size: int, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether an Adasum op over ``size`` ranks runs by vector halving: a power of two of at
    least :data:`HALVING_MIN_RANKS`, CPU tensors (CUDA ones keep the gathering way until the
    halving is measured on GPUs), and enough bytes (:data:`HALVING_MIN_BYTES`)."""
    if size < max(HALVING_MIN_RANKS, 2) or size & (size - 1) or not all(t.is_cpu for t in tensors):
        return False
    return (size - 1) * sum(t.numel() * t.element_size() for t in tensors) >= HALVING_MIN_BYTES


def _adasum_by_halving(
    inputs: list[torch.Tensor],
    targets: list[torch.Tensor] | None,
    scale: float,
    process_set: ProcessSet | None,
    group: Group,
    name: str,
    finish: Callable[[Request], Any],
) -> Handle:
    """Adasum of ``inputs`` by vector halving: its collectives (a check that the ranks agree,
    an alltoall with the partner and an allreduce of the dot products per level, an
    allgather of the parts) run one after another on a thread of the op's own, which
    completes the returned handle."""
    work = work_dtype([t.dtype for t in inputs])
    bounds = [0]
    for tensor in inputs:
        bounds.append(bounds[-1] + tensor.numel())
    with torch.no_grad():  # (the vector as it is at the call, as the engine would read it)
        flat = torch.cat([t.detach().reshape(-1).to(work) for t in inputs])
    handle = Handle()
    prefix = f"adasum.{name}"

    def step(level: int, held: torch.Tensor, lo: int, keep_lo: int, keep_hi: int) -> torch.Tensor:
        distance = 1 << level
        partner, index = group.index ^ distance, group.index
        kept = held[keep_lo - lo : keep_hi - lo]
        send = held[keep_hi - lo :] if keep_lo == lo else held[: keep_lo - lo]
        splits = [0] * group.size
        splits[partner] = send.numel()
        theirs = submit_alltoall(
            send.contiguous(), splits, process_set, f"{prefix}.{level}", first_output
        ).wait()
        a, b = (theirs, kept) if index & distance else (kept, theirs)
        block = index >> (level + 1)
        dots = torch.zeros(group.size >> (level + 1), len(inputs), 3, dtype=work, device=a.device)
        dots[block] = partial_dots(a, b, bounds, keep_lo)
        summed = submit_allreduce(
            [dots], None, ReduceOp.SUM, 1.0, 1.0, process_set, f"{prefix}.{level}",
            first_output,
        ).wait()  # fmt: skip
        return combine_range(a, b, summed[block], bounds, keep_lo)

    def run() -> None:
        try:
            with torch.no_grad():
                # First the ranks check that they agree on the tensors (nothing moves): the
                # allgather a gathering Adasum runs under the same name, which rows of none
                # make a check, so ranks with other shapes, dtypes or devices (which may not
                # have chosen this way) get the allreduce's mismatch error, not a stall.
                rows = [t.new_empty((0, *t.shape)) for t in inputs]
                submit_allgather(rows, process_set, prefix, first_output).wait()
                held = flat
                plan = halving_ranges(flat.numel(), group.size, group.index)
                for level, (lo, _, keep_lo, keep_hi) in enumerate(plan):
                    held = step(level, held, lo, keep_lo, keep_hi)
                # (the allgather's request itself, which finish() is then handed as the
                # gathering way's combine hands it)
                request = submit_allgather([held], process_set, f"{prefix}.parts", lambda r: r)
                request = request.wait()
                parts = request.outputs[0]
                whole, offset = flat, 0  # (torch.cat's own copy, read no more)
                for rank in range(group.size):
                    _, _, lo, hi = halving_ranges(flat.numel(), group.size, rank)[-1]
                    whole[lo:hi] = parts[offset : offset + hi - lo]
                    offset += hi - lo
                if scale != 1.0:
                    whole.mul_(scale)
                results = []
                for i, tensor in enumerate(inputs):
                    result = whole[bounds[i] : bounds[i + 1]].view(tensor.shape).to(tensor.dtype)
                    if targets is not None:
                        result = targets[i].copy_(result)
                    results.append(result)
                request.outputs = results
            handle.complete(finish(request))
        except BaseException as error:  # (the op's error, raised where it is waited on)
            handle.fail(error)

    threading.Thread(target=run, name=f"hvd {prefix}", daemon=True).start()
    return handle


def submit_reducescatter(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp,
    prescale: float,
    postscale: float,
    process_set: ProcessSet | None,
    name: str | None,
    finish: Callable[[Request], Any],
    blocking: bool = False,
) -> Handle:
    inputs = [check_tensor(t, "reducescatter", min_dims=1) for t in tensors]
    op = ReduceOp(op)
    check_reduction(inputs, op, prescale, postscale, "reducescatter")
    _, group = resolve_process_set(process_set, "reducescatter")
    outs = []
    for t in inputs:
        rows = split_rows(t.shape[0], group.size)[group.index]
        outs.append(torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device))
    common = reduction_of(op, prescale, postscale)
    return submit(
        Kind.REDUCESCATTER,
        name,
        process_set,
        inputs,
        outs,
        common,
        finish=finish,
        blocking=blocking,
    )


def submit_allgather(
    tensors: Sequence[torch.Tensor],
    process_set: ProcessSet | None,
    name: str | None,
    finish: Callable[[Request], Any],
    blocking: bool = False,
) -> Handle:
    inputs = [check_tensor(t, "allgather", min_dims=1) for t in tensors]
    var = ",".join(str(t.shape[0]) for t in inputs)
    outs: list[Any] = [None] * len(inputs)
    return submit(
        Kind.ALLGATHER, name, process_set, inputs, outs, var=var, finish=finish, blocking=blocking
    )


def submit_sparse_allreduce(
    tensor: torch.Tensor,
    op: ReduceOp,
    process_set: ProcessSet | None,
    name: str | None,
) -> Handle:
    """Horovod's sparse allreduce: one allgather of every rank's indices and values (as one
    grouped op); the handle's result is the sparse sum, divided by the set's size for
    Average (coalesced: entries at the same index are added)."""
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.sparse_coo:
        raise TypeError(
            "sparse_allreduce_async expects a sparse COO tensor (such as the gradient of "
            f"nn.Embedding(sparse=True)), got {_describe_value(tensor)}"
        )
    op = ReduceOp(op)
    if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
        raise NotImplementedError(
            f"a sparse allreduce supports op=Average or Sum, not {op.name}; reduce the "
            "dense tensor instead (or DistributedOptimizer(sparse_as_dense=True))"
        )
    sparse = tensor.coalesce()
    _, group = resolve_process_set(process_set, "allgather")
    divisor = group.size if op == ReduceOp.AVERAGE else 1
    shape = sparse.shape

    def combine(request: Request) -> torch.Tensor:
        indices, values, _ = request.outputs
        if divisor != 1:
            values = values / divisor
        # Indices travelled transposed: (nnz, sparse_dim), so that dim 0 is the ragged one.
        result = torch.sparse_coo_tensor(indices.t(), values, shape, check_invariants=False)
        return result.coalesce()

    # allgather concatenates along dim 0, so the (sparse_dim, nnz) indices travel transposed.
    indices = sparse.indices().t().contiguous()
    # An empty tensor whose dims after the first are the sparse tensor's shape: it moves no
    # data, but ranks whose tensors have different shapes now fail negotiation's check (a
    # TensorMismatchError) instead of combining indices that are out of range.
    shape_check = torch.empty((0, *shape), dtype=torch.uint8, device=indices.device)
    tensors = [indices, sparse.values().contiguous(), shape_check]
    return submit_allgather(tensors, process_set, name, Computing(combine))


def _describe_value(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {str(value.layout).removeprefix('torch.')} tensor"
    return type(value).__name__


def submit_broadcast(
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor] | None,
    root_rank: int,
    process_set: ProcessSet | None,
    name: str | None,
    finish: Callable[[Request], Any],
    blocking: bool = False,
) -> Handle:
    inputs = [check_tensor(t, "broadcast") for t in tensors]
    _, group = resolve_process_set(process_set, "broadcast")
    root = root_index(root_rank, group, "broadcast")
    if outputs is None:
        outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs]
    else:
        outs = inputs if _same(outputs, tensors) else list(outputs)
        written_in_place(outs, "broadcast")
    # The engine broadcasts from the root's position in the set (every member computes it
    # alike from the same global rank).
    return submit(
        Kind.BROADCAST, name, process_set, inputs, outs, (root,), finish=finish, blocking=blocking
    )


def root_index(root_rank: Any, group: Group, what: str) -> int:
    """The position in the process set of ``root_rank``, a *global* rank as in Horovod
    (``hvd.broadcast(t, root_rank=3, process_set=hvd.ProcessSet([1, 3]))`` sends rank 3's
    tensor); ValueError, on every member that passes it, for a rank outside the set."""
    try:
        root_rank = _integer(root_rank)
    except TypeError:
        raise TypeError(
            f"{what}: root_rank must be an int, got {type(root_rank).__name__}"
        ) from None
    ranks = group.ranks
    if group.process_set_id == 0:
        if not 0 <= root_rank < len(ranks):
            raise ValueError(
                f"{what}: root_rank {root_rank} is out of range for a job of size {len(ranks)}"
            )
        return root_rank
    try:
        return ranks.index(root_rank)
    except ValueError:
        raise ValueError(
            f"{what}: root_rank {root_rank} is not a member of the process set {ranks}; "
            "root_rank is a global rank (hvd.rank()), as in Horovod, and must be one of "
            "the set's ranks"
        ) from None


def _integer(value: Any) -> int:
    """An int from anything integral (numpy and 0-d torch integers too), but not a bool."""
    if isinstance(value, bool):  # an int to Python, not a rank or a row count
        raise TypeError("bool")
    return operator.index(value)


def submit_alltoall(
    tensor: torch.Tensor,
    splits: Any,
    process_set: ProcessSet | None,
    name: str | None,
    finish: Callable[[Request], Any],
    blocking: bool = False,
) -> Handle:
    inp = check_tensor(tensor, "alltoall", min_dims=1)
    if splits is None:
        split_text = ""
    else:
        raw = splits.tolist() if isinstance(splits, torch.Tensor) else splits
        try:
            values = [_integer(v) for v in raw]
        except TypeError:
            raise InvalidSplitsError(
                f"alltoall: splits must be integers (a list or an integer tensor), got {raw!r}"
            ) from None
        split_text = ",".join(map(str, values))
    var = f"{inp.shape[0]}/{split_text}"
    return submit(
        Kind.ALLTOALL, name, process_set, [inp], [None], var=var, finish=finish, blocking=blocking
    )


# ---- synchronous list-based helpers (functions, optimizer) -----------------------------


def allreduce_(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp = ReduceOp.AVERAGE,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = global_process_set,
    name: str | None = None,
) -> None:
    """Reduces every tensor in place, as one grouped op."""
    if not tensors:
        return
    submit_allreduce(
        tensors,
        tensors,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
        name,
        outputs_of,
        blocking=True,
    ).wait()


def broadcast_(
    tensors: Sequence[torch.Tensor],
    root_rank: int,
    process_set: ProcessSet | None = global_process_set,
    name: str | None = None,
) -> None:
    """Overwrites every tensor with root_rank's values, as one grouped op."""
    if not tensors:
        _, group = resolve_process_set(process_set, "broadcast")
        root_index(root_rank, group, "broadcast")
        return
    submit_broadcast(
        tensors, tensors, root_rank, process_set, name, outputs_of, blocking=True
    ).wait()


def allgather(
    tensor: torch.Tensor,
    process_set: ProcessSet | None = global_process_set,
    name: str | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Concatenates every rank's tensor along dim 0; returns it and each rank's dim-0 size."""

    def finish(request: Request) -> tuple[torch.Tensor, list[int]]:
        assert request.rank_dims is not None or request.outputs[0] is not None
        dims = request.rank_dims[0] if request.rank_dims else [0]
        return request.outputs[0], dims

    result: tuple[torch.Tensor, list[int]] = submit_allgather(
        [tensor], process_set, name, finish, blocking=True
    ).wait()
    return result


def barrier(process_set: ProcessSet | None = global_process_set) -> None:
    """Returns once every rank of the process set has reached the barrier."""
    submit(Kind.BARRIER, None, process_set, [], [], blocking=True).wait()
