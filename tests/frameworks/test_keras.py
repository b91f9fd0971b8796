"""collectives.keras on real jobs: ``model.fit`` leaves identical weights on every rank and
averaged metrics in the logs, the warmup's learning rates, ops on values, accumulated
gradients and load_model, on Keras 3's TensorFlow and torch backends and on tf_keras
(workers/keras_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.collectives.conftest import assert_all_ok, run_hvdrun

WORKERS = Path(__file__).parent / "workers"


@pytest.mark.parametrize(
    "env, checks",
    [
        ({"KERAS_BACKEND": "tensorflow"}, ["accumulate.average=False", "accumulate.average=True"]),
        (
            {"KERAS_BACKEND": "torch"},
            ["accumulate.average=False", "accumulate.average=True", "ddp.not_reduced_twice"],
        ),
        ({"TF_USE_LEGACY_KERAS": "1"}, []),
    ],
    ids=["keras3-tensorflow", "keras3-torch", "tf_keras"],
)
def test_keras_fit_callbacks_and_optimizer(env: dict[str, str], checks: list[str]) -> None:
    code, output = run_hvdrun(2, WORKERS / "keras_worker.py", env=env, timeout=300)
    assert_all_ok(
        code,
        output,
        2,
        [
            "fit.identical_weights",
            "fit.metrics_averaged",
            "fit.warmup_rates",
            "ops.allgather",
            "load_model.distributed",
            *checks,
        ],
    )
