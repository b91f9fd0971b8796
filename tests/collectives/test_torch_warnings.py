"""Horovod's PyTorch warnings keep their text here (issue 28, item 8): each of ours starts
with Horovod's message, so ``warnings.filterwarnings(message=...)`` written for Horovod
matches it. A one-rank job in this process: these warnings need no peers."""

from __future__ import annotations

import re
import warnings
from types import ModuleType

import pytest
import torch

#: Horovod 0.28's texts (horovod/torch/optimizer.py), which users' filters quote.
HOROVOD_STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
    "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in your "
    "code."
)
HOROVOD_NUM_GROUPS = "Parameter `num_groups` has been replaced by `groups`"
#: horovod/common/util.py, shared by every Horovod frontend.
HOROVOD_AVERAGE = "Parameter `average` has been replaced with `op` and will be removed"


def step_after_synchronize(hvd: ModuleType) -> None:
    model = torch.nn.Linear(3, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(2, 3)).sum().backward()
    optimizer.synchronize()
    optimizer.step()


def num_groups(hvd: ModuleType) -> None:
    model = torch.nn.Linear(3, 1)
    hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), num_groups=1)


def average_flag(hvd: ModuleType) -> None:
    assert float(hvd.allreduce(torch.tensor([2.0]), average=False)) == 2.0


@pytest.mark.parametrize(
    ("trigger", "horovod_text", "category"),
    [
        (step_after_synchronize, HOROVOD_STEP_AFTER_SYNCHRONIZE, UserWarning),
        (num_groups, HOROVOD_NUM_GROUPS, DeprecationWarning),
        (average_flag, HOROVOD_AVERAGE, DeprecationWarning),
    ],
)
def test_filters_written_for_horovod_match(
    hvd: ModuleType, trigger: object, horovod_text: str, category: type[Warning]
) -> None:
    assert callable(trigger)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trigger(hvd)
    ours = [w for w in caught if issubclass(w.category, category)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert str(ours[0].message).startswith(horovod_text)
    # The way users silence it: every other warning is an error, Horovod's is ignored.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=re.escape(horovod_text), category=category)
        trigger(hvd)
    # ... and a filter on the first words, as often written by hand.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=re.escape(horovod_text[:30]))
        trigger(hvd)
