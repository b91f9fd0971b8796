"""The training API on real jobs of 2, 3 and 4 ranks: DistributedOptimizer against
single-process training, broadcasts of optimizer state and objects, fp16 compression,
Adasum against a direct reference, SyncBatchNorm against BatchNorm on the whole batch, and
the error cases (see workers/training_worker.py for every check)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.collectives.conftest import REPO, WORKERS, assert_all_ok, run_hvdrun

CHECKS = [
    *(
        f"equivalence.{label}{suffix}"
        for label in (
            "sgd.passes1",
            "sgd.passes2",
            "adam.passes1",
            "adam.passes2",
            "sum",
            "groups.count",
            "groups.lists",
            "predivide",
            "fp16",
            "fp16.adam",
            "requires_grad_changes",
        )
        for suffix in ("", ".same_on_ranks")
    ),
    "burst.23.identical",
    "burst.23.close",
    "burst.predicted",
    "hooks.reduced_before_step",
    "hooks.zero_grad_raises",
    "hooks.zero_grad_after_step",
    "hooks.too_many_passes_raises",
    "hooks.set_backward_passes_per_step",
    "hooks.scheduler_before_wrap",
    "dynamic.same_on_ranks",
    "dynamic.extra_weight",
    "added_group.reduced",
    "added_group.same_on_ranks",
    *(
        f"closure.{label}{s}"
        for label in ("sgd", "lbfgs", "lbfgs_wolfe")
        for s in ("", ".same_on_ranks")
    ),
    "closure.one_sided.same_on_ranks",
    "closure.no_backward",
    "closure.tensor_loss_no_warning",
    "sampler.made_before_init",
    "names.missing",
    "names.duplicate",
    "names.not_pairs",
    "names.groups_twice",
    "sparse.allgather",
    "sparse.as_dense",
    *(
        f"state.{name}.{what}"
        for name in (
            "SGD",
            "Adam",
            "AdamW",
            "Adagrad",
            "Adadelta",
            "Adamax",
            "ASGD",
            "NAdam",
            "RAdam",
            "RMSprop",
            "Rprop",
        )
        for what in ("equal_root", "same_after_steps")
    ),
    "state.lbfgs_raises",
    "state.differ.class",
    "state.differ.groups",
    "state.differ.goes_on",
    "broadcast_parameters.pairs",
    "objects.broadcast",
    "objects.allgather",
    "objects.lambda",
    *(
        f"adasum.{what}.{dtype}"
        for what in ("allreduce", "grouped", "inplace")
        for dtype in ("float32", "float64")
    ),
    *(
        f"adasum.halving.{what}.{dtype}"
        for what in ("grouped", "inplace")
        for dtype in ("float32", "float64")
    ),
    "adasum.halving.process_set",
    "adasum.halving.mismatch",
    "adasum.halving.chosen",
    "adasum.halving.big",
    "adasum.halving.big.identical",
    "adasum.allreduce.float32.identical",
    "adasum.allreduce.float64.identical",
    "adasum.parallel_averaged",
    "adasum.half.identical",
    "adasum.int_raises",
    *(
        f"adasum.optimizer.{label}{s}"
        for label in ("sgd", "adam", "sgd.fp16")
        for s in ("", ".identical")
    ),
    *(
        f"syncbn.{dims}.{what}"
        for dims in ("1d", "2d")
        for what in (
            "output",
            "input_grad",
            "param_grad",
            "running_mean",
            "running_var",
            "batches_tracked",
            "eval",
        )
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("num_proc", [2, 3, 4])
def test_training_api(num_proc: int) -> None:
    code, output = run_hvdrun(num_proc, WORKERS / "training_worker.py", timeout=300)
    assert_all_ok(code, output, num_proc, CHECKS)
    if num_proc == 2:
        assert "[0]<stdout>:OK adasum.orthogonal_summed\n" in output


@pytest.mark.slow
def test_digits_example_with_every_option_resumes(tmp_path: Path) -> None:
    """Adasum, fp16 compression, gradient accumulation and SyncBatchNorm still learn; a
    second run resumes from rank 0's checkpoint."""
    options = ["--use-adasum", "--fp16-allreduce", "--batches-per-allreduce", "2"]
    checkpoint = ["--checkpoint", str(tmp_path / "digits.pt")]
    script = REPO / "examples" / "pytorch_digits.py"
    code, output = run_hvdrun(2, script, "--epochs", "3", *options, *checkpoint)
    assert code == 0, output
    match = re.search(r"\[0\]<stdout>:final test accuracy: ([0-9.]+)", output)
    assert match and float(match.group(1)) >= 0.9, output
    assert "[0]<stdout>:training samples per rank: [2157, 2157]" in output, output
    code, output = run_hvdrun(2, script, "--epochs", "4", *options, *checkpoint)
    assert code == 0, output
    assert "[0]<stdout>:resuming from" in output and "after epoch 3" in output, output
    assert "[0]<stdout>:epoch  4:" in output and "epoch  3:" not in output, output
    assert "[0]<stdout>:training samples per rank: [719, 719]" in output, output


@pytest.mark.slow
def test_synthetic_benchmark_example_reports_rates() -> None:
    script = REPO / "examples" / "pytorch_synthetic_benchmark.py"
    args = ["--model", "resnet_small", "--batch-size", "4", "--image-size", "32"]
    args += ["--num-warmup-batches", "1", "--num-batches-per-iter", "1", "--num-iters", "2"]
    code, output = run_hvdrun(2, script, *args, "--fp16-allreduce")
    assert code == 0, output
    assert "[0]<stdout>:Model: resnet_small, batch size: 4 per worker, workers: 2" in output
    assert re.search(r"\[0\]<stdout>:Iter #1: [0-9.]+ img/sec per worker", output), output
    per_worker = re.search(r"\[0\]<stdout>:Img/sec per worker: ([0-9.]+) \+-", output)
    total = re.search(r"\[0\]<stdout>:Total img/sec on 2 worker\(s\): ([0-9.]+) \+-", output)
    assert per_worker and total, output
    assert float(total.group(1)) == pytest.approx(2 * float(per_worker.group(1)), rel=0.01)
    assert "[1]<stdout>:" not in output
