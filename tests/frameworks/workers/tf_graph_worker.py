"""Worker: graphs full of collectives never deadlock, in TF1 sessions and in tf.function.

TensorFlow runs a graph's independent ops in any order on a small pool of threads
(``inter_op_parallelism_threads``). A collective
that held one of those threads while it waited for its peers could starve the submissions
the peers wait for, and every rank would hang. Checked here, on real ranks:

* the case that hung: 21 unnamed allreduces (7 dtypes x 3 shapes), each compared with
  ``t * size``, one ``session.run`` of their ``reduce_all``;
* a graph of 200 named ops of every kind and many dtypes, a third of them fed by an earlier
  op's result, built in a different order on every rank, run twice as a ``tf.function`` and
  twice in each TF1 session, every result against its exact value.

``HVD_TEST_INTER_OP`` (1 or 2) sets the eager runtime's pool, which runs ``tf.function``
(it can be set once per process: one job for each). With 1 the job also runs both cases in
TF1 sessions of 1 and of 2 threads.

A graph that does not finish in time ends the job with every thread's stack, never a hang.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "collectives" / "workers"))
from checks import Checks

import collectives.tensorflow as hvd

THREADS = int(os.environ.get("HVD_TEST_INTER_OP", "1"))
#: Seconds one scenario may take before the job is stopped with every thread's stack.
DEADLINE = 120
OPS = 200
KINDS = ("allreduce", "grouped_allreduce", "allgather", "broadcast", "alltoall", "reducescatter")
REDUCIBLE = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64, tf.uint8)
MOVABLE = (*REDUCIBLE, tf.int8, tf.int16, tf.uint16, tf.bool)

tf.config.threading.set_inter_op_parallelism_threads(THREADS)


def issue_case(n: int) -> tf.Tensor:
    """21 unnamed allreduces, each compared with ``t * size`` (built in the same order on
    every rank: unnamed ops take their names from their inputs')."""
    checks = []
    for dtype in (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64, tf.uint8):
        for shape in ([3], [2, 3], [4, 2, 2]):
            t = tf.cast(tf.ones(shape), dtype)
            reduced = hvd.allreduce(t, op=hvd.Sum)
            checks.append(tf.reduce_all(tf.equal(reduced, t * tf.cast(n, dtype))))
    return tf.reduce_all(checks)


class Plan:
    """One many-op graph, the same on every rank: each op's kind, dtype and input (fresh or
    fed by an earlier op), and every rank's expected result of every op."""

    def __init__(self, n: int, count: int) -> None:
        rng = np.random.default_rng(7)
        self.n = n
        self.kinds = [KINDS[j % len(KINDS)] for j in range(count)]
        self.feeds: list[int | None] = [
            int(rng.integers(0, j)) if j and rng.random() < 1 / 3 else None for j in range(count)
        ]
        self.dtypes = []
        for kind in self.kinds:
            choices = REDUCIBLE if "reduce" in kind else MOVABLE
            self.dtypes.append(choices[int(rng.integers(0, len(choices)))])
        self.expected: list[list[Any]] = []  # [op][rank] -> result
        for j in range(count):
            inputs = [self.input_value(j, q) for q in range(n)]
            self.expected.append([self.result(j, inputs, q) for q in range(n)])

    def base(self, j: int, rank: int) -> np.ndarray:
        values = np.arange(2 * self.n * 3).reshape(2 * self.n, 3) % 5 + rank + j % 3
        return values.astype(self.dtypes[j].as_numpy_dtype)

    def input_value(self, j: int, rank: int) -> np.ndarray:
        feed = self.feeds[j]
        base = self.base(j, rank)
        if feed is None:
            return base
        first = np.asarray(self.expected[feed][rank], dtype=np.float64).ravel()[0]
        extra = int(first) % 4
        if self.dtypes[j] == tf.bool:
            return np.logical_xor(base, extra % 2 == 1)
        return (base.astype(np.float64) + extra).astype(base.dtype)

    def result(self, j: int, inputs: list[np.ndarray], rank: int) -> Any:
        kind, n, dtype = self.kinds[j], self.n, inputs[0].dtype
        total = sum(x.astype(np.float64) for x in inputs).astype(dtype)
        if kind == "allreduce":
            return total
        if kind == "grouped_allreduce":
            return [total, (2 * sum(x.astype(np.float64) for x in inputs)).astype(dtype)]
        if kind == "allgather":
            return np.concatenate(inputs)
        if kind == "broadcast":
            return inputs[j % n]
        if kind == "alltoall":
            return np.concatenate([x[2 * rank : 2 * rank + 2] for x in inputs])
        return total[2 * rank : 2 * rank + 2]  # reducescatter

    def build(self, rank: int) -> list[Any]:
        """The graph's ops, each named, built in an order of this rank's own (a random
        order in which every op comes after the op that feeds it); their outputs by op."""
        rng = np.random.default_rng(100 + rank)
        outputs: list[Any] = [None] * len(self.kinds)
        waiting = set(range(len(self.kinds)))
        while waiting:
            ready = sorted(
                j for j in waiting if self.feeds[j] is None or outputs[self.feeds[j]] is not None
            )
            j = ready[int(rng.integers(0, len(ready)))]
            waiting.remove(j)
            outputs[j] = self.op(j, rank, outputs)
        return outputs

    def op(self, j: int, rank: int, outputs: list[Any]) -> Any:
        kind, dtype, name = self.kinds[j], self.dtypes[j], f"op{j}"
        x = tf.constant(self.base(j, rank))
        feed = self.feeds[j]
        if feed is not None:
            earlier = outputs[feed][0] if isinstance(outputs[feed], list) else outputs[feed]
            first = tf.cast(tf.reshape(earlier, [-1])[0], tf.float64)
            extra = tf.math.floormod(tf.cast(first, tf.int64), 4)
            if dtype == tf.bool:
                x = tf.math.logical_xor(x, tf.equal(tf.math.floormod(extra, 2), 1))
            else:
                x = tf.cast(tf.cast(x, tf.float64) + tf.cast(extra, tf.float64), dtype)
        if kind == "allreduce":
            return hvd.allreduce(x, op=hvd.Sum, name=name)
        if kind == "grouped_allreduce":
            return hvd.grouped_allreduce([x, x * tf.cast(2, dtype)], op=hvd.Sum, name=name)
        if kind == "allgather":
            return hvd.allgather(x, name=name)
        if kind == "broadcast":
            return hvd.broadcast(x, j % self.n, name=name)
        if kind == "alltoall":
            return hvd.alltoall(x, name=name)
        return hvd.reducescatter(x, op=hvd.Sum, name=name)

    def compare(self, got: list[Any], rank: int) -> list[int]:
        """The ops whose result is wrong."""
        wrong = []
        for j, value in enumerate(got):
            want = self.expected[j][rank]
            pairs = zip(value, want, strict=True) if isinstance(want, list) else [(value, want)]
            for a, b in pairs:
                a = np.asarray(a)
                same = a.dtype == b.dtype and a.shape == b.shape
                if not (same and np.array_equal(a.astype(np.float64), b.astype(np.float64))):
                    wrong.append(j)
        return wrong


def within_deadline(c: Checks, name: str, body: Callable[[], None]) -> None:
    """Runs one scenario; a scenario that hangs ends the job with every thread's stack."""
    faulthandler.dump_traceback_later(DEADLINE, exit=True)
    start = time.monotonic()
    try:
        c.run(name, body)
    finally:
        faulthandler.cancel_dump_traceback_later()
    print(f"{name}: {time.monotonic() - start:.1f} s", flush=True)


def main() -> None:
    c = Checks()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    sessions = [1, 2] if THREADS == 1 else []

    def issue_in_sessions() -> None:
        with tf.Graph().as_default():
            out = issue_case(n)
            for threads in sessions:
                with tf.compat.v1.Session(config=session_config(threads)) as session:
                    c.expect(f"issue21.session.threads={threads}", bool(session.run(out)))

    def issue_in_function() -> None:
        ok = tf.function(lambda: issue_case(n))()
        c.expect(f"issue21.function.threads={THREADS}", bool(ok.numpy()))

    plan = Plan(n, OPS)

    def many_in_sessions() -> None:
        with tf.Graph().as_default():
            outputs = plan.build(r)
            for threads in sessions:
                with tf.compat.v1.Session(config=session_config(threads)) as session:
                    for run in range(2):
                        wrong = plan.compare(session.run(outputs), r)
                        c.expect(f"many.session.threads={threads}.run{run}", not wrong, wrong)

    def many_in_function() -> None:
        function = tf.function(lambda: plan.build(r), autograph=False)
        for run in range(2):
            got = tf.nest.map_structure(lambda t: t.numpy(), function())
            wrong = plan.compare(got, r)
            c.expect(f"many.function.threads={THREADS}.run{run}", not wrong, wrong)

    if sessions:
        within_deadline(c, "issue21.session", issue_in_sessions)
    within_deadline(c, "issue21.function", issue_in_function)
    if sessions:
        within_deadline(c, "many.session", many_in_sessions)
    within_deadline(c, "many.function", many_in_function)
    hvd.shutdown()
    c.finish(r)


def session_config(threads: int) -> tf.compat.v1.ConfigProto:
    return tf.compat.v1.ConfigProto(
        inter_op_parallelism_threads=threads, intra_op_parallelism_threads=1
    )


if __name__ == "__main__":
    main()
