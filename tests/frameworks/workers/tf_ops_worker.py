"""Worker: collectives.tensorflow's ops, gradients and training helpers on 2 or 3 ranks.

Every op runs in eager mode, inside ``tf.function`` and in a TF1 graph (``tf.compat.v1``
session), on values that depend on the rank, and is checked against the exact result.
Gradients are checked against their analytic values; ops issued in a different order on
different ranks inside one ``tf.function`` must still match by name; a tape's reduced
gradients must train a model exactly as one process does on the whole batch.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "collectives" / "workers"))
from checks import Checks

import collectives.tensorflow as hvd

DTYPES = [tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64, tf.uint8]
OPS = {"Sum": hvd.Sum, "Average": hvd.Average, "Min": hvd.Min, "Max": hvd.Max}


def graph_run(fn: Callable[..., Any], *args: np.ndarray) -> Any:
    """``fn`` built into a TF1 graph and run in a session, on constants of ``args``."""
    with tf.Graph().as_default():
        out = fn(*[tf.constant(a) for a in args])
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            return session.run(out)


def modes() -> dict[str, Callable[..., Any]]:
    def eager(fn: Callable[..., Any], *args: np.ndarray) -> Any:
        return tf.nest.map_structure(lambda t: t.numpy(), fn(*[tf.constant(a) for a in args]))

    def function(fn: Callable[..., Any], *args: np.ndarray) -> Any:
        out = tf.function(fn)(*[tf.constant(a) for a in args])
        return tf.nest.map_structure(lambda t: t.numpy(), out)

    return {"eager": eager, "function": function, "graph": graph_run}


def expected_reduce(op: str, values: list[np.ndarray]) -> np.ndarray:
    stacked = np.stack([v.astype(np.float64) for v in values])
    if op == "Sum":
        out = stacked.sum(0)
    elif op == "Average":
        out = stacked.mean(0)
    elif op == "Min":
        out = stacked.min(0)
    else:
        out = stacked.max(0)
    return out


def main() -> None:
    c = Checks()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    everyone = range(n)

    def base(rank: int, dtype: tf.DType) -> np.ndarray:
        return (np.arange(6).reshape(2, 3) + rank + 1).astype(dtype.as_numpy_dtype)

    for mode, run in modes().items():
        for dtype in DTYPES:
            for label, op in OPS.items():
                if dtype == tf.uint8 and label == "Average":
                    continue
                got = run(lambda x, op=op: hvd.allreduce(x, op=op), base(r, dtype))
                want = expected_reduce(label, [base(q, dtype) for q in everyone])
                if not dtype.is_floating:
                    want = np.trunc(want)
                tol = 1e-2 if dtype in (tf.float16, tf.bfloat16) else 1e-6
                ok = got.dtype == dtype.as_numpy_dtype and np.allclose(
                    got.astype(np.float64), want, atol=tol, rtol=tol
                )
                c.expect(f"allreduce.{mode}.{label}.{dtype.name}", ok, f"{got} vs {want}")
        got = run(
            lambda a, b: hvd.grouped_allreduce([a, b], op=hvd.Sum, prescale_factor=2.0),
            base(r, tf.float32),
            base(r, tf.int64),
        )
        want_f = 2 * sum(base(q, tf.float32) for q in everyone)
        want_i = 2 * sum(base(q, tf.int64) for q in everyone)
        c.expect(
            f"grouped_allreduce.{mode}",
            np.allclose(got[0], want_f) and np.array_equal(got[1], want_i),
            got,
        )
        rows = np.full((r + 1, 2), r, dtype=np.int32)
        got = run(lambda x: hvd.allgather(x), rows)
        want = np.concatenate([np.full((q + 1, 2), q, dtype=np.int32) for q in everyone])
        c.expect(f"allgather.{mode}", np.array_equal(got, want), got)
        got = run(lambda a, b: hvd.grouped_allgather([a, b]), rows, rows.astype(np.float64))
        c.expect(f"grouped_allgather.{mode}", np.array_equal(got[1], want.astype(np.float64)), got)
        root = n - 1
        got = run(lambda x, root=root: hvd.broadcast(x, root), base(r, tf.float32))
        c.expect(f"broadcast.{mode}", np.array_equal(got, base(root, tf.float32)), got)
        send = np.arange(n * 2, dtype=np.float32) + 100 * r
        got = run(lambda x: hvd.alltoall(x, splits=[2] * n), send)
        want = np.concatenate(
            [np.arange(2 * r, 2 * r + 2, dtype=np.float32) + 100 * q for q in everyone]
        )
        c.expect(f"alltoall.{mode}", np.array_equal(got[0], want) and list(got[1]) == [2] * n, got)
        scatter_in = np.ones((2 * n + 1, 2), dtype=np.float32) * (r + 1)
        got = run(lambda x: hvd.reducescatter(x, op=hvd.Sum), scatter_in)
        mine = 2 + (1 if r < 1 else 0)
        c.expect(
            f"reducescatter.{mode}",
            got.shape == (mine, 2) and np.allclose(got, sum(q + 1 for q in everyone)),
            got,
        )

    # IndexedSlices: an allgather of values and indices, averaged
    slices = tf.IndexedSlices(tf.ones([1, 2]) * (r + 1), tf.constant([r]), tf.constant([n, 2]))
    reduced = hvd.allreduce(slices)
    dense = tf.convert_to_tensor(reduced).numpy()
    c.expect("indexed_slices", np.allclose(dense[:, 0], [(q + 1) / n for q in everyone]), dense)

    # gradients, eagerly and in tf.function
    w = tf.Variable(np.full(3, float(r + 1), np.float32))

    for where, wrap in (("eager", lambda f: f), ("function", tf.function)):
        g = wrap(lambda: _grad(w, lambda x: hvd.allreduce(x, op=hvd.Sum)))()
        c.expect(f"grad.allreduce.{where}", np.allclose(g, n), g)
        g = wrap(lambda: _grad(w, lambda x: hvd.broadcast(x, 0)))()
        c.expect(f"grad.broadcast.{where}", np.allclose(g, 1.0 if r == 0 else 0.0), g)
        g = wrap(lambda: _grad(w, lambda x: hvd.allgather(tf.reshape(x, [1, 3]))))()
        c.expect(f"grad.allgather.{where}", np.allclose(g, 1.0), g)
        g = wrap(
            lambda: _grad(w, lambda x: hvd.reducescatter(tf.tile(x[None], [n, 1]), op=hvd.Sum))
        )()
        c.expect(f"grad.reducescatter.{where}", np.allclose(g, n * n), g)

    # A broadcast's gradient, then an unnamed op, in one tf.function: the gradient builds
    # the same ops on every rank, so the op after it has the same default name everywhere.
    @tf.function
    def after_broadcast_grad() -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(hvd.broadcast(w, root_rank=0, name="b") * 3.0)
        return hvd.allreduce(tape.gradient(loss, w) * 2.0)

    g = after_broadcast_grad()
    c.expect("grad.broadcast.then_unnamed", np.allclose(g, 6.0 / n), g)

    # hvd.barrier() in a graph is an op that waits each time it runs, not once at tracing:
    # the last rank leaves a mark before it reaches the barrier, which rank 0 then sees.
    where = hvd.broadcast_object(tempfile.mkdtemp() if r == 0 else None)

    def passes(barrier: Callable[[], Any], label: str) -> bool:
        mark = Path(where, label)
        if r == n - 1:
            time.sleep(0.5)
            mark.touch()
        barrier()
        return r != 0 or mark.exists()

    @tf.function
    def wait_all(x: tf.Tensor) -> tf.Tensor:
        hvd.barrier()
        return x + 1

    wait_all(tf.constant(1))  # (traced here)
    c.expect("barrier.function", passes(lambda: wait_all(tf.constant(1)), "function"))
    with tf.Graph().as_default():
        op = hvd.barrier()
        with tf.compat.v1.Session() as session:
            c.expect("barrier.graph", passes(lambda: session.run(op), "graph"))

    # ops issued in a different order on each rank inside one tf.function: names match them
    @tf.function
    def reordered(a: tf.Tensor, b: tf.Tensor) -> Any:
        if r % 2 == 0:
            u = hvd.allreduce(a, name="first", op=hvd.Sum)
            v = hvd.allreduce(b, name="second", op=hvd.Sum)
            x = hvd.allgather(a[:1], name="third")
        else:
            x = hvd.allgather(a[:1], name="third")
            v = hvd.allreduce(b, name="second", op=hvd.Sum)
            u = hvd.allreduce(a, name="first", op=hvd.Sum)
        return u, v, x

    u, v, x = reordered(tf.fill([2], float(r)), tf.fill([3], float(10 * r)))
    total = sum(everyone)
    c.expect(
        "tf_function.reordered",
        np.allclose(u, total) and np.allclose(v, 10 * total) and list(x.numpy()) == list(everyone),
        (u, v, x),
    )

    # a distributed tape trains exactly as one process on the whole batch
    data = np.random.default_rng(0).normal(size=(8 * n, 4)).astype(np.float32)
    target = data @ np.array([1.0, -2.0, 0.5, 3.0], np.float32)
    local = data[r * 8 : (r + 1) * 8], target[r * 8 : (r + 1) * 8]
    w_dist = tf.Variable(np.zeros(4, np.float32))
    w_full = tf.Variable(np.zeros(4, np.float32))
    opt_dist = tf.keras.optimizers.SGD(0.1)
    opt_full = tf.keras.optimizers.SGD(0.1)
    for _ in range(5):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.linalg.matvec(local[0], w_dist) - local[1]) ** 2)
        tape = hvd.DistributedGradientTape(tape)
        opt_dist.apply_gradients(zip(tape.gradient(loss, [w_dist]), [w_dist], strict=True))
        with tf.GradientTape() as tape2:
            loss2 = tf.reduce_mean((tf.linalg.matvec(data, w_full) - target) ** 2)
        opt_full.apply_gradients(zip(tape2.gradient(loss2, [w_full]), [w_full], strict=True))
    c.expect(
        "tape.equals_single_process",
        np.allclose(w_dist.numpy(), w_full.numpy(), atol=1e-5),
        (w_dist.numpy(), w_full.numpy()),
    )

    # broadcast_variables and objects
    var = tf.Variable([float(r)] * 2)
    hvd.broadcast_variables([var], root_rank=n - 1)
    c.expect("broadcast_variables", np.allclose(var.numpy(), n - 1), var.numpy())
    c.expect("allgather_object", hvd.allgather_object({"r": r}) == [{"r": q} for q in everyone])

    # XLA refuses at once, naming the op and the setting
    @tf.function(jit_compile=True)
    def compiled(a: tf.Tensor) -> tf.Tensor:
        return hvd.allreduce(a)

    try:
        compiled(tf.ones(2))
        c.expect("xla.refused", False, "no error")
    except Exception as error:  # TensorFlow wraps it in its own error type
        text = str(error)
        c.expect("xla.refused", "hvd.allreduce" in text and "jit_compile" in text, text[:300])

    dtypes(c, r, n)
    job_ops(c, r, n)
    tf1_adasum(c, r, n)
    if n == 2:  # (what the size does not change: once)
        errors(c, r, n)
        horovod_names(c, r, n)
        local_gradients(c, r, n)
        tf1_accumulation(c, r, n)
    after = hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="after")
    c.expect("errors.job_goes_on", np.allclose(after.numpy(), n), after)
    hvd.shutdown()
    c.finish(r)


def error_of(mode: str, fn: Callable[[], Any]) -> BaseException | None:
    """The exception ``fn``'s ops raise eagerly, in a tf.function or in a TF1 session."""
    try:
        if mode == "eager":
            fn()
        elif mode == "function":
            tf.function(fn)()
        else:
            with tf.Graph().as_default():
                out = fn()
                with tf.compat.v1.Session() as session:
                    session.run(out)
    except Exception as error:
        return error
    return None


