"""The worker side of bench/tensorflow_keras.py's allreduce table: runs under ``hvdrun -np 2``.

The same float32 tensors, allreduced (Sum, out of place) through ``collectives.tensorflow``
(a ``tf.Tensor``, eager) and through ``collectives.torch`` (a ``torch.Tensor``), on one
engine in one job. Sizes: 4 B (a sample is the median call of 200), 4 MB (10 calls) and
64 MB (2 calls). Variants alternate round-robin, every other round reversed, each sample
after 3 untimed runs and a barrier on a Gloo group of its own; a sample is the slower rank's
time. Rank 0 prints one ``RESULT <json>`` line with every variant's samples in milliseconds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf
import torch
import torch.distributed as dist

import collectives.tensorflow as hvd_tf
import collectives.torch as hvd_torch

#: (label, float32 elements, calls per sample; a 4-byte sample is the median call)
SIZES = [("4B", 1, 200), ("4MB", 1024 * 1024, 10), ("64MB", 16 * 1024 * 1024, 2)]
WARMUP_RUNS = 3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    # One compute thread per process in both frameworks: 2 ranks share the machine's cores.
    torch.set_num_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd_tf.init()
    timing = dist.new_group(backend="gloo")
    variants: dict[str, Callable[[], float]] = {}
    for label, numel, calls in SIZES:
        data = torch.randn(numel) if numel > 1 else torch.zeros(1)
        as_tf = tf.constant(data.numpy())

        def run(op: Callable[[], object], calls: int = calls, latency: bool = numel == 1) -> float:
            times = []
            start = time.perf_counter()
            for _ in range(calls):
                began = time.perf_counter()
                op()
                times.append(time.perf_counter() - began)
            total = time.perf_counter() - start
            return (statistics.median(times) if latency else total) * 1e3

        torch_op = functools.partial(hvd_torch.allreduce, data, op=hvd_torch.Sum)
        tf_op = functools.partial(hvd_tf.allreduce, as_tf, op=hvd_tf.Sum)
        variants[f"{label}.torch"] = functools.partial(run, torch_op)
        variants[f"{label}.tf"] = functools.partial(run, tf_op)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for round_ in range(args.rounds):
        for name in order if round_ % 2 == 0 else reversed(order):
            for _ in range(WARMUP_RUNS):
                variants[name]()
            dist.barrier(group=timing)
            took = torch.tensor([variants[name]()])
            dist.all_reduce(took, op=dist.ReduceOp.MAX, group=timing)
            samples[name].append(float(took))
    if hvd_tf.rank() == 0:
        print("RESULT " + json.dumps(samples), flush=True)
    hvd_tf.shutdown()


if __name__ == "__main__":
    main()
