"""Collectives in TensorFlow graphs: ``tf.function`` and TF1-style sessions.

In eager mode an op submits its tensors to the engine and waits for the result right away.
In a graph it becomes two ``tf.py_function`` ops (which have CPU and GPU kernels): a
*submit* that hands the inputs to the engine and yields a handle at once, and a *wait*
that yields the result. Three things make that safe:

* **Names.** Ops are negotiated by name, so a name is fixed when the graph is built: the one
  given (under the name scope, as in Horovod), else one derived from the first input
  tensor's graph name; a name repeats within a graph with a counter. Every rank that builds
  the same graph gets the same names, whatever order the graph executor runs the ops in.
* **Order.** The executor may run independent ops in a different order on each rank, and a
  rank whose threads all block on results its peers have not submitted yet would never
  submit the ops they wait for. So no wait runs before the submits of its graph that do not
  depend on it: each new submit becomes a control input of the earlier waits whose results
  nothing has used yet, and inside ``tf.function`` the waits are left out of the automatic
  ordering of stateful ops (submits keep their program order). Ranks may then issue
  independent ops in any order.
* **XLA.** A compiled function (``tf.function(jit_compile=True)``) cannot run Python: an op
  built there raises an error naming the op and the setting, at once.
* **Errors.** TensorFlow turns an exception inside ``tf.py_function`` into a
  ``tf.errors.OpError`` that carries its message: a lost peer reaches the caller of a
  ``tf.function`` (or of Keras ``fit``) as one. The exception itself is kept here, and
  :func:`collective_failure` gives it back for such an error, so that ``hvd.elastic.run``
  sees the ``HorovodInternalError`` or ``HostsUpdatedInterrupt`` it reacts to.
"""

from __future__ import annotations

import itertools
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
import torch
from tensorflow.python.ops import control_flow_util

from collectives.engine import handles
from collectives.engine.handles import Handle
from collectives.errors import CollectiveError, HorovodInternalError, HostsUpdatedInterrupt
from collectives.tensorflow.tensors import from_torch, to_torch

__all__ = ["collective_failure", "in_graph", "op_name", "run"]

#: Starts an op on the engine from its inputs (torch views); the handle of its result.
Submit = Callable[[list[torch.Tensor]], Handle]
#: Turns a handle's result into the op's outputs (torch tensors).
Collect = Callable[[Any], Sequence[torch.Tensor]]

_NAME_CHARS = re.compile(r"[^A-Za-z0-9_./-]")


_FAILURES = (HorovodInternalError, HostsUpdatedInterrupt, CollectiveError)
#: The exception of the collective that failed last inside a graph (None: none since taken).
_failure: list[BaseException] = []


def collective_failure(error: BaseException) -> BaseException | None:
    """The collective's exception behind ``error``, a ``tf.errors.OpError`` raised by a
    graph whose collective failed (and forgets it); None for any other error."""
    if not isinstance(error, tf.errors.OpError) or not _failure:
        return None
    failure = _failure.pop()
    _failure.clear()
    return failure if str(failure) in str(error.message) else None


def _keeping_failures(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a py_function's body), remembering the collectives' exceptions it raises."""

    def body(*args: Any) -> Any:
        try:
            return fn(*args)
        except _FAILURES as error:
            _failure[:] = [error]
            raise

    return body


def in_graph() -> bool:
    """Whether ops are being built into a graph (tf.function, TF1) rather than run."""
    return not tf.executing_eagerly()


class _GraphState:
    """What this frontend remembers about one graph while it is built."""

    def __init__(self) -> None:
        self.names: dict[str, itertools.count[int]] = {}
        self.open_waits: list[Any] = []  # waits whose results nothing has used yet


_graphs: weakref.WeakKeyDictionary[Any, _GraphState] = weakref.WeakKeyDictionary()


def _state(graph: Any) -> _GraphState:
    state = _graphs.get(graph)
    if state is None:
        state = _graphs[graph] = _GraphState()
    return state


def op_name(
    kind: str, name: str | None, tensors: Sequence[tf.Tensor], ignore_name_scope: bool = False
) -> str | None:
    """The negotiated name of an op built into the current graph (None in eager mode: the
    engine counts unnamed ops)."""
    if not in_graph():
        return name
    graph = tf.compat.v1.get_default_graph()
    if name is None:
        first = tensors[0].name if tensors and hasattr(tensors[0], "name") else kind
        base = f"{kind}.{first}"
    else:
        scope = "" if ignore_name_scope else graph.get_name_scope()
        base = f"{scope}/{name}" if scope else name
    base = _NAME_CHARS.sub("_", base)
    counter = _state(graph).names.setdefault(base, itertools.count())
    k = next(counter)
    return base if k == 0 else f"{base}_{k}"


def _check_xla(label: str) -> None:
    if control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()):
        raise ValueError(
            f"hvd.{label}: collectives cannot run inside an XLA-compiled function "
            "(tf.function(jit_compile=True), or Keras compile(jit_compile=True)): they run "
            "in Python (tf.py_function), which XLA cannot compile. Call the op outside the "
            "compiled function, or set jit_compile=False"
        )


def run(
    label: str,
    inputs: Sequence[tf.Tensor],
    submit: Submit,
    collect: Collect,
    out_dtypes: Sequence[tf.DType],
    out_shapes: Sequence[Any] | None = None,
) -> list[tf.Tensor]:
    """Runs one op: at once in eager mode, as submit and wait ops in a graph."""
    if not in_graph():
        handle = submit([to_torch(t) for t in inputs])
        return [from_torch(out) for out in collect(handle.wait())]
    _check_xla(label)

    def submit_now(*tensors: tf.Tensor) -> tf.Tensor:
        handle = submit([to_torch(t) for t in tensors])
        return tf.constant(handles.register(handle), dtype=tf.int64)

    def wait_now(number: tf.Tensor) -> list[tf.Tensor]:
        handle = handles.release(int(number.numpy()))
        assert handle is not None, "a collective's handle was waited on twice"
        return [from_torch(out) for out in collect(handle.wait())]

    graph = tf.compat.v1.get_default_graph()
    state = _state(graph)
    number = tf.py_function(
        _keeping_failures(submit_now), list(inputs), Tout=tf.int64, name=f"hvd_{label}_submit"
    )
    submit_op = number.op
    still_open = []
    for wait_op in state.open_waits:
        if any(output.consumers() for output in wait_op.outputs) or wait_op._control_outputs:
            continue  # its result is used: whatever comes later may depend on it
        wait_op._add_control_inputs([submit_op])
        still_open.append(wait_op)
    outputs = tf.py_function(
        _keeping_failures(wait_now), [number], Tout=list(out_dtypes), name=f"hvd_{label}_wait"
    )
    if not isinstance(outputs, list):
        outputs = [outputs]
    wait_op = outputs[0].op if outputs else None
    if wait_op is not None:
        acd = getattr(graph, "experimental_acd_manager", None)
        if acd is not None:  # tf.function: the waits are not ordered with stateful ops
            acd.run_independently(wait_op)
        still_open.append(wait_op)
    state.open_waits = still_open
    for output, shape in zip(outputs, out_shapes or [None] * len(outputs), strict=True):
        if shape is not None:
            output.set_shape(shape)
    return outputs