def errors(c: Checks, r: int, n: int) -> None:
    """Horovod's TensorFlow error types: FailedPreconditionError for ranks that disagree
    (eagerly; in graphs TensorFlow gives a py_function's ValueError InvalidArgumentError),
    InvalidArgumentError for bad arguments, in every mode; hvdrun's types still catch them."""
    for mode in ("eager", "function", "graph"):
        error = error_of(mode, lambda m=mode: hvd.allreduce(tf.ones([r + 1]), name=f"shape.{m}"))
        text = str(getattr(error, "message", error))
        named = f"shape.{mode}" in text and "shape" in text
        # (no frames of hvdrun's machinery in the message TensorFlow builds from a graph op's
        # traceback: it used to hold some 40 lines of them)
        named = named and "collectives/engine" not in text
        if mode == "eager":
            kind = isinstance(error, tf.errors.FailedPreconditionError) and isinstance(
                error, hvd.TensorMismatchError
            )
        else:
            kind = isinstance(error, tf.errors.InvalidArgumentError)
        c.expect(f"errors.mismatch.{mode}", kind and named, repr(error)[:400])
        error = error_of(mode, lambda m=mode: hvd.broadcast(tf.ones([2]), n + 3, name=f"root.{m}"))
        text = str(getattr(error, "message", error))
        kind = isinstance(error, tf.errors.InvalidArgumentError)
        if mode == "eager":
            kind = kind and isinstance(error, ValueError)
        c.expect(f"errors.root.{mode}", kind and "root_rank" in text, repr(error)[:400])
        error = error_of(
            mode, lambda m=mode: hvd.alltoall(tf.ones([2 * n]), splits=[1] * n, name=f"sp.{m}")
        )
        text = str(getattr(error, "message", error))
        kind = isinstance(error, tf.errors.InvalidArgumentError)
        if mode == "eager":
            kind = kind and isinstance(error, hvd.InvalidArgumentsError)
        c.expect(f"errors.splits.{mode}", kind and "splits" in text, repr(error)[:400])


