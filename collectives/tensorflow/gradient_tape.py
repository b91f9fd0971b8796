"""``DistributedGradientTape``: a ``tf.GradientTape`` whose gradients come back reduced
over the ranks (Horovod's TensorFlow 2 way of data-parallel training in a custom loop), and
``PartialDistributedGradientTape``, whose local layers keep their own gradients."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from collectives.common import (
    ProcessSet,
    ReduceOp,
    checked_groups,
    global_process_set,
    layer_variables,
    mark_reduced,
    variable_key,
)
from collectives.tensorflow import mpi_ops
from collectives.tensorflow.compression import Compression, Compressor

__all__ = [
    "DistributedGradientTape",
    "GradientReducer",
    "PartialDistributedGradientTape",
    "scaled",
]


class GradientReducer:
    """Reduces a list of gradients (None, dense or ``tf.IndexedSlices``) as Horovod's
    distributed tape and optimizer do: Average by default, ``gradient_predivide_factor``
    ``f`` dividing by ``f`` before the sum and by ``size / f`` after, ``sparse_as_dense``,
    compression, and ``groups``: by default every dense gradient in one grouped op (the
    engine fuses it into buckets); ``groups=n`` splits them into n grouped ops;
    ``groups=[[v1, v2], [v3]]`` reduces the gradients of each list of variables as one
    and every other gradient on its own.

    Local variables (:meth:`register_local`) keep their own gradient, divided by the
    process set's size when ``scale_local_gradients`` (Horovod's default). A rank outside
    the process set gets its gradients back as they are, as in Horovod."""

    def __init__(
        self,
        compression: type[Compressor] | Compressor = Compression.none,
        sparse_as_dense: bool = False,
        op: Any = ReduceOp.AVERAGE,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        process_set: ProcessSet = global_process_set,
        scale_local_gradients: bool = True,
    ) -> None:
        op = ReduceOp(op)
        if gradient_predivide_factor != 1.0 and op != ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor needs op=hvd.Average")
        groups = checked_groups(groups, num_groups)
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.op = op
        self.prescale = 1.0 / gradient_predivide_factor
        self.postscale = gradient_predivide_factor
        self.groups = groups
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self.local: set[int] = set()

    def register_local(self, variable: Any) -> None:
        """A variable whose gradient each rank keeps for itself (never reduced)."""
        self.local.add(variable_key(variable))

    def is_local(self, variable: Any) -> bool:
        return bool(self.local) and variable_key(variable) in self.local

    def reduce(
        self,
        grads: Sequence[Any],
        variables: Sequence[Any] | None = None,
        use_generic_names: bool = False,
    ) -> list[Any]:
        grads = list(grads)
        if not self.process_set.included():
            return grads
        if self.sparse_as_dense:
            grads = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
            ]
        local = (
            {i for i, v in enumerate(variables) if self.is_local(v)}
            if variables is not None and self.local
            else set()
        )
        present = [i for i, g in enumerate(grads) if g is not None and i not in local]
        dense = [i for i in present if not isinstance(grads[i], tf.IndexedSlices)]
        result = list(grads)
        for i in present:
            if i not in dense:  # sparse: an allgather of values and indices each
                result[i] = mpi_ops.allreduce(
                    grads[i],
                    op=self.op,
                    process_set=self.process_set,
                    name=f"tape.sparse.{i}" if not tf.executing_eagerly() else None,
                )
        for k, group in enumerate(self._groups(dense, variables)):
            reduced = mpi_ops.grouped_allreduce(
                [grads[i] for i in group],
                compression=self.compression,
                op=self.op,
                prescale_factor=self.prescale,
                postscale_factor=self.postscale,
                process_set=self.process_set,
                name=f"grad_{k}" if use_generic_names else None,
                ignore_name_scope=use_generic_names,
            )
            for i, g in zip(group, reduced, strict=True):
                result[i] = g
        if self.scale_local_gradients and local:
            size = mpi_ops.size_to_divide_by(self.process_set)  # (elastic: read at run time)
            for i in local:
                result[i] = _divided(grads[i], size)
        return result

    def _groups(self, dense: list[int], variables: Sequence[Any] | None) -> list[list[int]]:
        if not dense:
            return []
        groups = self.groups
        if groups is None:
            return [dense]
        if isinstance(groups, int):
            count = min(groups, len(dense))
            size, extra = divmod(len(dense), count)
            out, at = [], 0
            for k in range(count):
                n = size + (1 if k < extra else 0)
                out.append(dense[at : at + n])
                at += n
            return out
        if variables is None:
            raise ValueError("groups as lists of variables need the variables of the gradients")
        position = {variable_key(v): i for i, v in enumerate(variables)}
        grouped: list[list[int]] = []
        seen: set[int] = set()
        for members in groups:
            indices = [position[variable_key(v)] for v in members if variable_key(v) in position]
            indices = [i for i in indices if i in dense]
            if indices:
                grouped.append(indices)
                seen.update(indices)
        grouped.extend([i] for i in dense if i not in seen)
        return grouped


def _divided(grad: Any, size: int | tf.Tensor) -> Any:
    """A local gradient divided by the set's size (Horovod's ``scale_local_gradients``): a
    number, or the size op of an elastic job's graph."""
    if grad is None or (isinstance(size, int) and size == 1):
        return grad
    return _on_values(grad, lambda values: values / tf.cast(size, values.dtype))


