"""The runtime in this process, without hvdrun: a real one-rank Gloo job.

Every op must be the identity (or its scaled form) on one rank, and the lifecycle
(errors before init, init twice, init after shutdown) must behave like Horovod's.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

import collectives.torch as hvd_module
from collectives.torch import runtime

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
]


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """No trace of a launcher in the environment."""
    for name in ("HVDRUN_RENDEZVOUS_ADDR", "HVDRUN_SECRET", "HVDRUN_JOB_ID"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def hvd(alone: None) -> Iterator[ModuleType]:
    hvd_module.init()
    try:
        yield hvd_module
    finally:
        hvd_module.shutdown()


def test_queries_before_init_raise(alone: None) -> None:
    assert not hvd_module.is_initialized()
    for query in (hvd_module.rank, hvd_module.size, hvd_module.local_rank, hvd_module.cross_size):
        with pytest.raises(ValueError, match=r"call hvd\.init\(\)"):
            query()
    with pytest.raises(ValueError, match=r"hvd\.init\(\)"):
        hvd_module.allreduce(torch.ones(2))
    with pytest.raises(ValueError, match=r"hvd\.init\(\)"):
        hvd_module.broadcast_object(1)


def test_init_shutdown_init(alone: None) -> None:
    hvd_module.init()
    try:
        hvd_module.init()  # a no-op
        assert hvd_module.is_initialized()
        assert (hvd_module.rank(), hvd_module.size()) == (0, 1)
        assert (hvd_module.local_rank(), hvd_module.local_size()) == (0, 1)
        assert (hvd_module.cross_rank(), hvd_module.cross_size()) == (0, 1)
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        hvd_module.shutdown()
    assert not hvd_module.is_initialized()
    assert not dist.is_initialized()
    with pytest.raises(ValueError):
        hvd_module.rank()
    hvd_module.shutdown()  # harmless when not initialized
    hvd_module.init()
    try:
        assert hvd_module.allreduce(torch.tensor([2.0])).item() == 2.0
    finally:
        hvd_module.shutdown()


def test_init_refuses_foreign_default_group(alone: None) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="already has a default process group"):
            hvd_module.init()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_op_is_identity(hvd: ModuleType, dtype: torch.dtype) -> None:
    x = torch.tensor([[1, 2, 3], [4, 5, 7]], dtype=dtype)
    for op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product):
        out = hvd.allreduce(x, op=op)
        assert out.dtype == dtype and torch.equal(out, x), op
        assert out is not x
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Sum) is y and torch.equal(y, x)
    assert torch.equal(hvd.allgather(x), x)
    assert torch.equal(hvd.broadcast(x, 0), x)
    z = x.clone()
    assert hvd.broadcast_(z, 0) is z and torch.equal(z, x)
    assert [t.dtype for t in hvd.grouped_allreduce([x, x.double()])] == [dtype, torch.float64]


def test_scaling_and_integer_average(hvd: ModuleType) -> None:
    x = torch.tensor([1.0, -3.0])
    out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25)
    assert out.tolist() == [0.5, -1.5]
    ints = torch.tensor([5, -5])
    assert hvd.allreduce(ints, op=hvd.Sum, prescale_factor=1.5).tolist() == [7, -7]
    assert hvd.allreduce(ints).tolist() == [5, -5]
    assert hvd.allreduce(ints).dtype == torch.int64


def test_average_alias(hvd: ModuleType) -> None:
    x = torch.tensor([3.0])
    with pytest.warns(DeprecationWarning):
        assert hvd.allreduce(x, average=False).item() == 3.0
    with pytest.raises(ValueError, match="not both"):
        hvd.allreduce(x, average=True, op=hvd.Sum)


def test_allgather_and_objects(hvd: ModuleType) -> None:
    x = torch.arange(6).reshape(3, 2)
    assert torch.equal(hvd.allgather(x), x)
    assert hvd.allgather(torch.zeros(0, 4)).shape == (0, 4)
    with pytest.raises(ValueError, match="at least one dimension"):
        hvd.allgather(torch.tensor(1.0))
    obj = {"a": [1, 2], "b": "text"}
    assert hvd.broadcast_object(obj) == obj
    assert hvd.broadcast_object(obj, root_rank=0, name="named") == obj
    assert hvd.allgather_object(obj) == [obj]


def test_argument_errors(hvd: ModuleType) -> None:
    with pytest.raises(ValueError, match="root_rank 1 is out of range"):
        hvd.broadcast(torch.ones(1), root_rank=1)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(torch.ones(1), op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="process set"):
        hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0], process_set_id=1))
    with pytest.raises(NotImplementedError):
        hvd.add_process_set([0])
    with pytest.raises(TypeError, match="dtype"):
        hvd.allreduce(torch.ones(1, dtype=torch.uint16))
    with pytest.raises(TypeError, match="bool"):
        hvd.allreduce(torch.ones(1, dtype=torch.bool))
    with pytest.raises(NotImplementedError):
        hvd.DistributedOptimizer(
            torch.optim.SGD([torch.ones(1, requires_grad=True)]), op=hvd.Adasum
        )
    with pytest.raises(ValueError, match="gradient_predivide_factor"):
        hvd.DistributedOptimizer(
            torch.optim.SGD([torch.ones(1, requires_grad=True)]),
            op=hvd.Sum,
            gradient_predivide_factor=2.0,
        )
    assert hvd.allreduce(torch.ones(1), process_set=hvd.global_process_set).item() == 1.0


def test_compression_fp16(hvd: ModuleType) -> None:
    x = torch.tensor([0.5, 1.25, -2.0], dtype=torch.float64)
    out = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert out.dtype == torch.float64 and torch.equal(out, x)
    compressed, ctx = hvd.Compression.fp16.compress(x)
    assert compressed.dtype == torch.float16
    assert hvd.Compression.fp16.decompress(compressed, ctx).dtype == torch.float64
    ints = torch.tensor([1, 2])
    assert hvd.Compression.fp16.compress(ints)[0] is ints
    assert hvd.Compression.none.compress(x)[0] is x


def test_autograd_and_async(hvd: ModuleType) -> None:
    x = torch.ones(3, requires_grad=True)
    (hvd.allreduce(x) * 2).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [2.0, 2.0, 2.0]
    x.grad = None
    hvd.broadcast(x, 0).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [1.0, 1.0, 1.0]
    handle = hvd.allreduce_async(torch.tensor([4.0]))
    assert hvd.poll(handle)
    result = hvd.synchronize(handle)
    assert result is not None and result.item() == 4.0
    assert hvd.synchronize(handle) is None


def test_broadcast_parameters_and_optimizer_state(hvd: ModuleType) -> None:
    model = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=0)
    hvd.broadcast_parameters(list(model.parameters()), root_rank=0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError):
        hvd.broadcast_parameters(3, root_rank=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # empty state: nothing to do
    assert len(optimizer.state) == 0
    model(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    state = optimizer.state_dict()
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert optimizer.state_dict()["param_groups"] == state["param_groups"]


def test_distributed_optimizer_matches_plain_training(hvd: ModuleType) -> None:
    torch.manual_seed(0)
    plain_model = torch.nn.Linear(4, 2)
    dist_model = torch.nn.Linear(4, 2)
    dist_model.load_state_dict(plain_model.state_dict())
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.1, momentum=0.9)
    wrapped = hvd.DistributedOptimizer(
        torch.optim.SGD(dist_model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=dist_model.named_parameters(),
    )
    assert issubclass(type(wrapped), torch.optim.SGD)
    assert type(wrapped).__name__ == "SGD"
    for step in range(3):
        x = torch.randn(5, 4)
        for model, optimizer in ((plain_model, plain), (dist_model, wrapped)):
            optimizer.zero_grad()
            model(x).pow(2).mean().backward()
            optimizer.step()
        for a, b in zip(plain_model.parameters(), dist_model.parameters(), strict=True):
            assert torch.equal(a, b), step
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped.synchronize()
        with wrapped.skip_synchronize():
            wrapped.step()
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(dist_model.parameters(), lr=0.1),
            named_parameters=[("w", dist_model.weight), ("w", dist_model.bias)],
        )
    with pytest.raises(ValueError, match="already"):
        hvd.DistributedOptimizer(wrapped)


def test_build_queries(alone: None) -> None:
    assert hvd_module.gloo_built() and hvd_module.gloo_enabled()
    assert not hvd_module.mpi_built() and not hvd_module.mpi_enabled()
    assert hvd_module.nccl_built() == dist.is_nccl_available()
    assert hvd_module.cuda_built() == (torch.backends.cuda.is_built() and torch.version.hip is None)
    assert hvd_module.rocm_built() == (torch.version.hip is not None)


def test_horovod_internal_error_is_runtime_error() -> None:
    assert issubclass(hvd_module.HorovodInternalError, RuntimeError)


def test_env_reads_both_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HVDRUN_GLOO_TIMEOUT_SECONDS", raising=False)
    monkeypatch.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", "12")
    assert runtime.env("GLOO_TIMEOUT_SECONDS") == "12"
    monkeypatch.setenv("HVDRUN_GLOO_TIMEOUT_SECONDS", "7")
    assert runtime.env("GLOO_TIMEOUT_SECONDS") == "7"


def test_timeout_from_environment(alone: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HVDRUN_GLOO_TIMEOUT_SECONDS", "42")
    hvd_module.init()
    try:
        assert runtime.timeout().total_seconds() == 42
    finally:
        hvd_module.shutdown()
    monkeypatch.setenv("HVDRUN_GLOO_TIMEOUT_SECONDS", "soon")
    with pytest.raises(ValueError, match="HVDRUN_GLOO_TIMEOUT_SECONDS"):
        hvd_module.init()
    assert not hvd_module.is_initialized()


def test_step_hooks_run_once(hvd: ModuleType) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    optimizer.load_state_dict(optimizer.state_dict())  # re-patches step functions
    calls: list[int] = []
    optimizer.register_step_pre_hook(lambda *args: calls.append(1))
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert calls == [1]