def dtypes(c: Checks, r: int, n: int) -> None:
    """Every integer, float, complex and bool type moves through allgather, broadcast and
    alltoall; 16- and 32-bit unsigned integers reduce with every op (as numpy computes)."""
    movable = [
        tf.uint8, tf.uint16, tf.uint32, tf.uint64, tf.int8, tf.int16, tf.int32, tf.int64,
        tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.complex64, tf.complex128, tf.bool,
    ]  # fmt: skip
    everyone = range(n)

    def values(rank: int, dtype: tf.DType) -> np.ndarray:
        raw = (np.arange(2 * n) + 3 * rank) % 7
        return raw.astype(dtype.as_numpy_dtype) if dtype != tf.bool else raw % 2 == 1

    for mode, run in modes().items():
        wrong = []
        for dtype in movable:
            mine = values(r, dtype)
            got = run(lambda x: hvd.allgather(x), mine)
            if not np.array_equal(got, np.concatenate([values(q, dtype) for q in everyone])):
                wrong.append(f"allgather {dtype.name}")
            got = run(lambda x: hvd.broadcast(x, n - 1), mine)
            if not np.array_equal(got, values(n - 1, dtype)):
                wrong.append(f"broadcast {dtype.name}")
            got = run(lambda x: hvd.alltoall(x), mine)
            want = np.concatenate([values(q, dtype)[2 * r : 2 * r + 2] for q in everyone])
            if not np.array_equal(got, want):
                wrong.append(f"alltoall {dtype.name}")
            if mode != "eager":  # (the others once: every op and dtype costs a trace)
                break
        c.expect(f"dtypes.moved.{mode}", not wrong, wrong)
    wrong = []
    for dtype in (tf.uint16, tf.uint32):
        big = int(np.iinfo(dtype.as_numpy_dtype).max)
        ranks = [np.array([q + 1, big - q, 7], dtype=dtype.as_numpy_dtype) for q in everyone]
        wide = np.stack([v.astype(np.float64) for v in ranks])
        wants = {
            "Sum": (wide.sum(0) % (big + 1)),
            "Average": np.trunc(wide.mean(0)),
            "Min": wide.min(0),
            "Max": wide.max(0),
        }
        for label, want in wants.items():
            got = hvd.allreduce(tf.constant(ranks[r]), op=OPS[label]).numpy()
            if got.dtype != ranks[r].dtype or not np.array_equal(got.astype(np.float64), want):
                wrong.append(f"{dtype.name} {label}: {got} vs {want}")
    c.expect("dtypes.unsigned_reduced", not wrong, wrong)
    try:
        hvd.allreduce(tf.constant([1], tf.uint64))
        c.expect("dtypes.uint64_reduce_refused", False, "no error")
    except TypeError as error:
        c.expect("dtypes.uint64_reduce_refused", "uint64" in str(error), error)


