"""Worker: collectives.keras with ``model.fit`` on the Keras in use (Keras 3 on
``KERAS_BACKEND``, or tf_keras with ``TF_USE_LEGACY_KERAS=1``).

Every rank starts from different weights and trains on its own shard: after ``fit`` with
the broadcast callback and the distributed optimizer every rank must hold identical
weights, the logged metrics must be the ranks' average, and the warmup callback must set
the learning rates Horovod's formula gives. Then: the ops on values, ``backward_passes_per_step``
against Horovod's algorithm (summed or averaged, local layers scaled or not, an inf
gradient, sparse gradients as dense), ``PartialDistributedOptimizer`` and the broadcast
callback's ``local_variables``, ``SyncBatchNormalization`` against BatchNormalization on the
whole batch, a model in torch's DistributedDataParallel and a ``DistributedGradientTape``
(their gradients not reduced twice), ``load_model``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "collectives" / "workers"))
from checks import Checks

import collectives.keras as hvd

keras = hvd._bridge.keras  # (tf_keras or keras)


def weights_of(model: object) -> np.ndarray:
    return np.concatenate([np.asarray(w).ravel() for w in model.get_weights()])  # type: ignore[attr-defined]


def main() -> None:
    c = Checks()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    print(f"keras: {hvd.backend()}", flush=True)
    keras.utils.set_random_seed(100 + r)  # every rank starts from other weights
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * n, 8)).astype("float32")
    y = (x.sum(1) > 0).astype("int32")
    shard = slice(r * 64, (r + 1) * 64)

    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
    )
    base_lr = 0.01
    optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(base_lr * n, momentum=0.9))
    model.compile(
        optimizer,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(base_lr * n, warmup_epochs=2, steps_per_epoch=4),
    ]
    history = model.fit(x[shard], y[shard], batch_size=16, epochs=3, callbacks=callbacks, verbose=0)
    weights = hvd.allgather_object(weights_of(model))
    c.expect("fit.identical_weights", all(np.array_equal(weights[0], w) for w in weights))
    losses = [float(v) for v in history.history["loss"]]
    every = hvd.allgather_object(losses)
    c.expect("fit.metrics_averaged", all(np.allclose(every[0], other) for other in every), every)
    # the warmup: lr(epoch e, last batch) = initial/size * ((e + 1) * (size - 1) / 2 + 1)
    lrs = [float(v) for v in history.history["lr"]]
    want = [base_lr * n / n * (min(e + 1, 2) * (n - 1) / 2 + 1) for e in range(3)]
    want[2] = lrs[1]  # after the warmup the rate stays where the warmup left it
    c.expect("fit.warmup_rates", np.allclose(lrs, want, rtol=1e-5), (lrs, want))

    momentum_correction(c, r, n)
    vector_metric(c, r, n)
    broadcast_built_on_one_rank(c, r, x[shard], y[shard])

    # ops on values: numbers, numpy arrays
    c.expect("ops.allreduce_number", np.isclose(hvd.allreduce(float(r), op=hvd.Sum), sum(range(n))))
    gathered = hvd.allgather(np.full((r + 1,), r, np.int32))
    c.expect(
        "ops.allgather", list(gathered) == [q for q in range(n) for _ in range(q + 1)], gathered
    )
    c.expect("ops.broadcast", hvd.broadcast(np.arange(3) + r, n - 1).tolist() == [n - 1, n, n + 1])

    accumulation(c, r, n)
    if not hvd._bridge.is_torch:
        tape_and_optimizer(c, r, n)
    sync_batch_norm(c, r, n)

    # a model that torch's DistributedDataParallel wraps (Keras's recipe on torch): its
    # gradients arrive averaged over the ranks and are not reduced again (op=Sum would show)
    if hvd._bridge.is_torch:
        import torch
        from torch.nn.parallel import DistributedDataParallel

        inner = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1, use_bias=False)])
        inner.layers[0].set_weights([np.zeros((1, 1), np.float32)])
        ddp = DistributedDataParallel(inner)
        plain = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum)
        ddp(torch.full((1, 1), float(r + 1))).mean().backward()  # d/dw = r + 1
        plain.apply([v.value.grad for v in inner.trainable_variables], inner.trainable_variables)
        got = float(np.asarray(inner.get_weights()[0]).ravel()[0])
        c.expect("ddp.not_reduced_twice", np.isclose(got, -(n + 1) / 2), got)

    # load_model wraps the loaded model's optimizer
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.keras" if not hvd._bridge.legacy else "model.h5")
        model.save(path)
        loaded = hvd.load_model(path)
        c.expect("load_model.distributed", getattr(loaded.optimizer, "_hvd_distributed", False))
        # An optimizer class of one's own, named in custom_optimizers (Horovod's keywords).
        mine = type("OwnSGD", (keras.optimizers.SGD,), {})
        model.compile(optimizer=mine(0.1), loss="mse")
        model.save(path)
        loaded = hvd.load_model(path, custom_optimizers=[mine], legacy_opts=False)
        c.expect(
            "load_model.custom_optimizer",
            isinstance(loaded.optimizer, mine)
            and getattr(loaded.optimizer, "_hvd_distributed", False),
            type(loaded.optimizer),
        )
    hvd.shutdown()
    c.finish(r)


def momentum_correction(c: Checks, r: int, n: int) -> None:
    """The warmup's momentum correction, batch by batch, against SGD with momentum in numpy:
    at each batch the momentum is scaled by the rate's change (Keras 3's compiled step reads
    a Python momentum once, when traced: the correction must reach it all the same)."""
    rng = np.random.default_rng(1)
    xs = rng.normal(size=(n, 8, 3)).astype("float32")
    ys = rng.normal(size=(n, 8, 1)).astype("float32")
    w0 = np.array([[0.5], [-0.3], [0.2]], "float32")
    lr, momentum, steps, epochs, warmup = 0.1 * n, 0.9, 2, 3, 2
    w, buffer, rate = w0.astype(np.float64), np.zeros((3, 1)), lr
    for epoch in range(epochs):
        for step in range(steps):
            rows = slice(step * 4, step * 4 + 4)
            x, y = xs[:, rows], ys[:, rows]
            grad = sum(2 * x[q].T @ (x[q] @ w - y[q]) / 4 for q in range(n)) / n
            factor = momentum
            if epoch < warmup:
                new = lr / n * ((epoch + (step + 1) / steps) * (n - 1) / warmup + 1)
                factor, rate = momentum * new / rate, new
            buffer = factor * buffer - rate * grad
            w = w + buffer
    # the same under a LossScaleOptimizer (mixed precision's): the momentum is its inner
    # optimizer's (the scale, a power of two, leaves these float32 gradients as they are)
    for check, scaled in (("fit.momentum_corrected", False), ("fit.momentum_scaled_too", True)):
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, use_bias=False)])
        model.layers[0].set_weights([w0])
        optimizer = hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=momentum))
        if scaled:
            optimizer = keras.mixed_precision.LossScaleOptimizer(optimizer)
        model.compile(optimizer=optimizer, loss="mse")
        warm = hvd.callbacks.LearningRateWarmupCallback(lr, warmup_epochs=warmup)
        x, y = xs[r], ys[r]
        model.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0, callbacks=[warm])
        got = np.asarray(model.get_weights()[0], np.float64)
        c.expect(check, np.allclose(got, w, rtol=1e-4, atol=1e-5), (got, w))


def broadcast_built_on_one_rank(c: Checks, r: int, x: np.ndarray, y: np.ndarray) -> None:
    """A model built, with its optimizer's slots, on rank 0 only before fit (Horovod's resume
    recipe loads a checkpoint there): every rank broadcasts at the same moment, once every
    rank has the variables, and all end alike."""
    model = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(2)])  # (no input shape)
    optimizer = hvd.DistributedOptimizer(keras.optimizers.Adam(0.01))
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if r == 0:
        model.build((None, x.shape[1]))
        optimizer.build(model.trainable_variables)
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(0)
    model.fit(x, y, batch_size=16, epochs=1, callbacks=[callback], verbose=0)
    weights = hvd.allgather_object(weights_of(model))
    same = all(np.array_equal(weights[0], w) for w in weights)
    c.expect("fit.broadcast_built_on_one_rank", same)
    # An elastic state cannot sync a model built on some ranks only: it says so on every rank.
    model = keras.Sequential([keras.layers.Dense(4)])
    if r == 0:
        model.build((None, x.shape[1]))
    try:
        hvd.elastic.KerasState(model, epoch=0).sync()
        said = ""
    except ValueError as error:
        said = str(error)
    c.expect("elastic.sync_needs_built_models", "build the model before" in said, said)


def vector_metric(c: Checks, r: int, n: int) -> None:
    """A metric whose value is an array (F1Score(average=None) logs one per class) is
    averaged over the ranks too, element by element; a None counts for nothing."""

    class PerClass(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            assert logs is not None
            logs["per_class"] = np.array([r, 10 * r], "float32")
            logs["not_on_rank_0"] = None if r == 0 else float(r)
            logs["on_no_rank"] = None
            # logs that differ between the ranks stall none of them
            logs["vector_not_on_rank_0"] = None if r == 0 else np.array([r, r])
            if r == n - 1:
                logs["only_on_the_last"] = float(r)
            logs["text_on_rank_0"] = "n/a" if r == 0 else float(r)
            logs["shape_by_rank"] = np.arange(r + 1, dtype="float32")

    seen: list[object] = []

    class Seen(keras.callbacks.Callback):
        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            assert logs is not None
            seen.append(logs["per_class"])
            seen.append((logs["not_on_rank_0"], logs["on_no_rank"]))
            seen.append(
                (
                    logs["vector_not_on_rank_0"],
                    logs.get("only_on_the_last"),
                    logs["text_on_rank_0"],
                    logs["shape_by_rank"],
                )
            )

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
    model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    callbacks = [PerClass(), hvd.callbacks.MetricAverageCallback(), Seen()]
    model.fit(np.ones((2, 1)), np.ones((2, 1)), verbose=0, callbacks=callbacks)
    mean = (n - 1) / 2
    c.expect("fit.vector_metric_averaged", np.allclose(seen[0], [mean, 10 * mean]), seen)
    # None: no value on that rank (the average of the ranks that have one, or None)
    c.expect("fit.none_metric", seen[1] == (n / 2, None), seen)
    vector, only, text, shaped = seen[2]
    c.expect("fit.none_vector_metric", np.allclose(vector, [n / 2, n / 2]), seen)
    c.expect("fit.metric_of_one_rank", only == (float(n - 1) if r == n - 1 else None), seen)
    # not averageable together: each rank keeps its own
    c.expect("fit.text_metric_kept", text == ("n/a" if r == 0 else float(r)), seen)
    c.expect("fit.shapes_kept", np.array_equal(shaped, np.arange(r + 1)), seen)


LR = 0.25
PASSES = 4


def two_inputs() -> tuple[object, object, object]:
    """y = shared(a) + local(b): two one-weight layers, so that one can be local."""
    inp = keras.Input((2,))
    shared = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros", name="shared")
    local = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros", name="local")
    return keras.Model(inp, shared(inp[:, :1]) + local(inp[:, 1:])), shared, local


def data(rank: int, inf_at: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Pass p of rank q: a = 1 + p % 2, b = 1 + q, target q + p + 1 (inf at ``inf_at``)."""
    x = np.array([[1 + p % 2, 1 + rank] for p in range(PASSES)], np.float32)
    y = np.array([[rank + p + 1] for p in range(PASSES)], np.float32)
    if inf_at is not None and inf_at[0] == rank:
        y[inf_at[1], 0] = np.inf
    return x, y


