"""PySpark's TorchDistributor (torchrun in each Spark task) with hvd.init() in the training
function: one job with Spark's ranks, on the test cluster's two executors."""

from __future__ import annotations

import os
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="PySpark is not installed (pip install 'hvdrun[spark]')")


def train(scale: float) -> list[dict[str, Any]]:
    """What TorchDistributor runs in each process; rank 0's answer comes back."""
    import torch

    import collectives.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([scale * (hvd.rank() + 1)]), op=hvd.Sum).item()
    mine = {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "torch_rank": int(os.environ["RANK"]),
        "local_rank": hvd.local_rank(),
        "cross_rank": hvd.cross_rank(),
        "sum": total,
        "pid": os.getpid(),
    }
    everyone: list[dict[str, Any]] = hvd.allgather_object(mine)
    hvd.shutdown()
    return everyone


def test_hvd_init_inside_torch_distributor_joins_one_job(spark: Any) -> None:
    from pyspark.ml.torch.distributor import TorchDistributor

    distributor = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    ranks = distributor.run(train, 10.0)
    assert ranks is not None
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["size"] == 2 and r["sum"] == 30.0 for r in ranks)
    assert all(r["rank"] == r["torch_rank"] for r in ranks)  # Spark's (torchrun's) ranks
    # One process per executor, on two hosts.
    assert [(r["local_rank"], r["cross_rank"]) for r in ranks] == [(0, 0), (0, 1)]
    assert len({r["pid"] for r in ranks}) == 2
