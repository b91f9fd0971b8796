"""collectives.tensorflow on real jobs: every op and dtype in eager mode, tf.function and
TF1 graphs with exact values, gradients, reordered ops, a distributed tape that trains as
one process, XLA refused, mismatches named (workers/tf_ops_worker.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.collectives.conftest import REPO, assert_all_ok, clean_env, run_hvdrun

WORKERS = Path(__file__).parent / "workers"
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
    "tape.equals_single_process",
    "xla.refused",
    "mismatch.raises",
    "mismatch.function_raises",
]


@pytest.mark.parametrize("ranks", [2, 3])
def test_tensorflow_ops_gradients_and_tape(ranks: int) -> None:
    code, output = run_hvdrun(ranks, WORKERS / "tf_ops_worker.py", timeout=300)
    assert_all_ok(code, output, ranks, CHECKS)


def test_importing_the_torch_frontend_or_hvdrun_never_imports_tensorflow() -> None:
    probe = (
        "import sys, collectives.torch, hvdrun.cli; "
        "print('tensorflow' in sys.modules, 'keras' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.split() == ["False", "False"], result.stdout + result.stderr
