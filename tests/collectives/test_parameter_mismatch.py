"""Ranks whose models differ (``torch.nn.Linear(3, 3 + hvd.rank())``): the mismatch of a
``DistributedOptimizer`` bucket or of ``broadcast_parameters`` names the parameters that
differ and each rank's shapes (the engine alone names the fused buffer, ``bias+1`` of shape
[12] against [16], or "tensor 0"), keeping the error's class and the engine's words; a job of
2 ranks (workers/parameter_mismatch_worker.py), and the parts in this process."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from collectives import errors
from collectives.torch import functions
from tests.collectives.conftest import WORKERS, assert_all_ok, run_hvdrun

_CHECKS = [
    *(f"optimizer.flat.{part}" for part in ("class", "engine_words", "names.0", "names.1")),
    "optimizer.flat.names.2",
    "optimizer.flat.usable_after",
    *(f"optimizer.grouped.{part}" for part in ("class", "engine_words", "names.0", "names.1")),
    "optimizer.grouped.usable_after",
    "optimizer.dtype.names.0",
    "optimizer.frozen.names.0",
    "optimizer.frozen.only_it",
    "optimizer.frozen.usable_after",
    *(f"broadcast.state_dict.{part}" for part in ("class", "engine_words", "names.1", "names.2")),
    "broadcast.list.names.0",
    "broadcast.list.names.1",
    "broadcast.one.names.0",
    "broadcast.one.only_them",
    "broadcast.usable_after",
    "roots.class",
    "roots.unchanged",
    "optimizer_state.names",
    "optimizer_state.model_names",
]


def test_mismatched_models_name_their_parameters_on_two_ranks() -> None:
    code, output = run_hvdrun(2, WORKERS / "parameter_mismatch_worker.py", timeout=150)
    assert_all_ok(code, output, 2, _CHECKS)


# ---- the parts ---------------------------------------------------------------------------


def _outline(*tensors: tuple[str, list[int], str]) -> list[tuple[str, dict[str, str]]]:
    """Outlines as a rank sends them: (label, fields) of each tensor."""
    return [
        (label, {"shape": str(shape), "dtype": dtype, "device type": "cpu"})
        for label, shape, dtype in tensors
    ]


def test_differences_name_each_tensor_that_differs_and_group_the_ranks() -> None:
    alike = ("'a'", [2], "float32")
    said = functions._tensor_differences(
        {
            0: _outline(alike, ("'w'", [3, 3], "float32")),
            1: _outline(alike, ("'w'", [4, 3], "float64")),
            2: _outline(alike, ("'w'", [4, 3], "float32"), ("'extra'", [1], "float32")),
        }
    )
    assert said == [
        "'w' has shape [3, 3] on rank 0, [4, 3] on ranks 1, 2 and dtype float32 on ranks 0, 2, "
        "float64 on rank 1",
        "'extra' is missing on ranks 0, 1",
    ]
    assert functions._tensor_differences({0: _outline(alike), 1: _outline(alike)}) == []


def _explain(error: errors.TensorMismatchError) -> errors.TensorMismatchError:
    named = [("'weight'", torch.zeros(3, 3)), ("'bias'", torch.zeros(3))]
    every = functions.global_process_set
    return functions.explain_mismatch(error, named, "It carries 2", every, "test.mismatch")


def test_alike_tensors_leave_the_error_as_it_was(hvd: ModuleType) -> None:
    error = errors.TensorMismatchError("broadcast 'x': ranks disagree on the root")
    assert _explain(error) is error


def test_the_error_keeps_its_class(hvd: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another rank's outline (as from a job of 2: this process is rank 0 of 1).
    monkeypatch.setattr(
        functions.ops,
        "resolve_process_set",
        lambda *_: (None, type("Group", (), {"ranks": [0, 1]})()),
    )
    theirs = _outline(("'weight'", [4, 3], "float32"), ("'bias'", [3], "float32"))
    monkeypatch.setattr(functions, "allgather_object", lambda mine, **_: [mine, theirs])
    error = _explain(errors.InvalidArgumentsError("allreduce 'b': ranks disagree on the shape"))
    assert type(error) is errors.InvalidArgumentsError
    assert str(error) == (
        "allreduce 'b': ranks disagree on the shape. It carries 2. What differs between the "
        "ranks: 'weight' has shape [3, 3] on rank 0, [4, 3] on rank 1"
    )


def test_without_the_allgather_this_ranks_tensors_are_listed(
    hvd: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(*_: object, **__: object) -> None:
        raise errors.NotSupportedWithJoinError("allgather 'x': rank(s) [2] called hvd.join()")

    monkeypatch.setattr(functions, "allgather_object", refused)
    error = _explain(errors.TensorMismatchError("allreduce 'b': ranks disagree on the shape"))
    assert type(error) is errors.TensorMismatchError
    assert str(error) == (
        "allreduce 'b': ranks disagree on the shape. It carries 2. Those of rank 0: 'weight' "
        "[3, 3], 'bias' [3] (the ranks could not compare theirs: allgather 'x': rank(s) [2] "
        "called hvd.join())"
    )
