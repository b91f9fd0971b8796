"""Gradients accumulated locally over several backward passes, reduced every k-th
(Horovod's ``backward_passes_per_step``), for optimizers that do not accumulate by
themselves: tf_keras's and TF1's. Keras 3 optimizers accumulate on their own
(``gradient_accumulation_steps``), which :mod:`collectives.keras.optimizer` uses.

Horovod's algorithm, the reference: every pass adds its gradients to local sums and counts;
the k-th pass reduces the sums (the reducer averages over the ranks, keeps local variables'
own), divides them by k with ``average_aggregated_gradients``, clears the sums and applies
the result; the other passes apply nothing and only advance the optimizer's iteration count
(a TF1 optimizer's ``global_step``). A non-finite gradient in any pass reaches the sum, and
so the update, as it does in Horovod. Works eagerly, in ``tf.function`` and in TF1 graphs
(explicit control dependencies order the reads after the updates).

The counter and the sums are created when the first gradients come, as in Horovod: eagerly
(lifted out of a ``tf.function``), or in the TF1 graph being built, in its
``LOCAL_VARIABLES`` collection, so that an optimizer made before ``tf.Graph().as_default()``
works in that graph, savers and ``BroadcastGlobalVariablesHook`` leave them out and
``tf.compat.v1.local_variables_initializer()`` initializes them. An optimizer used in
another graph later gets variables of its own there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

__all__ = ["LocalGradientAggregationHelper", "control_inputs"]

Reduce = Callable[[list[Any], Sequence[Any]], list[Any]]


class LocalGradientAggregationHelper:
    """Accumulates ``backward_passes_per_step`` passes' gradients, reduced with
    ``allreduce_func(grads, variables)`` every k-th (see the module)."""

    def __init__(
        self,
        backward_passes_per_step: int,
        allreduce_func: Reduce,
        sparse_as_dense: bool,
        average_aggregated_gradients: bool,
        track: Callable[[Any], Any] | None = None,
    ) -> None:
        if backward_passes_per_step < 1:
            raise ValueError(
                f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}"
            )
        self.backward_passes_per_step = backward_passes_per_step
        self.allreduce_grads = allreduce_func
        self.sparse_as_dense = sparse_as_dense
        self.average_aggregated_gradients = average_aggregated_gradients
        self._sums: dict[int, tf.Variable] = {}
        self._computed: list[Any] = []  # this pass's gradients, once summed or reduced
        self.counter: Any = None  # (created with the sums, see _create_variables)
        self._graph: Any = None  # the TF1 graph they are in (None: eager)
        # Called with each variable made in a TF1 graph: tf_keras's session initializes the
        # variables tracked with its track_variable, which a Keras optimizer passes here.
        self._track = track

    def _create_variables(self, grads: list[Any], present: list[int]) -> None:
        """The counter and the sums of ``present`` gradients where they are missing: eager
        variables (out of a ``tf.function``), or local variables of the TF1 graph."""
        with tf.init_scope():
            graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
            if self.counter is None or graph is not self._graph:
                self._graph = graph
                self._sums = {}
                self.counter = self._variable(graph, tf.zeros([], tf.int64), "hvd_passes")
            for i in present:
                if i not in self._sums:
                    zeros = tf.zeros(grads[i].shape, grads[i].dtype)
                    self._sums[i] = self._variable(graph, zeros, "hvd_gradient_sum")

    def _variable(self, graph: Any, initial: tf.Tensor, name: str) -> Any:
        """A variable of the accumulation: eager, or local to the TF1 graph ``graph``."""
        if graph is None:
            return tf.Variable(initial, trainable=False, name=name)
        variable = tf.compat.v1.Variable(
            initial,
            trainable=False,
            name=name,
            collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES],
            use_resource=True,
        )
        if self._track is not None:
            self._track(variable)
        return variable

    def _dense(self, grad: Any) -> Any:
        if isinstance(grad, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise ValueError(
                    "backward_passes_per_step > 1 accumulates dense gradients: pass "
                    "sparse_as_dense=True for sparse ones (tf.IndexedSlices), as in Horovod"
                )
            return tf.convert_to_tensor(grad)
        return grad

    def compute_gradients(self, grads: Sequence[Any], variables: Sequence[Any]) -> list[Any]:
        """This pass's gradients added to the sums; the reduced sums on the k-th pass (and
        the sums cleared), the running sums on the others."""
        grads = [None if g is None else self._dense(g) for g in grads]
        present = [i for i, g in enumerate(grads) if g is not None]
        self._create_variables(grads, present)
        updates = [self._sums[i].assign_add(grads[i]) for i in present]
        with tf.control_dependencies(updates):
            count = self.counter.assign_add(1)
        with tf.control_dependencies([count]):
            totals = [self._sums[i].read_value() for i in present]
        if not present:
            return grads

        def reduce_and_clear() -> list[tf.Tensor]:
            full: list[Any] = [None] * len(grads)
            for i, total in zip(present, totals, strict=True):
                full[i] = total
            reduced = self.allreduce_grads(full, variables)
            out = [reduced[i] for i in present]
            if self.average_aggregated_gradients:
                k = self.backward_passes_per_step
                out = [g / tf.cast(k, g.dtype) for g in out]
            with tf.control_dependencies(out):
                clears = [self._sums[i].assign(tf.zeros_like(self._sums[i])) for i in present]
                clears.append(self.counter.assign(0))
            with tf.control_dependencies(clears):
                return [tf.identity(g) for g in out]

        def keep() -> list[tf.Tensor]:
            return [tf.identity(t) for t in totals]

        chosen = tf.cond(tf.equal(count, self.backward_passes_per_step), reduce_and_clear, keep)
        self._computed = list(chosen)
        result: list[Any] = [None] * len(grads)
        for i, grad in zip(present, chosen, strict=True):
            result[i] = grad
        return result

    def apply_gradients(
        self, apply: Callable[[], Any], optimizer: Any, global_step: Any = None
    ) -> Any:
        """``apply()`` on the pass that reduced (the counter is back at 0); on the others
        only the optimizer's iteration count (or ``global_step``) moves on."""

        def applied() -> tf.Tensor:
            with tf.control_dependencies(control_inputs(apply())):
                return tf.constant(True)

        def skipped() -> tf.Tensor:
            counter = global_step if global_step is not None else _iterations(optimizer)
            step = [] if counter is None else control_inputs(counter.assign_add(1))
            with tf.control_dependencies(step):
                return tf.constant(False)

        if self.counter is None:
            raise ValueError(
                "backward_passes_per_step > 1 applies the gradients of compute_gradients: "
                "call compute_gradients (or minimize) first"
            )
        # (after this pass's clearing)
        with tf.control_dependencies(control_inputs(self._computed)):
            reduced_now = tf.equal(self.counter.read_value(), 0)
        return tf.cond(reduced_now, applied, skipped)


def _iterations(optimizer: Any) -> Any:
    return getattr(optimizer, "iterations", None)


def control_inputs(result: Any) -> list[Any]:
    """What a control dependency can wait for in ``result`` (nothing in eager mode)."""
    if tf.executing_eagerly() or result is None:
        return []
    found = []
    for item in tf.nest.flatten(result):
        if isinstance(item, tf.Operation | tf.Tensor):
            found.append(item)
        elif hasattr(item, "op"):
            found.append(item.op)
    return found
