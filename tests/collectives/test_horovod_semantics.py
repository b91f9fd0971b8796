"""Horovod's semantics that training scripts depend on, on 2 and 3 ranks (one launch each;
workers/horovod_worker.py runs every check): errors Horovod raises as RuntimeError (never a
HorovodInternalError, so elastic mode does not retry them), ops refused while a rank has
joined, global root ranks inside process sets, the collectives' gradients, Horovod's
placement variables, sparse_allreduce_async, broadcast_optimizer_state with parameters that
have no gradient yet, and DistributedOptimizer(sparse_as_dense=True) with SparseAdam."""

from __future__ import annotations

import pytest

from tests.collectives.conftest import WORKERS, assert_all_ok, run_hvdrun

EVERY_RANK = [
    "env.horovod_placement",
    "env.horovod_hostname",
    *(
        f"error.mismatch.{what}{suffix}"
        for what in ("shape", "dtype", "op", "root", "splits", "gather", "reducescatter")
        for suffix in ("", ".class")
    ),
    "error.splits_type.float_tensor.class",
    "error.splits_type.float_list.class",
    "error.job_usable_after",
    "error.elastic_propagates",
    "error.elastic_no_retry",
    "join.returns_last",
    "join.after_all_joined",
    "join.late_low_rank",
    "join.late_high_rank",
    *(
        f"root.global.{what}"
        for what in (
            "broadcast",
            "broadcast_",
            "broadcast_async",
            "broadcast_object",
            "broadcast_parameters",
            "broadcast_optimizer_state",
        )
    ),
    "root.outside.broadcast",
    "root.outside.broadcast_object",
    "root.outside.broadcast_parameters",
    "root.outside.set_usable_after",
    "root.mismatch_in_set",
    "root.out_of_job",
    "grad.reducescatter.sum",
    "grad.reducescatter.average",
    "grad.reducescatter.scaled",
    "grad.grouped_reducescatter.average",
    "grad.set.reducescatter",
    "grad.set.broadcast",
    "grad.set.allgather",
    *(f"sparse.{op}.{what}" for op in ("sum", "average") for what in ("is_int_handle", "values")),
    "sparse.sum.is_sparse",
    "sparse.callable",
    "sparse.process_set",
    "sparse.shape_mismatch",
    "sparse.shape_mismatch.class",
    "sparse.dense_refused",
    "optimizer_state.partial.params_with_state",
    "optimizer_state.partial.grads",
    "optimizer_state.partial.equal",
    "optimizer_state.partial.fresh_wrapped",
    "optimizer_state.partial.trains",
    "sparse_adam.dense.grad_sparse.1",
    "sparse_adam.dense",
    "sparse_adam.sparse",
]
# Rank 0 joins at once; every other rank checks what its ops do meanwhile.
NOT_RANK_0 = [
    *(
        f"join.refuses.{what}{suffix}"
        for what in (
            "allgather",
            "broadcast",
            "alltoall",
            "reducescatter",
            "broadcast_object",
            "sparse_allreduce",
        )
        for suffix in ("", ".class")
    ),
    "join.allreduce_runs",
    "join.other_set_runs",
]


@pytest.mark.parametrize("num_proc", [2, 3])
def test_horovod_semantics(num_proc: int) -> None:
    code, output = run_hvdrun(num_proc, WORKERS / "horovod_worker.py", timeout=240)
    assert_all_ok(code, output, num_proc, EVERY_RANK)
    for rank in range(1, num_proc):
        for name in NOT_RANK_0:
            assert f"[{rank}]<stdout>:OK {name}\n" in output, f"rank {rank} lacks {name}\n{output}"