def reference(
    n: int,
    k: int,
    average: bool,
    local: bool,
    scale_local: bool,
    shared0: float = 0.0,
    local0: Callable[[int], float] = lambda q: 0.0,
    inf_at: tuple[int, int] | None = None,
    passes: int = PASSES,
) -> list[tuple[float, float]]:
    """Horovod's algorithm (horovod/tensorflow/gradient_aggregation_eager.py) on the data of
    every rank: each pass adds its gradients to the rank's sums; every k-th pass averages
    the sums over the ranks (a local weight keeps its own, divided by the size unless
    scale_local is off), divides by k with average, and steps SGD. Every rank's weights."""
    ws = [np.float32(shared0)] * n
    wl = [np.float32(local0(q)) for q in range(n)]
    for first in range(0, passes, k):
        sums = []
        for q in range(n):
            x, y = data(q, inf_at)
            total = [np.float32(0), np.float32(0)]
            for p in range(first, first + k):
                residual = 2 * (ws[q] * x[p, 0] + wl[q] * x[p, 1] - y[p, 0])
                total = [total[0] + residual * x[p, 0], total[1] + residual * x[p, 1]]
            sums.append(total)
        mean = [np.mean([t[0] for t in sums]), np.mean([t[1] for t in sums])]
        for q in range(n):
            g_local = sums[q][1] / (n if scale_local else 1) if local else mean[1]
            step = [mean[0], g_local]
            if average:
                step = [g / k for g in step]
            ws[q] = np.float32(ws[q] - LR * step[0])
            wl[q] = np.float32(wl[q] - LR * step[1])
    return list(zip(ws, wl, strict=True))


