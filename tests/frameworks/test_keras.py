"""collectives.keras on real jobs: ``model.fit`` leaves identical weights on every rank and
averaged metrics in the logs, the warmup's learning rates, ops on values, accumulated
gradients against Horovod's algorithm (local layers, inf, sparse as dense),
SyncBatchNormalization against BatchNormalization on the whole batch, a
DistributedGradientTape's gradients reduced once through the optimizer, and load_model, on
Keras 3's TensorFlow and torch backends and on tf_keras (workers/keras_worker.py); and
tf_keras in a TF1 session (workers/keras_tf1_worker.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.collectives.conftest import assert_all_ok, run_hvdrun

WORKERS = Path(__file__).parent / "workers"
#: A DistributedGradientTape's gradients through a DistributedOptimizer (TensorFlow).
TAPE = ["tape.reduced_once", "tape.plain_reduced", "tape.traced_once", "tape.accumulated"]


@pytest.mark.parametrize(
    "env, checks",
    [
        ({"KERAS_BACKEND": "tensorflow"}, TAPE),
        ({"KERAS_BACKEND": "torch"}, ["ddp.not_reduced_twice"]),
        ({"TF_USE_LEGACY_KERAS": "1"}, TAPE),
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
            "fit.momentum_corrected",
            "fit.momentum_scaled_too",
            "fit.vector_metric_averaged",
            "fit.none_metric",
            "fit.broadcast_built_on_one_rank",
            "elastic.sync_needs_built_models",
            "fit.none_vector_metric",
            "fit.metric_of_one_rank",
            "fit.text_metric_kept",
            "fit.shapes_kept",
            "ops.allgather",
            "accumulate.sum.partial",
            "accumulate.average.local",
            "accumulate.inf",
            "accumulate.sparse_as_dense",
            "sparse.local_scaled",
            "sync_batch_norm.output_and_grad",
            "sync_batch_norm.moving_statistics",
            "sync_batch_norm.name",
            "sync_batch_norm.unique_names",
            "sync_batch_norm.fused_refused",
            "load_model.distributed",
            "load_model.custom_optimizer",
            *checks,
        ],
    )
    assert "metric 'text_on_rank_0' is left as each rank has it: rank 0: not a number" in output
    if checks is TAPE:  # (the optimizer says why it leaves the tape's gradients alone)
        assert "gradients of a DistributedGradientTape are reduced" in output


def test_tf_keras_in_a_tf1_session() -> None:
    """tf_keras with eager execution off (Horovod's older Keras scripts): the broadcast
    callback, the warmup and broadcast_global_variables act in the Keras session."""
    code, output = run_hvdrun(
        2, WORKERS / "keras_tf1_worker.py", env={"TF_USE_LEGACY_KERAS": "1"}, timeout=300
    )
    assert_all_ok(
        code,
        output,
        2,
        [
            "tf1.broadcast_callback",
            "tf1.warmup_callback",
            "tf1.broadcast_global_variables",
            "tf1.elastic_state_refused",
            "tf1.accumulation",
        ],
    )