def scaled(grad: Any, factor: float) -> Any:
    """A gradient (None, dense or ``tf.IndexedSlices``) times ``factor``."""
    if grad is None or factor == 1.0:
        return grad
    return _on_values(grad, lambda values: values * factor)


def _on_values(grad: Any, fn: Any) -> Any:
    """``fn`` of a dense gradient, or of a ``tf.IndexedSlices``' values (same rows)."""
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(fn(grad.values), grad.indices, grad.dense_shape)
    return fn(grad)


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns the gradients reduced over the
    ranks (see :class:`GradientReducer` for the options); everything else is the tape's.
    Sources registered with :meth:`register_local_source` keep their own gradient."""

    def __init__(
        self,
        gradtape: tf.GradientTape,
        device_dense: str = "",
        device_sparse: str = "",
        compression: type[Compressor] | Compressor = Compression.none,
        sparse_as_dense: bool = False,
        op: Any = ReduceOp.AVERAGE,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        process_set: ProcessSet = global_process_set,
        scale_local_gradients: bool = True,
    ) -> None:
        self._tape = gradtape
        self._reducer = GradientReducer(
            compression,
            sparse_as_dense,
            op,
            gradient_predivide_factor,
            num_groups,
            groups,
            process_set,
            scale_local_gradients,
        )
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients

    def register_local_source(self, source: Any) -> None:
        """A source (a ``tf.Variable`` or a Keras variable) whose gradient this rank keeps:
        it is not reduced (divided by the set's size with ``scale_local_gradients``)."""
        self._reducer.register_local(source)

    def gradient(
        self,
        target: Any,
        sources: Any,
        output_gradients: Any = None,
        use_generic_names: bool = False,
        unconnected_gradients: Any = tf.UnconnectedGradients.NONE,
    ) -> Any:
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        flat_sources = tf.nest.flatten(sources)
        flat = tf.nest.flatten(grads, expand_composites=False)
        reduced = self._reducer.reduce(flat, flat_sources, use_generic_names)
        if self.process_set.included():  # (a DistributedOptimizer applies them as they come)
            mark_reduced(reduced, self.process_set)
        return tf.nest.pack_sequence_as(grads, reduced, expand_composites=False)

    def get_local_and_global_gradients(
        self,
        target: Any,
        sources: Sequence[Any],
        output_gradients: Any = None,
        use_generic_names: bool = False,
    ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """The (source, gradient) pairs of the local sources, and of the others (reduced)."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local: list[tuple[Any, Any]] = []
        others: list[tuple[Any, Any]] = []
        for source, grad in zip(sources, grads, strict=True):
            (local if self._reducer.is_local(source) else others).append((source, grad))
        return local, others

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tape.__exit__(*exc)


def PartialDistributedGradientTape(
    gradtape: tf.GradientTape,
    device_dense: str = "",
    device_sparse: str = "",
    compression: type[Compressor] | Compressor = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = ReduceOp.AVERAGE,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> DistributedGradientTape:
    """A :class:`DistributedGradientTape` whose ``local_layers`` (Keras layers, of Keras 3
    or tf_keras) keep their own gradients: each rank trains them alone."""
    tape = DistributedGradientTape(
        gradtape,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
    )
    for variable in layer_variables(local_layers):
        tape.register_local_source(variable)
    return tape
