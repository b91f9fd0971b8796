"""Which Keras this is, and how its values reach the engine.

* **Keras 3** (the ``keras`` package) on its TensorFlow backend: values are TensorFlow
  tensors and variables, reduced through the TensorFlow frontend (``collectives.tensorflow``:
  DLPack, and ``tf.py_function`` inside Keras's compiled train step).
* **Keras 3 on its torch backend**: values are torch tensors already; they go to the
  engine directly, through the framework-neutral submission layer (``collectives.ops``).
* **Keras 2** (``tf_keras``, with ``TF_USE_LEGACY_KERAS=1``): TensorFlow, as above.

A JAX backend has no way to the engine here and is refused with a clear error.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from collectives import ops
from collectives.common import ProcessSet, ReduceOp, global_process_set

__all__ = ["KerasBackend", "current"]


class KerasBackend:
    """The Keras in use and its way to the engine."""

    def __init__(self, keras: Any, name: str, legacy: bool) -> None:
        self.keras = keras  # the module: keras, or tf_keras
        self.name = name  # "tensorflow" or "torch"
        self.legacy = legacy  # Keras 2 (tf_keras)

    @property
    def is_torch(self) -> bool:
        return self.name == "torch"

    def describe(self) -> str:
        version = getattr(self.keras, "__version__", "?")
        which = "tf_keras" if self.legacy else "keras"
        return f"{which} {version} on {self.name}"

    def check_owns(self, obj: Any, what: str) -> None:
        """Refuses an object of the other Keras (a tf_keras optimizer where Keras 3 is served,
        or the reverse), which would train without a word of error and without reducing:
        the hooks this frontend sets are the served Keras's, the other never calls them."""
        roots = {cls.__module__.split(".")[0] for cls in type(obj).__mro__}
        ours, other = ("tf_keras", "keras") if self.legacy else ("keras", "tf_keras")
        if other in roots and ours not in roots:
            if self.legacy:
                served, switch = "tf_keras (TF_USE_LEGACY_KERAS is set)", "unset it"
            else:
                served = "Keras 3 (TF_USE_LEGACY_KERAS is not set)"
                switch = "set TF_USE_LEGACY_KERAS=1 before TensorFlow or Keras is imported"
            raise ValueError(
                f"{what} is a {other} {type(obj).__name__}, but the Keras that collectives "
                f"serves in this process is {served}: its gradients would never be reduced. "
                f"Build it from {ours}, or {switch}"
            )

    # ---- values -----------------------------------------------------------------------

    def value(self, variable: Any) -> Any:
        """A variable's current value, as a backend tensor."""
        value = getattr(variable, "value", variable)
        return value() if callable(value) and not self.is_torch and self.legacy else value

    def reduce(
        self,
        tensors: Sequence[Any],
        op: ReduceOp = ReduceOp.AVERAGE,
        prescale: float = 1.0,
        postscale: float = 1.0,
        name: str | None = None,
        process_set: ProcessSet = global_process_set,
        compression: Any = None,
    ) -> list[Any]:
        """Reduces backend tensors over the ranks, as one grouped op."""
        if not tensors:
            return []
        if self.is_torch:
            import torch

            inputs = [
                t.detach() if isinstance(t, torch.Tensor) else torch.as_tensor(t) for t in tensors
            ]
            handle = ops.submit_allreduce(
                inputs,
                None,
                op,
                prescale,
                postscale,
                process_set,
                name,
                ops.outputs_of,
                blocking=True,
            )
            return list(handle.wait(host=True))
        from collectives.tensorflow import mpi_ops

        kwargs: dict[str, Any] = {}
        if compression is not None:
            kwargs["compression"] = compression
        return mpi_ops.grouped_allreduce(
            list(tensors),
            op=op,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=process_set,
            name=name,
            **kwargs,
        )

    def sum_over_ranks(self, tensor: Any) -> Any:
        """A backend tensor summed over the job's ranks, its gradient the sum of the ranks'
        gradients (Horovod's allreduce gradient): for statistics that training
        differentiates through (``SyncBatchNormalization``)."""
        if self.is_torch:
            return _summed_over_ranks().apply(tensor)
        from collectives.tensorflow import mpi_ops

        return mpi_ops.allreduce(tensor, op=ReduceOp.SUM)

    def broadcast(
        self,
        tensors: Sequence[Any],
        root_rank: int,
        name: str | None = None,
        process_set: ProcessSet = global_process_set,
    ) -> list[Any]:
        """Root's values of backend tensors, as one grouped broadcast."""
        if not tensors:
            return []
        if self.is_torch:
            import torch

            inputs = [torch.as_tensor(t).detach() for t in tensors]
            handle = ops.submit_broadcast(
                inputs, None, root_rank, process_set, name, ops.outputs_of, blocking=True
            )
            return list(handle.wait(host=True))
        from collectives.tensorflow import mpi_ops

        results = []
        for index, tensor in enumerate(tensors):
            label = f"{name}.{index}" if name else None
            results.append(mpi_ops.broadcast(tensor, root_rank, label, process_set=process_set))
        return results

    def broadcast_variables(
        self,
        variables: Sequence[Any],
        root_rank: int,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        """Overwrites every variable with root_rank's value (eagerly)."""
        variables = list(variables)
        if not variables:
            return
        if self.is_torch:
            values = self.broadcast(
                [self.value(v) for v in variables], root_rank, None, process_set
            )
            for variable, value in zip(variables, values, strict=True):
                variable.assign(value)
            return
        from collectives.tensorflow import mpi_ops

        assigned = mpi_ops.broadcast_(
            [_tf_variable(v) for v in variables], root_rank, process_set=process_set
        )
        session = self.session()
        if session is not None:  # a TF1 graph: the assignments only run in its session
            session.run(assigned)

    def session(self) -> Any:
        """The Keras session of tf_keras in TF1 graph mode, else None (eager)."""
        if not self.legacy:
            return None
        import tensorflow as tf

        if tf.executing_eagerly():
            return None
        # tf_keras keeps get_session in its TF1 API only (tf.compat.v1.keras.backend)
        from tf_keras.api._v1.keras import backend as tf1_backend

        return tf1_backend.get_session()

    # ---- numpy and Python values (ops on values: metrics, learning rates) ----------------

    def allreduce_value(
        self,
        value: Any,
        op: ReduceOp,
        name: str | None,
        process_set: ProcessSet,
        prescale: float = 1.0,
        postscale: float = 1.0,
    ) -> Any:
        """Reduces a numpy array or Python number; the same kind of value comes back."""
        array = np.asarray(value)
        (reduced,) = self._numpy_op(
            lambda views: ops.submit_allreduce(
                views,
                None,
                op,
                prescale,
                postscale,
                process_set,
                name,
                ops.outputs_of,
                blocking=True,
            ),
            array,
        )
        return (
            reduced
            if isinstance(value, np.ndarray)
            else reduced.item()
            if reduced.ndim == 0
            else reduced
        )

    def allgather_value(self, value: Any, name: str | None, process_set: ProcessSet) -> Any:
        array = np.asarray(value)
        if array.ndim == 0:
            array = array.reshape(1)
        (gathered,) = self._numpy_op(
            lambda views: ops.submit_allgather(views, process_set, name, ops.outputs_of, True),
            array,
        )
        return gathered

    def broadcast_value(
        self, value: Any, root_rank: int, name: str | None, process_set: ProcessSet
    ) -> Any:
        array = np.asarray(value)
        (result,) = self._numpy_op(
            lambda views: ops.submit_broadcast(
                views, None, root_rank, process_set, name, ops.outputs_of, True
            ),
            array,
        )
        return (
            result
            if isinstance(value, np.ndarray)
            else result.item()
            if result.ndim == 0
            else result
        )

    @staticmethod
    def _numpy_op(submit: Any, array: np.ndarray) -> list[np.ndarray]:
        import torch

        # (ascontiguousarray makes a 0-d array 1-d: shapes are restored after)
        tensor = torch.from_numpy(np.ascontiguousarray(array))
        outputs = [out.numpy() for out in submit([tensor]).wait(host=True)]
        return [out.reshape(array.shape) if out.size == array.size else out for out in outputs]


_summed: Any = None


def _summed_over_ranks() -> Any:
    """The torch autograd function of :meth:`KerasBackend.sum_over_ranks` (made once, on
    first use: this module does not import torch before a backend needs it)."""
    global _summed
    if _summed is None:
        import torch

        def summed(tensor: Any) -> Any:
            return ops.submit_allreduce(
                [tensor.detach().contiguous()],
                None,
                ReduceOp.SUM,
                1.0,
                1.0,
                global_process_set,
                None,
                ops.first_output,
                blocking=True,
            ).wait()

        class SummedOverRanks(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, tensor: Any) -> Any:
                return summed(tensor)

            @staticmethod
            def backward(ctx: Any, grad: Any) -> Any:
                return summed(grad)

        _summed = SummedOverRanks
    return _summed


def _tf_variable(variable: Any) -> Any:
    """The tf.Variable under a Keras 3 variable (itself for tf_keras)."""
    return getattr(variable, "value", variable) if hasattr(variable, "_value") else variable


_current: KerasBackend | None = None


def current() -> KerasBackend:
    """The Keras this process uses (decided once): tf_keras when ``TF_USE_LEGACY_KERAS``
    asks for Keras 2, else Keras 3 on the backend it was configured with."""
    global _current
    if _current is not None:
        return _current
    if os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes"):
        import tf_keras

        _current = KerasBackend(tf_keras, "tensorflow", legacy=True)
        return _current
    import keras

    name = keras.backend.backend()
    if name not in ("tensorflow", "torch"):
        raise RuntimeError(
            f"collectives.keras runs on Keras's TensorFlow and torch backends, not {name!r}: "
            "set KERAS_BACKEND=tensorflow or KERAS_BACKEND=torch"
        )
    _current = KerasBackend(keras, name, legacy=False)
    return _current
