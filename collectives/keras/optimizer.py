"""``DistributedOptimizer`` for Keras: any Keras optimizer, its gradients reduced over the
ranks before it applies them (Horovod's ``hvd.DistributedOptimizer`` of horovod.keras).

The optimizer keeps its own class (``isinstance`` checks, ``get_config`` and saving keep
working): it is re-classed as a subclass of its class whose gradient step reduces first.

* **Keras 3** (TensorFlow or torch backend): ``apply`` (which ``apply_gradients`` and
  ``model.fit`` call) reduces the gradients, as one grouped op, then applies them. With
  ``backward_passes_per_step=k`` the optimizer accumulates k local gradients (Keras's own
  ``gradient_accumulation_steps``) and reduces only the accumulated ones, every k-th step:
  their average with ``average_aggregated_gradients=True``, else their sum (Horovod's
  default).
* **Keras 2** (``tf_keras``): the optimizer's aggregation of gradients over replicas
  (which ``apply_gradients`` and the ``LossScaleOptimizer`` of mixed precision run) reduces
  them first; ``backward_passes_per_step`` accumulates with Horovod's algorithm
  (:mod:`collectives.tensorflow.gradient_aggregation`) in ``apply_gradients``.

Variables registered as local (``register_local_var``, or the local layers of
``PartialDistributedOptimizer``) keep each rank's own gradient, divided by the process set's
size unless ``scale_local_gradients=False``, as in Horovod.

No double averaging where something else already reduces the gradients over the job's
processes: a model wrapped in torch's ``DistributedDataParallel`` (Keras's recipe for
multi-process training on its torch backend), or trained under a multi-worker
``tf.distribute`` strategy. There the optimizer applies the gradients as they come and says
so once, on stderr.
"""

from __future__ import annotations

import contextlib
import gc
import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from collectives.common import (
    ProcessSet,
    ReduceOp,
    checked_groups,
    global_process_set,
    reduced_over,
    variable_key,
)
from collectives.keras import backend as keras_backend

__all__ = ["create_distributed_optimizer"]


def create_distributed_optimizer(
    optimizer: Any,
    name: str | None = None,
    compression: Any = None,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: Any = ReduceOp.AVERAGE,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
    local_variables: Iterable[Any] = (),
) -> Any:
    """Re-classes ``optimizer`` so that its gradients are reduced first (see the module)."""
    if getattr(optimizer, "_hvd_distributed", False):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    if backward_passes_per_step < 1:
        raise ValueError(
            f"backward_passes_per_step must be at least 1, got {backward_passes_per_step}"
        )
    op = ReduceOp(op)
    if gradient_predivide_factor != 1.0 and op != ReduceOp.AVERAGE:
        raise ValueError("gradient_predivide_factor needs op=hvd.Average")
    groups, num_groups = checked_groups(groups, num_groups), 0
    bridge = keras_backend.current()
    bridge.check_owns(optimizer, "the optimizer given to DistributedOptimizer")
    settings = _Settings(
        bridge,
        op,
        1.0 / gradient_predivide_factor,
        gradient_predivide_factor,
        compression,
        sparse_as_dense,
        process_set,
        groups,
        scale_local_gradients,
    )
    for variable in local_variables:
        settings.local.add(variable_key(variable))
    base = type(optimizer)
    methods: dict[str, Any] = {"register_local_var": _register_local_var}
    if bridge.legacy and backward_passes_per_step == 1:
        # (see _reducing: a LossScaleOptimizer wrapped itself reduces in apply_gradients)
        if hasattr(base, "inner_optimizer"):
            name = "apply_gradients"
        elif hasattr(base, "aggregate_gradients"):
            name = "aggregate_gradients"  # (tf_keras's optimizers of TF 2.11 on)
        else:
            name = "_aggregate_gradients"  # (its optimizers.legacy ones)
        methods[name] = _reducing(name)
    elif bridge.legacy:
        from collectives.tensorflow.gradient_aggregation import LocalGradientAggregationHelper

        methods["apply_gradients"] = _legacy_apply_gradients
        settings.aggregation = LocalGradientAggregationHelper(
            backward_passes_per_step,
            lambda grads, variables: _reduce_unless_elsewhere(optimizer, grads, list(variables)),
            sparse_as_dense,
            average_aggregated_gradients,
            # (in a TF1 session, Keras initializes the variables it tracks)
            track=getattr(bridge.keras.__internal__.backend, "track_variable", None),
        )
    elif backward_passes_per_step == 1:
        methods["apply"] = _apply
    else:
        if getattr(optimizer, "built", False):
            raise ValueError(
                "backward_passes_per_step > 1: wrap the optimizer before it is built (before "
                "model.compile or its first step), so that it can accumulate gradients"
            )
        optimizer.gradient_accumulation_steps = backward_passes_per_step
        # Keras averages the accumulated gradients; Horovod's default is their sum.
        if not average_aggregated_gradients:
            settings.postscale *= backward_passes_per_step
            settings.local_scale *= backward_passes_per_step
        methods["_backend_update_step"] = _update_step
        methods["apply"] = _apply_accumulating
    if not bridge.legacy:
        _agree_on_finite_gradients(bridge.keras)
    cls = type(base.__name__, (base,), methods)
    cls.__module__ = base.__module__
    optimizer.__class__ = cls
    optimizer._hvd_settings = settings
    optimizer._hvd_distributed = True
    return optimizer