def kernels(shared: object, local: object) -> tuple[float, float]:
    return (
        float(np.asarray(shared.get_weights()[0]).ravel()[0]),  # type: ignore[attr-defined]
        float(np.asarray(local.get_weights()[0]).ravel()[0]),  # type: ignore[attr-defined]
    )


def accumulation(c: Checks, r: int, n: int) -> None:
    """backward_passes_per_step=2 against Horovod's algorithm: summed or averaged, with a
    local layer (scaled or not), an inf gradient in one pass, sparse gradients as dense."""
    # a local layer of a PartialDistributedOptimizer, not broadcast by the callback
    model, shared, local = two_inputs()
    shared.set_weights([np.full((1, 1), 0.5 + r, np.float32)])  # rank 0's is broadcast
    local.set_weights([np.full((1, 1), float(r), np.float32)])  # each rank keeps its own
    opt = hvd.PartialDistributedOptimizer(
        keras.optimizers.SGD(LR), backward_passes_per_step=2, local_layers=[local]
    )
    model.compile(opt, "mse")
    callback = hvd.callbacks.BroadcastGlobalVariablesCallback(
        0, local_variables=local.trainable_weights
    )
    model.fit(*data(r), batch_size=1, shuffle=False, verbose=0, callbacks=[callback])
    want = reference(n, 2, False, True, True, 0.5, float)[r]
    got = kernels(shared, local)
    c.expect("accumulate.sum.partial", np.allclose(got, want, rtol=1e-6), (got, want))
    # register_local_var, averaged, local gradients unscaled
    model, shared, local = two_inputs()
    opt = hvd.DistributedOptimizer(
        keras.optimizers.SGD(LR),
        backward_passes_per_step=2,
        average_aggregated_gradients=True,
        scale_local_gradients=False,
    )
    opt.register_local_var(local.kernel)
    model.compile(opt, "mse")
    model.fit(*data(r), batch_size=1, shuffle=False, verbose=0)
    want = reference(n, 2, True, True, False)[r]
    got = kernels(shared, local)
    c.expect("accumulate.average.local", np.allclose(got, want, rtol=1e-6), (got, want))
    # an inf gradient in the first pass of rank 0 (the update it reaches: +inf on every rank)
    model, shared, local = two_inputs()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR), backward_passes_per_step=2)
    model.compile(opt, "mse")
    x, y = data(r, (0, 0))
    model.fit(x[:2], y[:2], batch_size=1, shuffle=False, verbose=0)
    want = reference(n, 2, False, False, True, inf_at=(0, 0), passes=2)[r]
    got = kernels(shared, local)
    c.expect("accumulate.inf", np.array_equal(got, want) and np.isinf(got).all(), (got, want))
    # sparse gradients (an embedding's) as dense, averaged
    embedding = keras.layers.Embedding(4, 1, embeddings_initializer="zeros")
    model = keras.Sequential([keras.Input((1,), dtype="int32"), embedding, keras.layers.Flatten()])
    opt = hvd.DistributedOptimizer(
        keras.optimizers.SGD(LR),
        backward_passes_per_step=2,
        average_aggregated_gradients=True,
        sparse_as_dense=True,
    )
    model.compile(opt, "mse")
    rows = np.array([[(r + p) % 4] for p in range(PASSES)], np.int32)
    targets = np.array([[r + p + 1] for p in range(PASSES)], np.float32)
    model.fit(rows, targets, batch_size=1, shuffle=False, verbose=0)
    table = np.zeros(4, np.float32)
    for first in (0, 2):
        sums = np.zeros((n, 4), np.float32)
        for q in range(n):
            for p in (first, first + 1):
                row = (q + p) % 4
                sums[q, row] += 2 * (table[row] - (q + p + 1))
        table = table - LR * sums.mean(0) / 2
    got_table = np.asarray(embedding.get_weights()[0]).ravel()
    c.expect("accumulate.sparse_as_dense", np.allclose(got_table, table), (got_table, table))
    # a local embedding: its sparse gradients (tf.IndexedSlices on TensorFlow) stay on the
    # rank, divided by the size (scale_local_gradients, Horovod's default)
    embedding = keras.layers.Embedding(4, 1, embeddings_initializer="zeros")
    model = keras.Sequential([keras.Input((1,), dtype="int32"), embedding, keras.layers.Flatten()])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(LR))
    opt.register_local_var(embedding.embeddings)
    model.compile(opt, "mse")
    model.fit(rows, targets, batch_size=1, shuffle=False, verbose=0)
    table = np.zeros(4, np.float32)
    for p in range(PASSES):
        row = (r + p) % 4
        table[row] -= LR * 2 * (table[row] - (r + p + 1)) / n
    got_table = np.asarray(embedding.get_weights()[0]).ravel()
    c.expect("sparse.local_scaled", np.allclose(got_table, table), (got_table, table))


