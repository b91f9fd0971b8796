"""The optimizer's first step on Keras's torch backend looks for a DistributedDataParallel
holding the model (whose gradients are reduced already) among the live objects: that look
must not set off the warnings of deprecated objects it passes (torch's
``torch.distributed.reduce_op`` warned on every rank of every job)."""

from __future__ import annotations

import pytest

from tests.frameworks.conftest import run_alone

SCRIPT = """
import warnings
import numpy as np
import torch.distributed
import torch.nn.parallel
import keras
import collectives.keras as hvd

hvd.init()
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), "mse")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(np.ones((4, 2), "float32"), np.ones((4, 1), "float32"), verbose=0)
mine = [str(w.message) for w in caught if "reduce_op" in str(w.message)]
assert not mine, mine
print("scan-ok")
"""


def test_the_scan_for_a_ddp_sets_off_no_deprecation_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KERAS_BACKEND", "torch")
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    run_alone(SCRIPT, "scan-ok")