class _Settings:
    """How a distributed optimizer reduces its gradients."""

    def __init__(
        self,
        bridge: Any,
        op: ReduceOp,
        prescale: float,
        postscale: float,
        compression: Any,
        sparse_as_dense: bool,
        process_set: ProcessSet,
        groups: Any,
        scale_local_gradients: bool,
    ) -> None:
        self.bridge = bridge
        self.op = op
        self.prescale = prescale
        self.postscale = postscale
        self.compression = compression
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.groups = groups
        self.scale_local_gradients = scale_local_gradients
        #: Keys (``variable_key``) of the variables whose gradients stay local.
        self.local: set[int] = set()
        #: What multiplies a local variable's gradient, besides 1 / size (Horovod's
        #: ``scale_local_gradients``), and a gradient reduced already by a
        #: ``DistributedGradientTape``: the k passes' sum of Keras 3's average.
        self.local_scale = 1.0
        #: tf_keras's accumulation of backward passes (None: every pass is applied).
        self.aggregation: Any = None
        #: What reduces the gradients already ("": nothing; None: not known yet).
        self.elsewhere: str | None = None
        #: The TensorFlow frontend's reducer (TensorFlow backends), made at the first step.
        self._tf_reducer: Any = None
        #: During one gradient step that accumulates: the keys of the variables whose
        #: gradients came from a ``DistributedGradientTape`` (reduced already).
        self.presented: set[int] = set()
        #: Whether the step said on stderr that it applies a tape's gradients as they come.
        self.said_tape = False

    def from_tape(self, grad: Any) -> bool:
        """Whether a ``DistributedGradientTape`` over this process set returned ``grad``."""
        mark = reduced_over(grad)
        return mark is not None and mark == self.process_set

    @contextlib.contextmanager
    def presenting(self, grads: Sequence[Any], variables: Sequence[Any]) -> Iterator[None]:
        """For one step that accumulates (whose accumulated gradients reach the reduction as
        new tensors): which variables' gradients came from a ``DistributedGradientTape``."""
        self.presented = {
            variable_key(v)
            for g, v in zip(grads, variables, strict=False)  # (a mismatch is Keras's to report)
            if v is not None and self.from_tape(g)
        }
        try:
            yield
        finally:
            self.presented = set()

    def came_reduced(self, grad: Any, variable: Any) -> bool:
        """Whether ``grad`` (of ``variable``) is reduced over this process set already: a
        ``DistributedGradientTape`` (TensorFlow's) returned it, or, accumulated, the passes'
        gradients."""
        if grad is None or self.bridge.is_torch:
            return False
        if self.from_tape(grad):
            return True
        return variable is not None and variable_key(variable) in self.presented

    def reduce(self, grads: list[Any], variables: Sequence[Any]) -> list[Any]:
        """The gradients reduced over the ranks, but those a ``DistributedGradientTape``
        reduced already (as they come) and local variables' (scaled only)."""
        local_scale = self.local_scale
        if self.scale_local_gradients:
            local_scale /= self.process_set.size()
        kept: dict[int, float] = {}  # index -> the scale it gets instead of a reduction
        for i, (grad, variable) in enumerate(zip(grads, variables, strict=True)):
            if self.came_reduced(grad, variable):
                kept[i] = self.local_scale
                self._say_tape()
            elif variable is not None and self.is_local(variable):
                kept[i] = local_scale
        if not kept:
            return self._reduce(grads, variables)
        shared = [i for i in range(len(grads)) if i not in kept]
        result = list(grads)
        if shared:
            reduced = self._reduce([grads[i] for i in shared], [variables[i] for i in shared])
            for i, value in zip(shared, reduced, strict=True):
                result[i] = value
        rescale = _scaled_tf if not self.bridge.is_torch else _scaled_torch
        for i, scale in kept.items():
            if scale != 1.0:
                result[i] = rescale(grads[i], scale)
        return result

    def _say_tape(self) -> None:
        if not self.said_tape:
            self.said_tape = True
            sys.stderr.write(
                "hvd.DistributedOptimizer: gradients of a DistributedGradientTape are reduced "
                "over the processes already; they are applied as they come\n"
            )

    def all_ranks(self, flag: Any) -> Any:
        """A boolean backend tensor that is True on every rank of the process set where it
        is True on all of them (their minimum), else False on every one."""
        ops = self.bridge.keras.ops
        (agreed,) = self.bridge.reduce(
            [ops.cast(flag, "int32")], ReduceOp.MIN, process_set=self.process_set
        )
        return ops.cast(agreed, "bool")

    def is_local(self, variable: Any) -> bool:
        return bool(self.local) and variable_key(variable) in self.local

    def _reduce(self, grads: list[Any], variables: Sequence[Any]) -> list[Any]:
        bridge = self.bridge
        if not bridge.is_torch:
            if self._tf_reducer is None:  # (the scaling is final once the optimizer is made)
                from collectives.tensorflow.gradient_tape import GradientReducer

                reducer = GradientReducer(
                    self.compression or _no_compression(),
                    self.sparse_as_dense,
                    self.op,
                    1.0 / self.prescale,
                    0,
                    self.groups,
                    self.process_set,
                )
                if self.postscale != 1.0 / self.prescale:  # (accumulated: the sum of k steps)
                    reducer.postscale = self.postscale
                self._tf_reducer = reducer
            return self._tf_reducer.reduce(grads, variables)
        present = [i for i, g in enumerate(grads) if g is not None]
        compression = self.compression
        packed = [
            compression.compress(grads[i]) if compression is not None else (grads[i], None)
            for i in present
        ]
        reduced = bridge.reduce(
            [value for value, _ in packed],
            self.op,
            self.prescale,
            self.postscale,
            None,
            self.process_set,
        )
        result = list(grads)
        for i, value, (_, ctx) in zip(present, reduced, packed, strict=True):
            result[i] = compression.decompress(value, ctx) if compression is not None else value
        return result