def tape_and_optimizer(c: Checks, r: int, n: int) -> None:
    """A DistributedGradientTape's gradients given to a DistributedOptimizer are reduced
    once (op=Sum would show a second reduction as a factor of the size), eagerly, in a
    tf.function and accumulated over two passes; a plain tape's are still reduced."""
    import tensorflow as tf

    import collectives.tensorflow as hvd_tf

    total = n * (n + 1) / 2  # the sum over the ranks of each rank's gradient, r + 1
    layer = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
    layer.build((None, 1))
    variables = layer.trainable_variables
    x = tf.constant([[float(r + 1)]])

    def grads(distributed: bool) -> list[object]:
        with tf.GradientTape() as raw:
            loss = tf.reduce_sum(layer(x))  # d/dw = r + 1
        tape = hvd_tf.DistributedGradientTape(raw, op=hvd.Sum) if distributed else raw
        return tape.gradient(loss, variables)

    def kernel() -> float:
        return float(np.asarray(layer.get_weights()[0]).ravel()[0])

    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), op=hvd.Sum)
    opt.apply_gradients(zip(grads(True), variables, strict=True))
    c.expect("tape.reduced_once", np.isclose(kernel(), -total), (kernel(), -total))
    opt.apply_gradients(zip(grads(False), variables, strict=True))
    c.expect("tape.plain_reduced", np.isclose(kernel(), -2 * total), (kernel(), -2 * total))

    @tf.function
    def step() -> None:
        opt.apply_gradients(zip(grads(True), variables, strict=True))

    step()
    c.expect("tape.traced_once", np.isclose(kernel(), -3 * total), (kernel(), -3 * total))
    # two passes summed (Horovod's default), each pass's gradients reduced by the tape
    layer.set_weights([np.zeros((1, 1), np.float32)])
    accumulating = hvd.DistributedOptimizer(
        keras.optimizers.SGD(1.0), op=hvd.Sum, backward_passes_per_step=2
    )
    for _ in range(2):
        accumulating.apply_gradients(zip(grads(True), variables, strict=True))
    c.expect("tape.accumulated", np.isclose(kernel(), -2 * total), (kernel(), -2 * total))


