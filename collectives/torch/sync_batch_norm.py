"""``hvd.SyncBatchNorm``: batch normalisation with statistics over the whole job's batch.

In training mode every rank contributes the per-channel sum, sum of squares and element
count of its slice; one Sum allreduce gives the global mean and (biased) variance, so the
output equals ``BatchNorm`` applied to the concatenation of all ranks' batches, even when
ranks hold different batch sizes. The backward pass reduces ``sum(dy)`` and
``sum(dy * x_hat)`` the same way, so input gradients match the single-process ones too;
weight and bias gradients stay local and are averaged by ``DistributedOptimizer`` like any
other parameter. In eval mode (or a job of size 1) it is plain ``BatchNorm`` with the
running statistics.

A public API module (Horovod's ``horovod.torch.sync_batch_norm``), built on the public op API
(:mod:`collectives.torch.mpi_ops`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from collectives.common import ProcessSet, global_process_set
from collectives.torch import mpi_ops

__all__ = ["SyncBatchNorm", "SyncBatchNormFunction"]


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _allreduce_sum(tensor: torch.Tensor, process_set: ProcessSet) -> torch.Tensor:
    return mpi_ops.allreduce(tensor, op=mpi_ops.Sum, process_set=process_set)


class SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalisation over every rank's batch, and its gradient (what
    :class:`SyncBatchNorm` applies in training mode)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
        process_set: ProcessSet,
    ) -> torch.Tensor:
        ctx.process_set = process_set
        dims = _reduce_dims(x)
        stat_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        xs = x.to(stat_dtype)
        count = torch.tensor([x.numel() / x.shape[1]], dtype=stat_dtype, device=x.device)
        stats = torch.cat([xs.sum(dims), (xs * xs).sum(dims), count])
        stats = _allreduce_sum(stats, process_set)
        channels = x.shape[1]
        total = stats[-1]
        mean = stats[:channels] / total
        var = (stats[channels : 2 * channels] / total - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)

        if running_mean is not None and running_var is not None:
            unbiased = var * total / (total - 1).clamp_min(1)
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)

        shape = _channel_shape(x)
        x_hat = (xs - mean.view(shape)) * invstd.view(shape)
        out = x_hat
        if weight is not None:
            out = out * weight.to(stat_dtype).view(shape)
        if bias is not None:
            out = out + bias.to(stat_dtype).view(shape)
        ctx.save_for_backward(x_hat, invstd, weight, total)
        ctx.has_bias = bias is not None
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_hat, invstd, weight, total = ctx.saved_tensors
        dy = grad_outputs[0].to(x_hat.dtype)
        dims = _reduce_dims(dy)
        shape = _channel_shape(dy)
        sum_dy_local = dy.sum(dims)
        sum_dy_xhat_local = (dy * x_hat).sum(dims)
        sums = _allreduce_sum(torch.cat([sum_dy_local, sum_dy_xhat_local]), ctx.process_set)
        channels = dy.shape[1]
        sum_dy, sum_dy_xhat = sums[:channels], sums[channels:]
        scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
        dx = (
            dy - (sum_dy / total).view(shape) - x_hat * (sum_dy_xhat / total).view(shape)
        ) * scale.view(shape)
        grad_weight = sum_dy_xhat_local.to(weight.dtype) if weight is not None else None
        grad_bias = sum_dy_local.to(weight.dtype if weight is not None else dy.dtype)
        return (
            dx.to(grad_outputs[0].dtype),
            grad_weight,
            grad_bias if ctx.has_bias else None,
            None,
            None,
            None,
            None,
            None,
        )


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics span every rank's batch (Horovod's SyncBatchNorm);
    for inputs of any rank >= 2, like BatchNorm1d/2d/3d."""

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: Any = None,
        dtype: Any = None,
        process_set: ProcessSet = global_process_set,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_set = process_set

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects at least 2-D input, got {input.dim()}-D")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as in torch's BatchNorm
                momentum = 1.0 / float(self.num_batches_tracked)
        use_batch_stats = self.training or not self.track_running_stats
        if not use_batch_stats or self.process_set.size() == 1:
            return F.batch_norm(
                input,
                self.running_mean if not self.training or self.track_running_stats else None,
                self.running_var if not self.training or self.track_running_stats else None,
                self.weight,
                self.bias,
                use_batch_stats,
                momentum,
                self.eps,
            )
        result = SyncBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if self.track_running_stats else None,
            self.running_var if self.track_running_stats else None,
            self.eps,
            momentum,
            self.process_set,
        )
        assert isinstance(result, torch.Tensor)
        return result
