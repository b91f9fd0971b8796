"""Horovod's TensorFlow ops on the shared engine: ``hvd.allreduce``, ``allgather``, ...

Each op checks its arguments, turns the TensorFlow tensors into torch views (see
:mod:`.tensors`) and submits them through the framework-neutral submission layer
(:mod:`collectives.ops`), in eager mode at once and in graphs as ``tf.py_function`` ops (see
:mod:`.graph`). Every differentiable op has its gradient as Horovod defines it
(``tf.custom_gradient``):

============== ===========================================================================
allreduce      grad = allreduce(grad) with the same op and scaling
allgather      grad = this rank's rows of allreduce(grad, Average)
broadcast      grad = allreduce(grad, Average) on the root, zeros elsewhere
alltoall       grad = alltoall(grad) sent back along the received splits
reducescatter  grad = allgather(grad * size) for Sum, allgather(grad) for Average, times
               the scaling
============== ===========================================================================

``tf.IndexedSlices`` (the gradients of embeddings) reduce by an allgather of their values and
indices (Horovod's way); Sum and Average only, no scaling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
import torch
from tensorflow.python.eager import record

from collectives import job, ops, runtime
from collectives.common import ProcessSet, ReduceOp, global_process_set
from collectives.engine.execute import split_rows
from collectives.engine.requests import Kind
from collectives.process_sets import add_process_set, remove_process_set
from collectives.tensorflow import graph
from collectives.tensorflow.compression import Compression, Compressor
from collectives.tensorflow.errors import InvalidSplitsError, as_tensorflow_error
from collectives.tensorflow.tensors import check_dense

# (Horovod's horovod.tensorflow.mpi_ops holds the job's queries too: scripts import them
# from there)
__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "Sum",
    "add_process_set",
    "allgather",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "check_num_rank_power_of_2",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "handle_average_backwards_compatibility",
    "init",
    "join",
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "rank_op",
    "raw_allreduce",
    "raw_grouped_allreduce",
    "raw_grouped_reducescatter",
    "raw_reducescatter",
    "reducescatter",
    "remove_process_set",
    "size_op",
]

init = job.init

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

handle_average_backwards_compatibility = job.handle_average_backwards_compatibility


def check_num_rank_power_of_2(num_rank: int) -> bool:
    """Whether ``num_rank`` is a power of two (Adasum's requirement)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def join() -> tf.Tensor:
    """Declares this rank done (see :func:`collectives.job.join`); an int32 scalar tensor:
    the last rank to join, as Horovod's op returns it (in a graph, when it runs)."""
    if not graph.in_graph():
        runtime.engine("hvd.join()")

    def submit(views: list[torch.Tensor]) -> Any:
        return ops.submit(Kind.JOIN, "join", global_process_set, [], [], blocking=True)

    def collect(last: int) -> list[torch.Tensor]:
        return [torch.tensor(last, dtype=torch.int32)]

    return graph.run("join", [], submit, collect, [tf.int32], [tf.TensorShape([])])[0]


def barrier(process_set: ProcessSet = global_process_set) -> tf.Tensor | None:
    """Returns once every rank of the process set has reached the barrier. Eagerly it waits
    at the call (and returns None); in a ``tf.function`` or a TF1 graph it is an op that
    waits each time it runs (an int32 scalar, 0: a TF1 session runs it when asked for it),
    not once while the function is traced."""
    if not graph.in_graph():
        job.barrier(process_set)
        return None

    def submit(views: list[torch.Tensor]) -> Any:
        return ops.submit(Kind.BARRIER, None, process_set, [], [], blocking=True)

    def collect(_: Any) -> list[torch.Tensor]:
        return [torch.tensor(0, dtype=torch.int32)]

    return graph.run("barrier", [], submit, collect, [tf.int32], [tf.TensorShape([])])[0]


# ---- the job's numbers as ops ---------------------------------------------------------------

#: What the process-set ops return for a set that is not registered (Horovod's code).
PROCESS_SET_ERROR_UNKNOWN_SET = -3


def _number_op(value: Callable[[], int], name: str | None) -> tf.Tensor:
    """An int32 scalar computed when the op runs: at once in eager mode, at every run of a
    graph (a graph may run in another job than the one it was built in, as in Horovod)."""
    if not graph.in_graph():
        return tf.constant(value(), dtype=tf.int32)

    def body() -> tf.Tensor:
        try:
            return tf.constant(value(), dtype=tf.int32)
        except ValueError as error:  # (not initialized)
            raise as_tensorflow_error(error) from None

    out = tf.py_function(body, [], Tout=tf.int32, name=name or "hvd_number")
    out.set_shape([])
    return out


def _set_size(process_set_id: int) -> int:
    group = runtime.engine("hvd.size_op()").groups.get(process_set_id)
    return PROCESS_SET_ERROR_UNKNOWN_SET if group is None else len(group.ranks)


def _set_included(process_set_id: int) -> int:
    group = runtime.engine("hvd.process_set_included_op()").groups.get(process_set_id)
    if group is None:
        return PROCESS_SET_ERROR_UNKNOWN_SET
    return int(runtime.rank() in group.ranks)


def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """The number of processes (of the process set ``process_set_id``), as an int32 op."""
    return _number_op(lambda: _set_size(process_set_id), name)


def local_size_op(name: str | None = None) -> tf.Tensor:
    """The number of processes on this host, as an int32 op."""
    return _number_op(runtime.local_size, name)


def rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank, as an int32 op."""
    return _number_op(runtime.rank, name)


def local_rank_op(name: str | None = None) -> tf.Tensor:
    """This process's rank on its host, as an int32 op."""
    return _number_op(runtime.local_rank, name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """1 if this process belongs to the process set ``process_set_id``, else 0; -3
    (Horovod's code) for a set that is not registered; an int32 op."""
    return _number_op(lambda: _set_included(process_set_id), name)


def _differentiable(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``tf.custom_gradient`` where a gradient can be asked for: in a graph, or in eager mode
    under a recording tape. An eager call that no tape records runs ``forward`` alone: the
    decorator costs hundreds of microseconds a call, more than a small collective."""

    def call(*inputs: tf.Tensor) -> Any:
        if graph.in_graph() or record.could_possibly_record():
            return tf.custom_gradient(forward)(*inputs)
        return forward(*inputs)[0]

    return call


def _size(process_set: ProcessSet) -> int:
    return process_set.size() if process_set is not global_process_set else runtime.size()


def size_to_divide_by(process_set: ProcessSet) -> int | tf.Tensor:
    """The process set's size for an average: in a graph of an elastic job (a traced
    ``tf.function`` outlives a reset that changes the size) the size op, read each time the
    graph runs, as Horovod does under HOROVOD_ELASTIC; elsewhere the number (cheaper)."""
    set_id = process_set.process_set_id
    if graph.in_graph() and set_id is not None and runtime.is_elastic():
        return size_op(set_id)
    return _size(process_set)


# ---- allreduce ----------------------------------------------------------------------------


def _reduce(
    tensors: Sequence[tf.Tensor],
    op: ReduceOp,
    prescale: float,
    postscale: float,
    name: str | None,
    process_set: ProcessSet,
    ignore_name_scope: bool,
) -> list[tf.Tensor]:
    """The raw allreduce of dense tensors (one grouped op), with Horovod's gradient."""

    @_differentiable
    def reduce(*inputs: tf.Tensor) -> Any:
        label = "allreduce" if len(inputs) == 1 else "grouped_allreduce"
        full = graph.op_name("allreduce", name, inputs, ignore_name_scope)

        def submit(views: list[torch.Tensor]) -> Any:
            return ops.submit_allreduce(
                views,
                None,
                op,
                prescale,
                postscale,
                process_set,
                full,
                ops.outputs_of,
                blocking=True,
            )

        outputs = graph.run(
            label, inputs, submit, list, [t.dtype for t in inputs], [t.shape for t in inputs]
        )

        def grad(*upstream: tf.Tensor) -> Any:
            return _reduce(upstream, op, prescale, postscale, None, process_set, True)

        return outputs, grad

    return list(reduce(*tensors))


def allreduce(
    tensor: Any,
    average: Any = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] | Compressor = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
) -> Any:
    """Reduces a tensor (or ``tf.IndexedSlices``) over the ranks of the process set;
    Average by default. ``device_dense``/``device_sparse`` are accepted for Horovod
    compatibility (the engine places data itself)."""
    op = job.handle_average_backwards_compatibility(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _sparse_allreduce(
            tensor, op, prescale_factor, postscale_factor, name, process_set, ignore_name_scope
        )
    dense = check_dense(tensor, "allreduce", reduces=True)
    if op == ReduceOp.ADASUM:
        return _adasum([dense], prescale_factor, postscale_factor, name, process_set)[0]
    compressed, ctx = compression.compress(dense)
    (reduced,) = _reduce(
        [compressed], op, prescale_factor, postscale_factor, name, process_set, ignore_name_scope
    )
    return compression.decompress(reduced, ctx)


def grouped_allreduce(
    tensors: Sequence[Any],
    average: Any = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] | Compressor = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    name: str | None = None,
) -> list[Any]:
    """Reduces every tensor as one grouped op (they travel and complete together)."""
    op = job.handle_average_backwards_compatibility(op, average)
    if not tensors:
        return []
    if any(isinstance(t, tf.IndexedSlices) for t in tensors):
        return [
            allreduce(
                t,
                None,
                device_dense,
                device_sparse,
                compression,
                op,
                prescale_factor,
                postscale_factor,
                None,
                process_set,
                ignore_name_scope,
            )
            for t in tensors
        ]
    dense = [check_dense(t, "grouped_allreduce", reduces=True) for t in tensors]
    if op == ReduceOp.ADASUM:
        return _adasum(dense, prescale_factor, postscale_factor, name, process_set)
    compressed = [compression.compress(t) for t in dense]
    reduced = _reduce(
        [c for c, _ in compressed],
        op,
        prescale_factor,
        postscale_factor,
        name,
        process_set,
        ignore_name_scope,
    )
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed, strict=True)]