def job_ops(c: Checks, r: int, n: int) -> None:
    """rank_op and friends are int32 tensors, computed when they run; join returns one."""
    want = [r, n, hvd.local_rank(), hvd.local_size(), -3, 1]  # -3: Horovod's unknown set

    def numbers() -> list[tf.Tensor]:
        return [
            hvd.rank_op(),
            hvd.size_op(),
            hvd.local_rank_op(),
            hvd.local_size_op(),
            hvd.size_op(process_set_id=99),
            hvd.process_set_included_op(),
        ]

    for mode, run in modes().items():
        got = run(lambda: numbers())
        ok = [int(v) for v in got] == want and all(np.asarray(v).dtype == np.int32 for v in got)
        c.expect(f"job_ops.{mode}", ok, (got, want))
    # the process-set forms, on a set of rank 0 alone; a tape over it leaves the other
    # ranks' gradients as they are (Horovod's rule for ranks outside the set)
    alone = hvd.add_process_set([0])
    set_id = alone.process_set_id
    got = [int(hvd.size_op(process_set_id=set_id)), int(hvd.process_set_included_op(set_id))]
    c.expect("job_ops.process_set", got == [1, int(r == 0)], got)
    w = tf.Variable([float(r + 1)])
    with tf.GradientTape() as raw:
        loss = tf.reduce_sum(w * w)
    grad = hvd.DistributedGradientTape(raw, process_set=alone).gradient(loss, [w])[0]
    c.expect("job_ops.tape_outside_set", np.allclose(grad.numpy(), 2 * (r + 1)), grad)
    hvd.remove_process_set(alone)