def _register_local_var(self: Any, var: Any) -> None:
    """A variable whose gradient each rank keeps for itself: never reduced, divided by the
    process set's size with ``scale_local_gradients`` (Horovod's ``register_local_var``)."""
    self._hvd_settings.local.add(variable_key(var))


def _scaled_torch(grad: Any, factor: float) -> Any:
    return None if grad is None else grad * factor


def _scaled_tf(grad: Any, factor: float) -> Any:
    """A TensorFlow gradient scaled, sparse ones (``tf.IndexedSlices``) included."""
    from collectives.tensorflow.gradient_tape import scaled

    return scaled(grad, factor)


def _reduced_elsewhere(bridge: Any, variables: list[Any]) -> str | None:
    """What already reduces these variables' gradients over the processes, if anything:
    a ``DistributedDataParallel`` holding their parameters (torch backend), or a
    multi-worker ``tf.distribute`` strategy in scope (TensorFlow)."""
    if bridge.is_torch:
        if "torch.nn.parallel" not in sys.modules:
            return None
        from torch.nn.parallel import DistributedDataParallel

        params = {id(getattr(v, "value", v)) for v in variables}
        # (once per optimizer: the DDPs alive; by the object's type, since an isinstance
        # check may ask objects for their class, which deprecated ones answer with a warning)
        for obj in gc.get_objects():
            if issubclass(type(obj), DistributedDataParallel) and any(
                id(p) in params for p in obj.module.parameters()
            ):
                return "torch's DistributedDataParallel, which wraps the model"
        return None
    if "tensorflow" not in sys.modules:
        return None
    import tensorflow as tf

    if not tf.distribute.has_strategy():
        return None
    strategy = tf.distribute.get_strategy()
    workers = getattr(strategy.extended, "_num_workers", 1)
    if workers > 1:
        return f"tf.distribute's {type(strategy).__name__} over {workers} workers"
    return None


def _reduce_unless_elsewhere(self: Any, grads: list[Any], variables: list[Any]) -> list[Any]:
    """The gradients reduced over the ranks, or as they come where something else reduces
    them already (decided at the optimizer's first step)."""
    settings = self._hvd_settings
    if _elsewhere(settings, variables):
        return grads
    return settings.reduce(grads, variables)