def sync_batch_norm(c: Checks, r: int, n: int) -> None:
    """hvd.SyncBatchNormalization (Horovod's arguments) normalises with every rank's batch:
    its output, moving statistics and input gradient are those of BatchNormalization on the
    whole batch in one process."""
    batches = [np.arange(12, dtype=np.float32).reshape(4, 3) * (q + 1) + q for q in range(n)]
    sync = hvd.SyncBatchNormalization(fused=False, momentum=0.5)
    plain = keras.layers.BatchNormalization(momentum=0.5)
    out, grad = forward_and_grad(sync, batches[r], 4 * r)
    whole_out, whole_grad = forward_and_grad(plain, np.concatenate(batches), 0)
    rows = slice(4 * r, 4 * r + 4)
    ok = np.allclose(out, whole_out[rows], atol=1e-5) and np.allclose(
        grad, whole_grad[rows], atol=1e-5
    )
    c.expect("sync_batch_norm.output_and_grad", ok, (out, whole_out[rows], grad, whole_grad[rows]))
    moving = [np.asarray(w) for w in sync.get_weights()[2:]]
    whole_moving = [np.asarray(w) for w in plain.get_weights()[2:]]
    ok = all(np.allclose(a, b, rtol=1e-5) for a, b in zip(moving, whole_moving, strict=True))
    c.expect("sync_batch_norm.moving_statistics", ok, (moving, whole_moving))
    c.expect("sync_batch_norm.name", sync.name.startswith("sync_batch_normalization"), sync.name)
    # unnamed layers take unique names: a model holds several (a ResNet's)
    layers = [hvd.SyncBatchNormalization(), hvd.SyncBatchNormalization()]
    several = keras.Sequential([keras.Input((2,)), *layers])
    names = [layer.name for layer in several.layers]
    unique = len(set(names)) == 2 and all(n.startswith("sync_batch_normalization") for n in names)
    c.expect("sync_batch_norm.unique_names", unique, names)
    try:
        hvd.SyncBatchNormalization(fused=True)
        c.expect("sync_batch_norm.fused_refused", False, "no error")
    except ValueError as error:
        c.expect("sync_batch_norm.fused_refused", "fused" in str(error), error)


def forward_and_grad(
    layer: object, batch: np.ndarray, first_row: int
) -> tuple[np.ndarray, np.ndarray]:
    """The layer's training-mode output for ``batch`` (rows ``first_row`` on of the whole
    batch) and the gradient of sum(out * w) with respect to it, w fixed per row of the whole
    batch, on the backend in use."""
    index = np.arange(first_row * 3, (first_row + len(batch)) * 3).reshape(batch.shape)
    weights = ((index % 5 - 2) / 2).astype(np.float32)
    if hvd._bridge.is_torch:
        import torch

        x = torch.tensor(batch, requires_grad=True)
        out = layer(x, training=True)  # type: ignore[operator]
        (out * torch.tensor(weights)).sum().backward()
        return out.detach().numpy(), x.grad.numpy()  # type: ignore[union-attr]
    import tensorflow as tf

    x = tf.constant(batch)
    with tf.GradientTape() as tape:
        tape.watch(x)
        out = layer(x, training=True)  # type: ignore[operator]
        loss = tf.reduce_sum(out * weights)
    return out.numpy(), tape.gradient(loss, x).numpy()


if __name__ == "__main__":
    main()