def horovod_names(c: Checks, r: int, n: int) -> None:
    """Horovod's names that scripts and suites call, with Horovod's behaviour."""
    inside = tf.function(lambda: tf.constant(hvd._executing_eagerly()))()
    c.expect("names.executing_eagerly", hvd._executing_eagerly() and not bool(inside))
    summed = hvd._allreduce(tf.constant([float(r)]))  # (Sum by default, as in Horovod)
    c.expect("names.raw_allreduce_sums", np.allclose(summed.numpy(), sum(range(n))), summed)
    keras_variable = keras.Variable([1.0])
    variables = [tf.Variable([1.0]), [keras_variable]]
    back = hvd.refs_to_vars(hvd.vars_to_refs(variables))
    c.expect("names.refs", back[0] is variables[0] and back[1][0] is keras_variable, back)
    broadcast = hvd.broadcast_object_fn(root_rank=n - 1)
    c.expect("names.broadcast_object_fn", broadcast({"r": r}) == {"r": n - 1})
    c.expect(
        "names.power_of_2",
        [hvd.check_num_rank_power_of_2(k) for k in (1, 2, 3, 4, 6)]
        == [True, True, False, True, False],
    )
    last = hvd.join()
    c.expect("names.join_tensor", isinstance(last, tf.Tensor) and int(last) in range(n), last)


def local_gradients(c: Checks, r: int, n: int) -> None:
    """Local sources keep their own gradient, divided by the size (Horovod's
    scale_local_gradients): a Keras 3 layer's variables and a tf.Variable alike."""
    layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")
    layer.build((None, 1))
    shared = tf.Variable([[1.0]])
    local = tf.Variable([[1.0]])
    x = tf.constant([[float(r + 1)]])
    mean = (n + 1) / 2

    def recorded() -> tuple[tf.GradientTape, tf.Tensor]:
        tape = tf.GradientTape()
        with tape:
            loss = tf.reduce_sum(layer(x)) + tf.reduce_sum((shared + local) * x)
        return tape, loss

    raw, loss = recorded()
    tape = hvd.PartialDistributedGradientTape(raw, local_layers=[layer])
    tape.register_local_source(local)
    grads = [g.numpy().item() for g in tape.gradient(loss, [layer.kernel, shared, local])]
    want = [(r + 1) / n, mean, (r + 1) / n]
    c.expect("local.partial_tape", np.allclose(grads, want), (grads, want))
    raw, loss = recorded()
    tape = hvd.DistributedGradientTape(raw, scale_local_gradients=False)
    tape.register_local_source(layer.kernel)  # a Keras 3 variable (no ref())
    local_pairs, global_pairs = tape.get_local_and_global_gradients(loss, [layer.kernel, shared])
    got = (local_pairs[0][1].numpy().item(), global_pairs[0][1].numpy().item())
    ok = local_pairs[0][0] is layer.kernel and np.allclose(got, [r + 1, mean])
    c.expect("local.unscaled_split", ok, got)


