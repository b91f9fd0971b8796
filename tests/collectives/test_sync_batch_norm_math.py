"""SyncBatchNorm's forward/backward math against torch's BatchNorm, in one process.

At size 1 the statistics allreduce is the identity, so driving the synchronised autograd
function directly must reproduce BatchNorm's outputs, gradients and running statistics.
The multi-rank equivalence runs in the job tests.
"""

from collections.abc import Iterator

import pytest
import torch

import collectives.torch as hvd
from collectives.torch.sync_batch_norm import SyncBatchNorm, SyncBatchNormFunction


@pytest.fixture(autouse=True)
def single_rank() -> Iterator[None]:
    hvd.init()
    yield
    hvd.shutdown()


@pytest.mark.parametrize("shape", [(8, 3), (6, 4, 5), (4, 2, 3, 3)])
def test_function_matches_batch_norm(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    channels = shape[1]
    reference = torch.nn.BatchNorm1d(channels) if len(shape) < 4 else torch.nn.BatchNorm2d(channels)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
        reference.bias.uniform_(-0.5, 0.5)
    weight = reference.weight.detach().clone().requires_grad_()
    bias = reference.bias.detach().clone().requires_grad_()
    running_mean, running_var = torch.zeros(channels), torch.ones(channels)

    x = (torch.randn(*shape, dtype=torch.float64) * 2 + 1).float()
    x_ref = x.clone().requires_grad_()
    x_sync = x.clone().requires_grad_()
    upstream = torch.randn(*shape)

    out_ref = reference(x_ref)
    out_sync = SyncBatchNormFunction.apply(
        x_sync,
        weight,
        bias,
        running_mean,
        running_var,
        reference.eps,
        reference.momentum,
        hvd.global_process_set,
    )
    (out_ref * upstream).sum().backward()
    (out_sync * upstream).sum().backward()

    assert torch.allclose(out_sync, out_ref, atol=1e-5)
    assert torch.allclose(x_sync.grad, x_ref.grad, atol=1e-5)
    assert torch.allclose(weight.grad, reference.weight.grad, atol=1e-4)
    assert torch.allclose(bias.grad, reference.bias.grad, atol=1e-4)
    assert torch.allclose(running_mean, reference.running_mean, atol=1e-6)
    assert torch.allclose(running_var, reference.running_var, atol=1e-5)


def test_module_eval_uses_running_stats() -> None:
    module = SyncBatchNorm(3)
    module.running_mean.fill_(2.0)
    module.running_var.fill_(4.0)
    module.eval()
    x = torch.full((5, 3), 4.0)
    assert torch.allclose(module(x), torch.full((5, 3), 1.0), atol=1e-4)
