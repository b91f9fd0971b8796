"""Multi-process tests: real jobs launched through the hvdrun CLI, each worker script running
many checks per launch (a worker's torch import costs seconds)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.collectives.conftest import REPO, WORKERS, clean_env, run_hvdrun


def _assert_all_ok(code: int, output: str, num_proc: int, expected: list[str]) -> None:
    assert code == 0, output
    assert "FAIL" not in output, output
    for rank in range(num_proc):
        assert f"[{rank}]<stdout>:ALL OK rank {rank}:" in output, output
        for name in expected:
            assert f"[{rank}]<stdout>:OK {name}\n" in output, f"rank {rank} lacks {name}\n{output}"


def test_ops_on_three_ranks() -> None:
    code, output = run_hvdrun(3, WORKERS / "ops_worker.py")
    _assert_all_ok(
        code,
        output,
        3,
        [
            "identity.size",
            "identity.unique",
            *(
                f"allreduce.{op}.torch.{dtype}"
                for op in ("SUM", "MIN", "MAX", "PRODUCT", "AVERAGE", "default_average")
                for dtype in ("float32", "float64", "int32", "int64")
            ),
            "scale.sum.float64",
            "scale.prescale.int32",
            "allgather.uneven.torch.float32",
            "allgather.shape_mismatch_raises",
            "allgather.after_error",
            "broadcast.value",
            "broadcast.size_mismatch_raises",
            "broadcast_parameters.state_dict",
            "broadcast_parameters.pairs",
            "broadcast_object.root2",
            "allgather_object",
            "fp16.exact",
            "fp16.average",
            "barrier",
            "lifecycle.reinit_allreduce",
        ],
    )


def test_optimizer_on_two_ranks() -> None:
    code, output = run_hvdrun(2, WORKERS / "optimizer_worker.py")
    _assert_all_ok(
        code,
        output,
        2,
        [
            "optimizer_state.sgd.equal_root",
            "optimizer_state.adam.equal_root",
            "optimizer_state.adam.step_count",
            "optimizer_state.sgd.in_step",
            "optimizer_state.fresh_rank_filled",
            "optimizer_state.empty_root_clears",
            "distributed_optimizer.sgd",
            "distributed_optimizer.adam",
            "distributed_optimizer.fp16",
            "distributed_optimizer.skip_synchronize",
            "distributed_optimizer.missing_grad",
            "distributed_optimizer.sparse",
        ],
    )


@pytest.mark.slow
def test_digits_example_reaches_95_percent() -> None:
    code, output = run_hvdrun(2, REPO / "examples" / "pytorch_digits.py")
    assert code == 0, output
    match = re.search(r"\[0\]<stdout>:final test accuracy: ([0-9.]+)", output)
    assert match, output
    assert float(match.group(1)) >= 0.95, output
    assert "[1]<stdout>:" not in output  # only rank 0 reports


@pytest.mark.slow
def test_digits_example_runs_without_hvdrun() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "pytorch_digits.py"), "--epochs", "2"],
        cwd=REPO,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "trained on 1 process(es)" in result.stdout
    assert re.search(r"^final test accuracy: 0\.\d{4}$", result.stdout, re.MULTILINE)