def tf1_accumulation(c: Checks, r: int, n: int) -> None:
    """A TF1 optimizer with backward_passes_per_step=2 and a local variable, in a graph:
    Horovod's algorithm (sum two passes, average over the ranks, apply every second pass;
    the local variable's sum divided by the size). The optimizer is made before the graph,
    and its counter and sums are the graph's local variables (Horovod's: no saver holds
    them, local_variables_initializer initializes them)."""
    opt = hvd.DistributedOptimizer(
        tf.compat.v1.train.GradientDescentOptimizer(0.25), backward_passes_per_step=2
    )
    with tf.Graph().as_default():
        shared = tf.compat.v1.get_variable("shared", initializer=0.0)
        local = tf.compat.v1.get_variable("local", initializer=0.0)
        t = tf.compat.v1.placeholder(tf.float32, [])
        loss = (shared + local - t) ** 2
        step = tf.compat.v1.train.get_or_create_global_step()
        opt.register_local_var(local)
        train = opt.minimize(loss, global_step=step)
        saved = [v.op.name for v in tf.compat.v1.global_variables()]
        kept = [v.op.name for v in tf.compat.v1.local_variables()]
        c.expect(
            "tf1.accumulation_variables_local",
            saved == ["shared", "local", "global_step"] and len(kept) == 3,
            (saved, kept),
        )
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            session.run(tf.compat.v1.local_variables_initializer())
            targets = [1.0 + r, 2.0 + r, 3.0, 1.0]
            for target in targets:
                session.run(train, {t: target})
            got = session.run([shared, local, step])
    # reference: Horovod's algorithm on every rank's targets
    ws, wl = 0.0, [0.0] * n
    for first in (0, 2):
        sums_s, sums_l = [], []
        for q in range(n):
            qt = [1.0 + q, 2.0 + q, 3.0, 1.0]
            g = [2 * (ws + wl[q] - qt[p]) for p in (first, first + 1)]
            sums_s.append(sum(g))
            sums_l.append(sum(g))
        ws -= 0.25 * np.mean(sums_s)
        wl = [w - 0.25 * s / n for w, s in zip(wl, sums_l, strict=True)]
    want = [ws, wl[r], 4]
    c.expect("tf1.accumulated", np.allclose(got, want), (got, want))


#: The TF1 Adasum check's initial weights, and its targets per rank and step.
ADASUM_W0 = np.array([0.5, -1.0, 2.0], np.float32)
ADASUM_OWN0 = np.array([1.0, 0.0], np.float32)


def adasum_targets(rank: int, step: int) -> np.ndarray:
    return np.array([1.0 + rank, 0.5 * step - rank, (rank % 2) * 2.0 - step], np.float32)


def adasum_loss(w: Any, own: Any, t: Any) -> tf.Tensor:
    """Gradients w - t and own - t[:2]."""
    return 0.5 * tf.reduce_sum((w - t) ** 2) + 0.5 * tf.reduce_sum((own - t[:2]) ** 2)


def adasum_reference(vectors: list[np.ndarray]) -> np.ndarray:
    """Adasum over the ranks' vectors: pairs (0,1), (2,3), ... then their results, a node
    without a partner carried up (collectives/adasum.py's order, Horovod's at 2 and 4)."""
    level = [v.astype(np.float64) for v in vectors]
    while len(level) > 1:
        pairs = []
        for a, b in zip(level[0::2], level[1::2], strict=False):
            dot = a @ b
            pairs.append((1 - dot / (2 * (a @ a))) * a + (1 - dot / (2 * (b @ b))) * b)
        level = pairs + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def adasum_momentum_reference(n: int, k: int, steps: int) -> list[list[np.ndarray]]:
    """Horovod's TF1 Adasum optimizer over Momentum(0.1, 0.9), rank by rank: every pass each
    rank steps on its own gradient (loss 0.5 |w - t|^2, 0.5 |own - t[:2]|^2); every k-th
    the changes of w since the last combination (start) are combined with Adasum, and
    start and w become start + the combination; own (a local variable) is never combined."""
    w = [ADASUM_W0.astype(np.float64) for _ in range(n)]
    own = [ADASUM_OWN0.astype(np.float64) for _ in range(n)]
    accum_w = [np.zeros(3) for _ in range(n)]
    accum_own = [np.zeros(2) for _ in range(n)]
    start = ADASUM_W0.astype(np.float64)
    for step in range(steps):
        for q in range(n):
            t = adasum_targets(q, step).astype(np.float64)
            accum_w[q] = 0.9 * accum_w[q] + (w[q] - t)
            w[q] = w[q] - 0.1 * accum_w[q]
            accum_own[q] = 0.9 * accum_own[q] + (own[q] - t[:2])
            own[q] = own[q] - 0.1 * accum_own[q]
        if step % k == k - 1:
            start = start + adasum_reference([w[q] - start for q in range(n)])
            w = [start.copy() for _ in range(n)]
    return [[w[q], own[q]] for q in range(n)]


