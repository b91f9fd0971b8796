"""Mixed precision with hvd.DistributedOptimizer in model.fit (Keras wraps it in its
LossScaleOptimizer): a step whose gradients overflow on one rank only is skipped by every
rank, as in Horovod, on Keras 3's TensorFlow and torch backends and on tf_keras
(workers/keras_mixed_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.collectives.conftest import assert_all_ok, run_hvdrun

WORKER = Path(__file__).parent / "workers" / "keras_mixed_worker.py"


@pytest.mark.parametrize(
    "keras", ["tensorflow", "torch", "tf_keras", "tf_keras-optimizer-v2", "tf_keras-own-scale"]
)
def test_an_overflow_on_one_rank_is_skipped_by_every_rank(keras: str) -> None:
    # (the stall shutdown ends a job whose ranks stopped agreeing, instead of a hang;
    # own-scale: the script wraps a LossScaleOptimizer of its own)
    env = {"HVDRUN_STALL_CHECK_TIME_SECONDS": "10", "HVDRUN_STALL_SHUTDOWN_TIME_SECONDS": "20"}
    if keras.startswith("tf_keras"):
        env.update(TF_USE_LEGACY_KERAS="1", OPTIMIZER_V2="1" if keras.endswith("v2") else "")
        env.update(OWN_LOSS_SCALE="1" if keras.endswith("own-scale") else "")
    else:
        env["KERAS_BACKEND"] = keras
    code, output = run_hvdrun(2, WORKER, env=env, timeout=240)
    assert_all_ok(code, output, 2, ["mixed.identical_weights", "mixed.skipped_together"])
