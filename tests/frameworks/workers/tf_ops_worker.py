"""Worker: collectives.tensorflow's ops, gradients and training helpers on 2 or 3 ranks.

Every op runs in eager mode, inside ``tf.function`` and in a TF1 graph (``tf.compat.v1``
session), on values that depend on the rank, and is checked against the exact result.
Gradients are checked against their analytic values; ops issued in a different order on
different ranks inside one ``tf.function`` must still match by name; a tape's reduced
gradients must train a model exactly as one process does on the whole batch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

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

    # mismatched shapes: a CollectiveError naming the op, on every rank
    try:
        hvd.allreduce(tf.ones([r + 1]), name="mismatch")
        c.expect("mismatch.raises", False, "no error")
    except hvd.CollectiveError as error:
        c.expect("mismatch.raises", "mismatch" in str(error) and "shape" in str(error), str(error))

    # ... and inside a tf.function: TensorFlow's error, carrying the op's name and the reason
    @tf.function
    def mismatched(x: tf.Tensor) -> tf.Tensor:
        return hvd.allreduce(x, name="mismatch_in_function")

    try:
        mismatched(tf.ones([r + 1]))
        c.expect("mismatch.function_raises", False, "no error")
    except tf.errors.OpError as error:
        text = str(error.message)
        c.expect("mismatch.function_raises", "mismatch_in_function" in text, text[:400])
    after = hvd.allreduce(tf.ones([2]), op=hvd.Sum, name="after")
    c.expect("mismatch.job_goes_on", np.allclose(after.numpy(), n), after)
    hvd.shutdown()
    c.finish(r)


def _grad(w: tf.Variable, fn: Callable[[tf.Tensor], tf.Tensor]) -> tf.Tensor:
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(fn(w * 1.0))
    return tape.gradient(loss, w)


if __name__ == "__main__":
    main()
