"""What the torch frontend's ops accept.

Tensors whose layout torch calls contiguous but whose last stride is not 1: a dimension of
size 1 may carry any stride (``x[:, 1]`` of a one-row ``x`` has shape ``(1,)`` and stride
``(3,)``). Every allreduce entry point takes them, in place too, and the job stays usable.
One rank in this process: the small allreduce that failed rides the negotiation at any size.

``op=``: Horovod's ops or their integers; torch.distributed's ``ReduceOp`` compares equal to
integers that are other ops of Horovod's, and is refused.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
import torch.distributed as dist


def _row() -> tuple[torch.Tensor, torch.Tensor]:
    """A one-row matrix and its column 1: shape (1,), stride (3,)."""
    matrix = torch.tensor([[1.0, 2.0, 3.0]])
    column = matrix[:, 1]
    assert column.is_contiguous() and column.stride() == (3,)
    return matrix, column


def test_allreduce_of_a_view_with_a_non_unit_last_stride(hvd: ModuleType) -> None:
    for _ in range(3):  # (the first op and its repetitions take different paths)
        matrix, column = _row()
        assert hvd.allreduce_(column, op=hvd.Sum) is column
        assert matrix.tolist() == [[1.0, 2.0, 3.0]]

        matrix, column = _row()
        assert hvd.synchronize(hvd.allreduce_async_(column, op=hvd.Sum)) is column
        assert matrix.tolist() == [[1.0, 2.0, 3.0]]

        matrix, column = _row()
        assert hvd.grouped_allreduce_([column], op=hvd.Sum)[0] is column
        assert matrix.tolist() == [[1.0, 2.0, 3.0]]

        _, column = _row()
        assert hvd.synchronize(hvd.allreduce_async(column, op=hvd.Sum)).tolist() == [2.0]

        matrix = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
        reduced = hvd.allreduce(matrix[:, 1], op=hvd.Sum)
        reduced.sum().backward()
        assert reduced.tolist() == [2.0]
        assert matrix.grad is not None and matrix.grad.tolist() == [[0.0, 1.0, 0.0]]

        square = torch.arange(4.0).reshape(1, 1, 4)[:, :, ::4]  # shape (1, 1, 1), stride 4
        assert hvd.allreduce(square, op=hvd.Max, name="square").tolist() == [[[0.0]]]
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [1.0, 1.0]


def test_torch_distributed_reduce_op_is_refused(hvd: ModuleType) -> None:
    tensor = torch.ones(2)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT):
        with pytest.raises(TypeError, match=r"torch\.distributed's ReduceOp"):
            hvd.allreduce(tensor, op=op)
        with pytest.raises(TypeError, match=r"op must be hvd\.Average"):
            hvd.reducescatter(tensor, op=op)
    with pytest.raises(TypeError, match=r"op must be hvd\.Average"):
        hvd.grouped_allreduce([tensor], op=1.0)
    assert hvd.allreduce(tensor, op=1).tolist() == [1.0, 1.0]  # (Horovod's Sum)
    assert hvd.allreduce(tensor, op=hvd.Min).tolist() == [1.0, 1.0]


def test_grouped_ops_refuse_a_tensor_for_their_list(hvd: ModuleType) -> None:
    tensor = torch.ones(3)  # (iterated, its rows would become three ops of the group)
    grouped = (
        hvd.grouped_allreduce,
        hvd.grouped_allreduce_,
        hvd.grouped_allreduce_async,
        hvd.grouped_allreduce_async_,
        hvd.grouped_allgather,
        hvd.grouped_allgather_async,
        hvd.grouped_reducescatter,
        hvd.grouped_reducescatter_async,
    )
    for function in grouped:
        with pytest.raises(TypeError, match="takes a list of tensors, got a tensor"):
            function(tensor)
    assert hvd.grouped_allreduce_((t for t in [tensor]), op=hvd.Sum)[0] is tensor
