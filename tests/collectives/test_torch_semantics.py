"""Horovod's PyTorch semantics that need peers (issue 28): broadcast_optimizer_state's dummy
step on optimizers without state, and DistributedOptimizer with torch.compile."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.collectives.conftest import WORKERS, assert_all_ok, run_hvdrun

WORKER = WORKERS / "torch_semantics_worker.py"


def test_broadcast_optimizer_state_takes_horovods_dummy_step() -> None:
    # A dummy step that reduced (a DistributedOptimizer's own step) would wait for a rank
    # that takes none: the stall shutdown turns that into a failure instead of a hang.
    options = [
        "--stall-check-warning-time-seconds",
        "10",
        "--stall-check-shutdown-time-seconds",
        "20",
    ]
    code, output = run_hvdrun(2, WORKER, "state", options=options)
    checks = [
        f"dummy.{label}.{check}"
        for label in ("adam", "sgd", "wrapped", "adasum")
        for check in (
            "zero_grads",
            "frozen_no_grad",
            "params_unchanged",
            "state_per_trainable",
            "state_equal",
        )
    ]
    checks += ["dummy.adam.one_step", "dummy.adam.root_lr", "dummy.sparse_adam"]
    checks += ["dummy.sgd_sparse_embedding", "state.sparse_momentum"]
    checks += ["dummy.fresh_rank_gets_root_state"]
    assert_all_ok(code, output, 2, checks)
    assert "[0]<stdout>:OK dummy.stateful_root_untouched\n" in output


@pytest.mark.slow
@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++")),
    reason="torch.compile's Inductor needs a C++ compiler (apt-get install g++)",
)
def test_torch_compile_trains_with_distributed_optimizer() -> None:
    """Inductor (the default backend, which needs a C++ compiler), a tiny model: a
    compiled model, and a compiled training step with backward and step left outside."""
    # torch 2.11's Dynamo cannot trace the compiled step (an internal assertion, "Attempted
    # setattr on a user-defined object that does not have an AttributeMutation
    # mutation_type"); 2.12 and later can. The compiled model works on both.
    step = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 12)
    variants = ("model", "step") if step else ("model",)
    env = {"COMPILE_STEP": "1" if step else "0"}
    code, output = run_hvdrun(2, WORKER, "compile", env=env, timeout=400)
    checks = [
        f"compile.{variant}.{check}"
        for variant in variants
        for check in ("ranks_identical", "matches_single_process", "trained")
    ]
    assert_all_ok(code, output, 2, checks)
    if not step:
        pytest.skip(
            f"the compiled model trains; the compiled step needs torch >= 2.12 (Dynamo of "
            f"torch {torch.__version__} cannot trace it)"
        )


def test_horovods_mpi_ops_module_holds_the_job_queries() -> None:
    # from horovod.torch.mpi_ops import rank, size, ... (with "horovod." renamed)
    import collectives.torch as hvd
    from collectives.torch import mpi_ops

    names = [
        "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
        "cross_size", "cross_rank", "is_homogeneous", "start_timeline", "stop_timeline",
        "mpi_threads_supported", "mpi_built", "mpi_enabled", "gloo_built", "gloo_enabled",
        "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built",
        "add_process_set", "remove_process_set", "HorovodInternalError",
    ]  # fmt: skip
    assert [name for name in names if getattr(mpi_ops, name, None) is not getattr(hvd, name)] == []
