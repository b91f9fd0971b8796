"""Collectives in TensorFlow graphs: ``tf.function`` and TF1-style sessions.

In eager mode an op submits its tensors to the engine and waits for the result right away.
In a graph it becomes three ops:

* a *hand-over*, a ``tf.py_function`` (CPU and GPU kernels, so device tensors stay where they
  are): takes the inputs as torch views and returns at once;
* an *await*: ``DatasetToSingleElement`` over a one-element dataset whose map function
  submits the op and waits for it, as an eager op does. TensorFlow runs that kernel
  asynchronously, on a thread of its own (an unbounded pool), not on one of the graph's
  inter-op threads;
* a *collect*, a ``tf.py_function`` again: yields the outputs (or raises the op's error).

**No deadlock.** TensorFlow runs a graph's independent ops in any order on a small pool of
threads (``inter_op_parallelism_threads``). A collective that held one of those threads while
it waited for its peers could starve the submissions the peers need: every rank would hang,
each blocked on ops the other had not submitted yet. Here nothing on that pool waits: every
op whose inputs are ready is submitted and waited for on a thread of its own, on every rank,
whatever the graph's size, shape or order; Horovod's asynchronous kernels give the same
guarantee. In a ``tf.function`` the ops are left out of the automatic ordering of stateful
ops (they still always run), so an op's wait never holds back the submission of another.

**Names.** Ops are negotiated by name, so a name is fixed when the graph is built: the one
given (under the name scope, as in Horovod), else one derived from the first input tensor's
graph name; a name repeats within a graph with a counter. Every rank that builds the same
graph gets the same names, whatever order the executor runs the ops in.

**Autograph** leaves this package's code alone, as it leaves TensorFlow's and Keras's:
converting it would gain nothing (it has no tensor-dependent Python control flow) and
would cost a conversion for every op's inner functions, each a new object per call (seconds
for a graph of a few dozen ops).

**XLA.** A compiled function (``tf.function(jit_compile=True)``) cannot run Python: an op
built there raises an error naming the op and the setting, at once.

**Errors.** TensorFlow turns an exception inside ``tf.py_function`` into a
``tf.errors.OpError`` that carries its message (see :mod:`.errors` for which type). The
exception itself is kept here, and :func:`collective_failure` gives it back for such an
error, so that ``hvd.elastic.run`` sees the ``HorovodInternalError`` or
``HostsUpdatedInterrupt`` it reacts to.
"""

from __future__ import annotations

import itertools
import re
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf
import torch
from tensorflow.python.autograph.core import config as autograph_config
from tensorflow.python.data.ops import structured_function
from tensorflow.python.ops import control_flow_util, gen_dataset_ops

from collectives.engine.handles import Handle
from collectives.errors import CollectiveError, HorovodInternalError, HostsUpdatedInterrupt
from collectives.tensorflow.errors import as_tensorflow_error
from collectives.tensorflow.tensors import from_torch, to_torch

__all__ = ["collective_failure", "in_graph", "op_name", "run"]

#: Starts an op on the engine from its inputs (torch views), for a caller that waits for it
#: at once (eager mode, or a graph's await); the handle of its result.
Submit = Callable[[list[torch.Tensor]], Handle]
#: Turns a handle's result into the op's outputs (torch tensors).
Collect = Callable[[Any], Sequence[torch.Tensor]]

_NAME_CHARS = re.compile(r"[^A-Za-z0-9_./-]")

autograph_config.CONVERSION_RULES = (
    autograph_config.DoNotConvert("collectives"),
    *autograph_config.CONVERSION_RULES,
)


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
    """``fn`` (a py_function's body), its errors as TensorFlow's types and the collectives'
    exceptions remembered (see :func:`collective_failure`)."""

    def body(*args: Any) -> Any:
        try:
            return fn(*args)
        # TensorFlow puts the traceback of what the body raises into the error's message:
        # without the frames of hvdrun's own machinery below, it names the user's mistake.
        except _FAILURES as error:
            _failure[:] = [error]
            raise as_tensorflow_error(error).with_traceback(None) from None
        except (ValueError, TypeError) as error:
            raise as_tensorflow_error(error).with_traceback(None) from None

    return body


def in_graph() -> bool:
    """Whether ops are being built into a graph (tf.function, TF1) rather than run."""
    return not tf.executing_eagerly()