def tf1_adasum(c: Checks, r: int, n: int) -> None:
    """A TF1 optimizer with op=hvd.Adasum combines model deltas, as Horovod's does: Momentum
    steps each rank on its own gradients, and every k-th pass the weights' changes since
    the last combination are Adasum-combined (the local variable's are not), in a TF1
    graph and session and eagerly, with k=1 and k=2; against the numpy reference. The
    start copies and the step counter are global, non-trainable variables of the graph,
    which global_variables_initializer initializes."""
    steps = 4
    for k in (1, 2):
        want = adasum_momentum_reference(n, k, steps)[r]
        want.append(np.array(steps))
        opt = hvd.DistributedOptimizer(
            tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
            op=hvd.Adasum,
            backward_passes_per_step=k,
        )
        with tf.Graph().as_default():  # (the optimizer made before its graph)
            w = tf.compat.v1.get_variable("w", initializer=ADASUM_W0)
            own = tf.compat.v1.get_variable("own", initializer=ADASUM_OWN0)
            t = tf.compat.v1.placeholder(tf.float32, [3])
            loss = adasum_loss(w, own, t)
            global_step = tf.compat.v1.train.get_or_create_global_step()
            opt.register_local_var(own)
            train = opt.minimize(loss, global_step=global_step)
            trainable = [v.op.name for v in tf.compat.v1.trainable_variables()]
            saved = [v.op.name for v in tf.compat.v1.global_variables()]
            if k == 2:
                extra = sorted(set(saved) - {"w", "own", "global_step"})
                c.expect(
                    "tf1.adasum_variables_global",
                    trainable == ["w", "own"]
                    and len(extra) == 4  # w's start copy, the counter, two momentum slots
                    and opt.get_slot(w, "delta_start") is not None
                    and opt.get_slot(own, "delta_start") is None
                    and not tf.compat.v1.local_variables(),
                    (trainable, saved),
                )
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                for step in range(steps):
                    session.run(train, {t: adasum_targets(r, step)})
                got = session.run([w, own, global_step])
        ok = all(np.allclose(a, b, atol=1e-5) for a, b in zip(got, want, strict=True))
        c.expect(f"tf1.adasum_deltas.graph.k{k}", ok, (got, want))

        opt = hvd.DistributedOptimizer(
            tf.compat.v1.train.MomentumOptimizer(0.1, 0.9),
            op=hvd.Adasum,
            backward_passes_per_step=k,
        )
        w_e = tf.Variable(ADASUM_W0)
        own_e = tf.Variable(ADASUM_OWN0)
        opt.register_local_var(own_e)
        step_e = tf.Variable(0, dtype=tf.int64)
        for step in range(steps):
            target = tf.constant(adasum_targets(r, step))
            loss_now = functools.partial(adasum_loss, w_e, own_e, target)  # (a callable)
            opt.minimize(loss_now, var_list=[w_e, own_e], global_step=step_e)
        got = [w_e.numpy(), own_e.numpy(), step_e.numpy()]
        ok = all(np.allclose(a, b, atol=1e-5) for a, b in zip(got, want, strict=True))
        c.expect(f"tf1.adasum_deltas.eager.k{k}", ok, (got, want))


def _grad(w: tf.Variable, fn: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(fn(w * 1.0))
    return tape.gradient(loss, w)


if __name__ == "__main__":
    main()
