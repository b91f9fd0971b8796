"""The TensorFlow and Keras examples train for real on 2 ranks: every rank ends with the
same weights and the test accuracy is far above chance (10 classes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.collectives.conftest import REPO, run_hvdrun


def _check(code: int, output: str, min_accuracy: float) -> None:
    assert code == 0, output
    assert "[0]<stdout>:weights identical on every rank: True" in output, output
    found = re.search(r"\[0\]<stdout>:final test accuracy: ([0-9.]+)", output)
    assert found is not None and float(found.group(1)) >= min_accuracy, output


def test_tensorflow2_digits_example() -> None:
    script = REPO / "examples" / "tensorflow2_digits.py"
    _check(*run_hvdrun(2, script, "--epochs", "4", timeout=300), min_accuracy=0.8)


@pytest.mark.parametrize("backend", ["tensorflow", "torch"])
def test_keras_digits_example(backend: str, tmp_path: Path) -> None:
    script = REPO / "examples" / "keras_digits.py"
    code, output = run_hvdrun(
        2,
        script,
        "--epochs",
        "4",
        "--save",
        f"{tmp_path}/model.keras",
        env={"KERAS_BACKEND": backend},
        timeout=300,
    )
    _check(code, output, min_accuracy=0.8)
    assert "[0]<stdout>:keras: keras " in output and f" on {backend}" in output, output
    assert "finished gradual learning rate warmup" in output, output