class _GraphState:
    """What this frontend remembers about one graph while it is built."""

    def __init__(self) -> None:
        self.names: dict[str, itertools.count[int]] = {}
        self.awaiting: Any = None  # the await's map function, traced once per graph


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
    """Runs one op: at once in eager mode, as hand-over, await and collect in a graph."""
    if not in_graph():
        try:
            result = submit([to_torch(t) for t in inputs]).wait(host=True)
        except (*_FAILURES, ValueError, TypeError) as error:
            raise as_tensorflow_error(error) from None
        return [from_torch(out) for out in collect(result)]
    _check_xla(label)

    def hand_over(*tensors: tf.Tensor) -> tf.Tensor:
        key = next(_keys)
        _flights[key] = _Flight([to_torch(t) for t in tensors], submit)
        return tf.constant(key, dtype=tf.int64)

    def collect_now(number: tf.Tensor) -> list[tf.Tensor]:
        flight = _flights.pop(int(number.numpy()))
        if flight.error is not None:
            raise flight.error
        return [from_torch(out) for out in collect(flight.result)]

    graph = tf.compat.v1.get_default_graph()
    number = tf.py_function(hand_over, list(inputs), Tout=tf.int64, name=f"hvd_{label}_inputs")
    done, dataset_ops = _await(graph, number, label)
    outputs = tf.py_function(
        _keeping_failures(collect_now), [done], Tout=list(out_dtypes), name=f"hvd_{label}"
    )
    if not isinstance(outputs, list):
        outputs = [outputs]
    acd = getattr(graph, "experimental_acd_manager", None)
    if acd is not None:  # tf.function: no wait holds back another op's submission
        for op in (number.op, *dataset_ops, outputs[0].op):
            acd.run_independently(op)
    for output, shape in zip(outputs, out_shapes or [None] * len(outputs), strict=True):
        if shape is not None:
            output.set_shape(shape)
    return outputs


def _await(graph: Any, number: tf.Tensor, label: str) -> tuple[tf.Tensor, list[Any]]:
    """``number`` once its op finished (or the op's error): the one op that waits, run by
    TensorFlow off its inter-op threads (see the module's docstring); and the ops built for
    it (TensorFlow counts a source dataset as stateful: a tf.function would order it after
    every earlier one, and so after every earlier op's submission, were it not let off)."""
    state = _state(graph)
    if state.awaiting is None:
        state.awaiting = structured_function.StructuredFunctionWrapper(
            lambda n: tf.py_function(_run, [n], Tout=tf.int64),
            "hvd_await",
            input_structure=tf.TensorSpec([], tf.int64),
        ).function
    function = state.awaiting
    one = gen_dataset_ops.tensor_dataset([number], output_shapes=[[]])
    waited = gen_dataset_ops.map_dataset(
        one,
        function.captured_inputs,
        f=function,
        output_types=[tf.int64],
        output_shapes=[[]],
        use_inter_op_parallelism=False,  # the map runs on the await's own thread
        preserve_cardinality=True,
    )
    (done,) = gen_dataset_ops.dataset_to_single_element(
        waited, output_types=[tf.int64], output_shapes=[[]], name=f"hvd_{label}_await"
    )
    return done, [one.op, waited.op, done.op]


class _Flight:
    """One graph op between the hand-over of its inputs and the collection of its result."""

    __slots__ = ("error", "result", "submit", "views")

    def __init__(self, views: list[torch.Tensor], submit: Submit) -> None:
        self.views: list[torch.Tensor] | None = views
        self.submit = submit
        self.result: Any = None
        self.error: BaseException | None = None


_flights: dict[int, _Flight] = {}  # (dict operations are atomic under the GIL)
_keys = itertools.count(1)


def _run(number: tf.Tensor) -> tf.Tensor:
    """The await's body, off TensorFlow's inter-op threads: submits the op of ``number``
    and waits for it, as an eager op does (its error is raised by the collect, so that
    TensorFlow reports it at the op's own node)."""
    flight = _flights[int(number.numpy())]
    views, flight.views = flight.views, None
    assert views is not None, "a graph op ran twice"
    try:
        flight.result = flight.submit(views).wait(host=True)
    except Exception as error:
        flight.error = error
    return number