def _elsewhere(settings: _Settings, variables: list[Any]) -> str:
    """What reduces the gradients already ("" if nothing), decided once, said on stderr."""
    if settings.elsewhere is None:
        settings.elsewhere = _reduced_elsewhere(settings.bridge, variables) or ""
        if settings.elsewhere:
            sys.stderr.write(
                f"hvd.DistributedOptimizer: the gradients are reduced over the processes by "
                f"{settings.elsewhere} already; they are not reduced again\n"
            )
    return settings.elsewhere


def _agree_on_finite_gradients(keras: Any) -> None:
    """Makes Keras 3's ``LossScaleOptimizer`` (which ``model.compile`` wraps the optimizer in
    under the ``mixed_float16`` policy) skip a step on every rank where any rank's gradients
    are not finite. It looks at the gradients before its inner optimizer reduces them, so a
    float16 overflow on one rank alone made that rank skip a reduction the others waited in
    (a hang, or steps paired out of order). Horovod reduces before the loss scale looks,
    which gives the same decision. Installed once; loss scale optimizers around other
    optimizers are left as they are."""
    cls = getattr(keras.optimizers, "LossScaleOptimizer", None)
    if cls is None or getattr(cls, "_hvd_agreeing", False):
        return
    check_locally = cls.check_finite

    def check_finite(self: Any, grads: Any) -> Any:
        finite = check_locally(self, grads)
        inner = getattr(self, "inner_optimizer", None)
        settings = getattr(inner, "_hvd_settings", None)
        if settings is None:
            return finite
        if settings.elsewhere is None:  # (decided once: the variables are read that once)
            _elsewhere(settings, list(getattr(inner, "_trainable_variables", None) or []))
        if settings.elsewhere or not settings.process_set.included():
            return finite
        return settings.all_ranks(finite)

    cls.check_finite = check_finite
    cls._hvd_agreeing = True


def _no_compression() -> Any:
    from collectives.tensorflow.compression import Compression

    return Compression.none


def _apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
    grads = list(grads)
    variables = list(trainable_variables) if trainable_variables is not None else None
    reduced = _reduce_unless_elsewhere(self, grads, variables or [None] * len(grads))
    return super(type(self), self).apply(reduced, trainable_variables)


def _apply_accumulating(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
    grads = list(grads)
    settings = self._hvd_settings
    variables = (
        trainable_variables
        if trainable_variables is not None
        else (getattr(self, "_trainable_variables", None) or [None] * len(grads))
    )
    with settings.presenting(grads, list(variables)):
        return super(type(self), self).apply(grads, trainable_variables)


def _update_step(self: Any, grads: Any, trainable_variables: Any, learning_rate: Any) -> Any:
    reduced = _reduce_unless_elsewhere(self, list(grads), list(trainable_variables))
    return super(type(self), self)._backend_update_step(reduced, trainable_variables, learning_rate)


def _reducing(name: str) -> Any:
    """The base class's method ``name``, taking (gradient, variable) pairs first, given them
    reduced over the ranks: tf_keras's aggregation of gradients over replicas, which
    ``apply_gradients`` runs unless told the gradients are aggregated already and its
    ``LossScaleOptimizer`` runs before its overflow test (so every rank tests the same
    reduced gradients and skips the same steps); or a ``LossScaleOptimizer``'s own
    ``apply_gradients``, since it runs its inner optimizer's aggregation, not its own."""

    def method(self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
        pairs = list(grads_and_vars)
        variables = [v for _, v in pairs]
        reduced = _reduce_unless_elsewhere(self, [g for g, _ in pairs], variables)
        merged = list(zip(reduced, variables, strict=True))
        return getattr(super(type(self), self), name)(merged, *args, **kwargs)

    method.__name__ = name
    return method


def _legacy_apply_gradients(self: Any, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
    """tf_keras with ``backward_passes_per_step``: Horovod's algorithm accumulates and
    reduces every k-th pass, and applies then."""
    pairs = list(grads_and_vars)
    grads = [g for g, _ in pairs]
    variables = [v for _, v in pairs]
    settings = self._hvd_settings
    aggregation = settings.aggregation
    with settings.presenting(grads, variables):
        grads = aggregation.compute_gradients(grads, variables)
    merged = list(zip(grads, variables, strict=True))

    def apply() -> Any:
        return super(type(self), self).apply_gradients(merged, *args, **kwargs)

    return aggregation.apply_gradients(apply, self)
