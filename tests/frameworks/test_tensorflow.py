"""collectives.tensorflow on real jobs: every op and dtype in eager mode, tf.function and
TF1 graphs with exact values, gradients, reordered ops, a distributed tape that trains as
one process, XLA refused, Horovod's error types in every mode, the job's numbers as ops,
Horovod's private names, local gradients, TF1 accumulation and TF1 Adasum's combined model
deltas (workers/tf_ops_worker.py); graphs of hundreds of collectives on one and two inter-op
threads that never deadlock (workers/tf_graph_worker.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.collectives.conftest import REPO, assert_all_ok, clean_env, run_hvdrun

WORKERS = Path(__file__).parent / "workers"
MODES = ("eager", "function", "graph")
CHECKS = [
    "allreduce.eager.Average.float32",
    "allreduce.function.Sum.int64",
    "allreduce.graph.Max.bfloat16",
    "grouped_allreduce.graph",
    "allgather.function",
    "alltoall.graph",
    "reducescatter.function",
    "indexed_slices",
    "grad.allgather.function",
    "grad.reducescatter.eager",
    "tf_function.reordered",
    "grad.broadcast.then_unnamed",
    "barrier.function",
    "barrier.graph",
    "tape.equals_single_process",
    "xla.refused",
    *(f"dtypes.moved.{mode}" for mode in MODES),
    "dtypes.unsigned_reduced",
    "dtypes.uint64_reduce_refused",
    *(f"job_ops.{mode}" for mode in MODES),
    "job_ops.process_set",
    "job_ops.tape_outside_set",
    "tf1.adasum_variables_global",
    *(f"tf1.adasum_deltas.{mode}.k{k}" for mode in ("graph", "eager") for k in (1, 2)),
    "errors.job_goes_on",
]
#: Checks run in the job of 2 ranks only (the size changes nothing in them).
TWO_RANKS = [
    *(f"errors.{what}.{mode}" for what in ("mismatch", "root", "splits") for mode in MODES),
    "names.executing_eagerly",
    "names.raw_allreduce_sums",
    "names.refs",
    "names.broadcast_object_fn",
    "names.power_of_2",
    "names.join_tensor",
    "local.partial_tape",
    "local.unscaled_split",
    "tf1.accumulated",
    "tf1.accumulation_variables_local",
]


@pytest.mark.parametrize("ranks", [2, 3])
def test_tensorflow_ops_gradients_and_tape(ranks: int) -> None:
    code, output = run_hvdrun(ranks, WORKERS / "tf_ops_worker.py", timeout=300)
    assert_all_ok(code, output, ranks, CHECKS + (TWO_RANKS if ranks == 2 else []))


@pytest.mark.parametrize("threads", [1, 2])
def test_graphs_of_many_collectives_never_deadlock(threads: int) -> None:
    # (the old design hung on the first case, 21 allreduces, with 1 and with 2 threads)
    code, output = run_hvdrun(
        2, WORKERS / "tf_graph_worker.py", env={"HVD_TEST_INTER_OP": str(threads)}, timeout=420
    )
    checks = [f"{case}.function.threads={threads}" for case in ("issue21",)]
    checks += [f"many.function.threads={threads}.run{k}" for k in (0, 1)]
    if threads == 1:  # (that job runs the TF1 sessions too, of 1 and 2 threads)
        checks += [f"issue21.session.threads={t}" for t in (1, 2)]
        checks += [f"many.session.threads={t}.run{k}" for t in (1, 2) for k in (0, 1)]
    assert_all_ok(code, output, 2, checks)


def test_importing_the_torch_frontend_or_hvdrun_never_imports_tensorflow() -> None:
    probe = (
        "import sys, collectives.torch, hvdrun.cli; "
        "print('tensorflow' in sys.modules, 'keras' in sys.modules)"
    )
    result = run_probe(probe)
    assert result.stdout.split() == ["False", "False"], result.stdout + result.stderr


def test_horovods_tensorflow_module_paths_import_under_collectives() -> None:
    # horovod.tensorflow.keras.callbacks / .elastic, horovod.tensorflow.sync_batch_norm and
    # the job's queries in horovod.tensorflow.mpi_ops, with "horovod." renamed, as
    # docs/migrating.md tells users to.
    probe = (
        "import collectives.tensorflow.keras.callbacks as callbacks\n"
        "from collectives.tensorflow.keras.elastic import KerasState, run\n"
        "from collectives.tensorflow.sync_batch_norm import SyncBatchNormalization\n"
        "from collectives.tensorflow.elastic import HorovodInternalError\n"
        "import collectives.errors\n"
        "assert HorovodInternalError is collectives.errors.HorovodInternalError\n"
        "import collectives.keras as hvd\n"
        "assert callbacks.MetricAverageCallback is hvd.callbacks.MetricAverageCallback\n"
        "assert KerasState is hvd.elastic.KerasState and run is hvd.elastic.run\n"
        "assert SyncBatchNormalization is hvd.SyncBatchNormalization\n"
        "from collectives.tensorflow.mpi_ops import init, rank, size, local_rank, shutdown\n"
        "init(); assert (rank(), size(), local_rank()) == (0, 1, 0); shutdown()\n"
        "print('ok')\n"
    )
    result = run_probe(probe)
    assert result.stdout.strip() == "ok", result.stdout + result.stderr


def run_probe(probe: str) -> subprocess.CompletedProcess[str]:
    """``python -c PROBE`` in a fresh process, as a user's script would run."""
    return subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
