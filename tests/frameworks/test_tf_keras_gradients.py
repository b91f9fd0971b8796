"""tf_keras's DistributedOptimizer reduces in its gradient methods, as Horovod's does, and
apply_gradients does not reduce those gradients again (workers/tf_keras_gradients_worker.py;
get_gradients in TF1 graphs: test_keras.py's tf_keras TF1 case)."""

from __future__ import annotations

from pathlib import Path

from tests.collectives.conftest import assert_all_ok, run_hvdrun

WORKER = Path(__file__).parent / "workers" / "tf_keras_gradients_worker.py"


def test_gradient_methods_return_reduced_gradients_applied_once() -> None:
    code, output = run_hvdrun(2, WORKER, env={"TF_USE_LEGACY_KERAS": "1"}, timeout=240)
    assert_all_ok(
        code,
        output,
        2,
        [
            "compute_gradients.reduced",
            "compute_gradients.applied_once",
            "plain_tape.reduced_once",
            "legacy.compute_gradients.reduced",
            "tf_function.reduced_once",
        ],
    )
