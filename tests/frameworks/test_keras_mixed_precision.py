"""Mixed precision with hvd.DistributedOptimizer in model.fit (Keras wraps it in its
LossScaleOptimizer): a step whose gradients overflow on one rank only is skipped by every
rank, as in Horovod, on Keras 3's TensorFlow and torch backends
(workers/keras_mixed_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.collectives.conftest import assert_all_ok, run_hvdrun

WORKER = Path(__file__).parent / "workers" / "keras_mixed_worker.py"


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_an_overflow_on_one_rank_is_skipped_by_every_rank(backend: str) -> None:
    # (the stall shutdown ends a job whose ranks stopped agreeing, instead of a hang)
    env = {"KERAS_BACKEND": backend, "HVDRUN_STALL_SHUTDOWN_TIME_SECONDS": "20"}
    code, output = run_hvdrun(2, WORKER, env=env, timeout=240)
    assert_all_ok(code, output, 2, ["mixed.identical_weights", "mixed.skipped_together"])