def _sparse_allreduce(
    slices: tf.IndexedSlices,
    op: ReduceOp,
    prescale: float,
    postscale: float,
    name: str | None,
    process_set: ProcessSet,
    ignore_name_scope: bool,
) -> tf.IndexedSlices:
    """Horovod's sparse allreduce: an allgather of the values and of the indices."""
    if op not in (ReduceOp.SUM, ReduceOp.AVERAGE):
        raise NotImplementedError(
            f"allreduce of tf.IndexedSlices supports op=Sum or Average, not {op.name}; pass "
            "sparse_as_dense=True to reduce them as dense tensors"
        )
    if prescale != 1.0 or postscale != 1.0:
        raise NotImplementedError(
            "prescale/postscale factors are not supported for tf.IndexedSlices"
        )
    values = allgather(
        slices.values, f"{name}.values" if name else None, ignore_name_scope, process_set
    )
    indices = allgather(
        slices.indices, f"{name}.indices" if name else None, ignore_name_scope, process_set
    )
    if op == ReduceOp.AVERAGE:
        values = values / tf.cast(size_to_divide_by(process_set), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _adasum(
    tensors: list[tf.Tensor],
    prescale: float,
    postscale: float,
    name: str | None,
    process_set: ProcessSet,
) -> list[tf.Tensor]:
    """Adasum (the engine gathers every rank's tensor and combines them on each rank)."""
    for tensor in tensors:
        if not tensor.dtype.is_floating:
            raise TypeError(
                "allreduce with op=hvd.Adasum needs floating-point tensors, got "
                f"{tensor.dtype.name}"
            )

    @_differentiable
    def combine(*inputs: tf.Tensor) -> Any:
        full = graph.op_name("allreduce", name, inputs)

        def submit(views: list[torch.Tensor]) -> Any:
            return ops.submit_adasum_allreduce(
                views, None, prescale, postscale, process_set, full, ops.outputs_of
            )

        outputs = graph.run(
            "allreduce", inputs, submit, list, [t.dtype for t in inputs], [t.shape for t in inputs]
        )

        def grad(*upstream: tf.Tensor) -> Any:  # Horovod's: the same Adasum of the gradients
            return _adasum(list(upstream), prescale, postscale, None, process_set)

        return outputs, grad

    return list(combine(*tensors))


# ---- allgather ----------------------------------------------------------------------------


def _gather(
    tensors: Sequence[tf.Tensor],
    name: str | None,
    ignore_name_scope: bool,
    process_set: ProcessSet,
) -> list[tf.Tensor]:
    @_differentiable
    def gather(*inputs: tf.Tensor) -> Any:
        full = graph.op_name("allgather", name, inputs, ignore_name_scope)

        def submit(views: list[torch.Tensor]) -> Any:
            return ops.submit_allgather(views, process_set, full, ops.outputs_of, blocking=True)

        shapes = [tf.TensorShape([None]).concatenate(t.shape[1:]) for t in inputs]
        outputs = graph.run("allgather", inputs, submit, list, [t.dtype for t in inputs], shapes)

        def grad(*upstream: tf.Tensor) -> Any:
            reduced = _reduce(upstream, ReduceOp.AVERAGE, 1.0, 1.0, None, process_set, True)
            rows = [tf.shape(t, out_type=tf.int64)[:1] for t in inputs]
            dims = _gather(rows, None, True, process_set)
            me = process_set.rank() if process_set is not global_process_set else runtime.rank()
            size = _size(process_set)
            return [
                tf.split(g, tf.reshape(d, [size]), axis=0)[me]
                for g, d in zip(reduced, dims, strict=True)
            ]

        return outputs, grad

    return list(gather(*tensors))


def allgather(
    tensor: Any,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """Concatenates every rank's tensor along the first dimension (ranks may differ in it)."""
    dense = check_dense(tensor, "allgather")
    if dense.shape.rank == 0:
        raise ValueError("allgather needs a tensor with at least one dimension")
    return _gather([dense], name, ignore_name_scope, process_set)[0]


def grouped_allgather(
    tensors: Sequence[Any],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor]:
    """Allgathers every tensor as one grouped op."""
    if not tensors:
        return []
    dense = [check_dense(t, "grouped_allgather") for t in tensors]
    if any(t.shape.rank == 0 for t in dense):
        raise ValueError("grouped_allgather needs tensors with at least one dimension")
    return _gather(dense, name, ignore_name_scope, process_set)


# ---- broadcast ----------------------------------------------------------------------------


def broadcast(
    tensor: Any,
    root_rank: int,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    """Root's tensor on every rank of the process set (``root_rank`` is a global rank)."""
    dense = check_dense(tensor, "broadcast")
    return _broadcast([dense], root_rank, name, ignore_name_scope, process_set)[0]


def _broadcast(
    tensors: Sequence[tf.Tensor],
    root_rank: int,
    name: str | None,
    ignore_name_scope: bool,
    process_set: ProcessSet,
) -> list[tf.Tensor]:
    @_differentiable
    def bcast(*inputs: tf.Tensor) -> Any:
        full = graph.op_name("broadcast", name, inputs, ignore_name_scope)

        def submit(views: list[torch.Tensor]) -> Any:
            return ops.submit_broadcast(
                views,
                None,
                root_rank,
                process_set,
                full,
                ops.outputs_of,
                blocking=True,
            )

        outputs = graph.run(
            "broadcast", inputs, submit, list, [t.dtype for t in inputs], [t.shape for t in inputs]
        )

        def grad(*upstream: tf.Tensor) -> Any:
            reduced = _reduce(upstream, ReduceOp.AVERAGE, 1.0, 1.0, None, process_set, True)
            # The same ops on every rank (zeros but on the root): a graph whose ops differ
            # across ranks numbers the later ops' default names differently, and unnamed
            # collectives after this one would never meet.
            keep = int(runtime.rank() == root_rank)
            return [g * tf.cast(keep, g.dtype) for g in reduced]

        return outputs, grad

    return list(bcast(*tensors))


def broadcast_(
    variables: Sequence[tf.Variable],
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Variable]:
    """Overwrites every variable with root's value, in place (one grouped broadcast)."""
    variables = list(variables)
    if not variables:
        return variables
    values = _broadcast(
        [check_dense(v, "broadcast_") for v in variables], root_rank, name, False, process_set
    )
    assigned = [v.assign(value) for v, value in zip(variables, values, strict=True)]
    if graph.in_graph():
        return assigned
    return variables


# ---- alltoall -----------------------------------------------------------------------------


def alltoall(
    tensor: Any,
    splits: Any = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Sends ``splits[i]`` rows (equal shares without splits) to the i-th rank of the set;
    returns the rows received, concatenated, and, where ``splits`` was given, how many came
    from each rank (as Horovod: without splits, the rows alone)."""
    dense = check_dense(tensor, "alltoall")
    if dense.shape.rank == 0:
        raise ValueError("alltoall needs a tensor with at least one dimension")
    if splits is None:
        return _alltoall(dense, None, name, ignore_name_scope, process_set)[0]
    return _alltoall(dense, _split_counts(splits), name, ignore_name_scope, process_set)


def _split_counts(splits: Any) -> tf.Tensor:
    """``splits`` as an int32 tensor; splits that are not integers (floats, bools) are refused
    rather than truncated, as Horovod's op refuses them."""
    try:
        counts = tf.convert_to_tensor(splits)
    except (TypeError, ValueError):
        counts = None
    if counts is None or not counts.dtype.is_integer:
        raise InvalidSplitsError(
            None,
            None,
            f"alltoall: splits must be integers (a list or an integer tensor), got {splits!r}",
        )
    return tf.cast(counts, tf.int32)


def _alltoall(
    tensor: tf.Tensor,
    splits: tf.Tensor | None,
    name: str | None,
    ignore_name_scope: bool,
    process_set: ProcessSet,
) -> tuple[tf.Tensor, tf.Tensor]:
    @_differentiable
    def exchange(value: tf.Tensor, *split: tf.Tensor) -> Any:
        full = graph.op_name("alltoall", name, [value], ignore_name_scope)

        def submit(views: list[torch.Tensor]) -> Any:
            wanted = views[1].tolist() if len(views) > 1 else None
            return ops.submit_alltoall(
                views[0], wanted, process_set, full, _with_splits, blocking=True
            )

        outputs = graph.run(
            "alltoall",
            [value, *split],
            submit,
            list,
            [value.dtype, tf.int32],
            [tf.TensorShape([None]).concatenate(value.shape[1:]), tf.TensorShape([None])],
        )
        received, counts = outputs

        def grad(upstream: tf.Tensor, *unused: Any) -> Any:
            back, _ = _alltoall(upstream, counts, None, True, process_set)
            return [back, *(None for _ in split)]

        return (received, counts), grad

    inputs = [tensor] if splits is None else [tensor, splits]
    received, counts = exchange(*inputs)
    return received, counts


def _with_splits(request: Any) -> list[torch.Tensor]:
    """An alltoall's output and the splits it received, as tensors."""
    return [request.outputs[0], torch.tensor(request.extra, dtype=torch.int32)]


# ---- reducescatter ------------------------------------------------------------------------


def reducescatter(
    tensor: Any,
    device_dense: str = "",
    compression: type[Compressor] | Compressor = Compression.none,
    op: Any = ReduceOp.AVERAGE,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    """Reduces over the ranks and gives each rank its share of the first dimension (the
    first ``rows % size`` ranks one row more); Average by default."""
    return grouped_reducescatter(
        [tensor],
        device_dense,
        compression,
        op,
        process_set,
        ignore_name_scope,
        prescale_factor,
        postscale_factor,
        name,
    )[0]


def grouped_reducescatter(
    tensors: Sequence[Any],
    device_dense: str = "",
    compression: type[Compressor] | Compressor = Compression.none,
    op: Any = ReduceOp.AVERAGE,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
) -> list[tf.Tensor]:
    """Reducescatters every tensor as one grouped op."""
    op = ReduceOp(op)
    if not tensors:
        return []
    dense = [check_dense(t, "reducescatter", reduces=True) for t in tensors]
    if any(t.shape.rank == 0 for t in dense):
        raise ValueError("reducescatter needs tensors with at least one dimension")
    compressed = [compression.compress(t) for t in dense]
    scattered = _scatter(
        [c for c, _ in compressed],
        op,
        prescale_factor,
        postscale_factor,
        name,
        process_set,
        ignore_name_scope,
    )
    return [
        compression.decompress(s, ctx) for s, (_, ctx) in zip(scattered, compressed, strict=True)
    ]


def _scatter(
    tensors: Sequence[tf.Tensor],
    op: ReduceOp,
    prescale: float,
    postscale: float,
    name: str | None,
    process_set: ProcessSet,
    ignore_name_scope: bool,
) -> list[tf.Tensor]:
    @_differentiable
    def scatter(*inputs: tf.Tensor) -> Any:
        full = graph.op_name("reducescatter", name, inputs, ignore_name_scope)

        def submit(views: list[torch.Tensor]) -> Any:
            return ops.submit_reducescatter(
                views,
                op,
                prescale,
                postscale,
                process_set,
                full,
                ops.outputs_of,
                blocking=True,
            )

        size = _size(process_set)
        me = process_set.rank() if process_set is not global_process_set else runtime.rank()
        shapes = []
        for t in inputs:
            rows = t.shape[0]
            mine = None if rows is None else split_rows(rows, size)[me]
            shapes.append(tf.TensorShape([mine]).concatenate(t.shape[1:]))
        outputs = graph.run(
            "reducescatter", inputs, submit, list, [t.dtype for t in inputs], shapes
        )

        def grad(*upstream: tf.Tensor) -> Any:
            factor = (size if op == ReduceOp.SUM else 1) * prescale * postscale
            scaled = [g * tf.cast(factor, g.dtype) if factor != 1 else g for g in upstream]
            return [allgather(g, None, True, process_set) for g in scaled]

        return outputs, grad

    return list(scatter(*tensors))


# ---- Horovod's raw ops (no compression, Sum by default), which scripts call by their private
# names (hvd._allreduce, ...)


def raw_allreduce(
    tensor: Any,
    name: str | None = None,
    op: Any = ReduceOp.SUM,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> tf.Tensor:
    return allreduce(
        tensor,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        name=name,
        process_set=process_set,
        ignore_name_scope=ignore_name_scope,
    )


def raw_grouped_allreduce(
    tensors: Sequence[Any],
    name: str | None = None,
    op: Any = ReduceOp.SUM,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
) -> list[tf.Tensor]:
    return grouped_allreduce(
        tensors,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
        ignore_name_scope=ignore_name_scope,
        name=name,
    )


def raw_reducescatter(
    tensor: Any,
    name: str | None = None,
    op: Any = ReduceOp.SUM,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> tf.Tensor:
    return raw_grouped_reducescatter(
        [tensor], name, op, ignore_name_scope, process_set, prescale_factor, postscale_factor
    )[0]


def raw_grouped_reducescatter(
    tensors: Sequence[Any],
    name: str | None = None,
    op: Any = ReduceOp.SUM,
    ignore_name_scope: bool = False,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[tf.Tensor]:
    return grouped_reducescatter(
        tensors,
        op=op,
        process_set=process_set,
        ignore_name_scope=ignore_name_scope,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        name=name,
    )


def __getattr__(name: str) -> Any:
    """The job's queries (``rank``, ``size``, ...), which Horovod's ``mpi_ops`` holds too."""
    return runtime.job_query(__name__, name)
