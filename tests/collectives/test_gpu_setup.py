"""Where CUDA tensors go, and the check that keeps NCCL from failing as "a dead peer" when
ranks would share a GPU: the decision (pure), the backend setting, and the check on two
real ranks agreeing over Gloo. (A machine with GPUs runs the CUDA paths themselves:
tests/gpu/.)"""

from __future__ import annotations

import pytest
import torch

from collectives.runtime.groups import GpuPlace, choose_backend, shared_gpu_error
from tests.collectives.conftest import WORKERS, assert_all_ok, run_hvdrun


def test_ranks_sharing_a_gpu_are_named_with_the_counts_and_the_ways_out() -> None:
    places = [GpuPlace(rank, "node1", 0, "GPU-aaaa", 1) for rank in range(4)]
    error = shared_gpu_error(places)
    assert error is not None
    assert error.startswith(
        "4 ranks run on host node1, which has 1 visible GPU(s): ranks 0, 1, 2, 3 would share "
        "GPU 0, and NCCL cannot run two ranks of one job on one GPU."
    )
    assert "-H HOST:SLOTS" in error and "CUDA_VISIBLE_DEVICES" in error
    assert "hvdrun --cuda-backend gloo, or HVDRUN_CUDA_BACKEND=gloo" in error


def test_ranks_with_a_gpu_each_pass() -> None:
    two_gpus = [GpuPlace(r, "node1", r, f"GPU-{r}", 2) for r in range(2)]
    one_visible_each = [GpuPlace(r, "node1", 0, f"GPU-{r}", 1) for r in range(2)]
    two_hosts = [GpuPlace(r, f"node{r}", 0, "GPU-same-model-uuid", 1) for r in range(2)]
    unknown = [GpuPlace(r, "node1", 0, "", 1) for r in range(2)]  # (no UUID: no verdict)
    for places in (two_gpus, one_visible_each, two_hosts, unknown):
        assert shared_gpu_error(places) is None, places
    # A second host with a shared GPU is found after a first host that is fine.
    mixed = [*two_gpus, GpuPlace(2, "node2", 0, "GPU-x", 1), GpuPlace(3, "node2", 0, "GPU-x", 1)]
    assert "2 ranks run on host node2" in (shared_gpu_error(mixed) or "")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the choice on a machine without GPUs")
def test_cuda_backend_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HVDRUN_CUDA_BACKEND", raising=False)
    assert choose_backend() == "gloo"  # no GPU: Gloo for everything
    monkeypatch.setenv("HVDRUN_CUDA_BACKEND", "GLOO")
    assert choose_backend() == "gloo"
    monkeypatch.setenv("HVDRUN_CUDA_BACKEND", "nccl")
    with pytest.raises(RuntimeError, match=r"HVDRUN_CUDA_BACKEND=nccl .*leave it unset"):
        choose_backend()
    monkeypatch.setenv("HVDRUN_CUDA_BACKEND", "mpi")
    with pytest.raises(
        ValueError, match="HVDRUN_CUDA_BACKEND must be one of nccl, gloo; got 'mpi'"
    ):
        choose_backend()


def test_every_rank_reaches_the_same_verdict_on_a_shared_gpu() -> None:
    code, output = run_hvdrun(2, WORKERS / "shared_gpu_worker.py")
    assert_all_ok(code, output, 2, ["shared GPU found", "a GPU each passes"])
    verdicts = {line.split(":", 1)[1] for line in output.splitlines() if ">:VERDICT " in line}
    assert len(verdicts) == 1, output  # the same words on both ranks
