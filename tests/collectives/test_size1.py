"""The runtime in this process, without hvdrun: a real one-rank Gloo job.

Every op must be the identity (or its scaled form) on one rank, and the lifecycle
(errors before init, init twice, init after shutdown) must behave like Horovod's.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

import collectives.torch as hvd_module
from collectives import runtime
from collectives.engine.config import from_environment

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.uint8,
    torch.uint16,
    torch.uint32,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
]


def test_queries_before_init_raise(alone: None) -> None:
    assert not hvd_module.is_initialized()
    for query in (hvd_module.rank, hvd_module.size, hvd_module.local_rank, hvd_module.cross_size):
        with pytest.raises(ValueError, match=r"call hvd\.init\(\)"):
            query()
    with pytest.raises(ValueError, match=r"hvd\.init\(\)"):
        hvd_module.allreduce(torch.ones(2))
    with pytest.raises(ValueError, match=r"hvd\.init\(\)"):
        hvd_module.broadcast_object(1)

    @hvd_module.elastic.run
    def train(state: object) -> None:
        raise AssertionError("ran before hvd.init()")

    # (the call the script made, not the first collective inside it; "again" where an
    # earlier test of this process shut its runtime down)
    with pytest.raises(
        ValueError, match=r"call hvd\.init\(\)( again)? before using hvd\.elastic\.run$"
    ):
        train(hvd_module.elastic.ObjectState(epoch=0))


def test_an_uncaught_error_is_printed_as_without_hvd_however_many_init_rounds(
    alone: None,
) -> None:
    # torch wraps sys.excepthook with a "[rankN]:" prefix on every init_process_group:
    # Horovod's tracebacks have none, and after many hvd.init() rounds (or elastic resets)
    # each traceback line carried one per round.
    plain = sys.excepthook
    sys.excepthook = sys.__excepthook__
    try:
        for _ in range(5):
            hvd_module.init()
            hvd_module.shutdown()
        assert sys.excepthook is sys.__excepthook__
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                raise ValueError("the script's own error")
            except ValueError:
                sys.excepthook(*sys.exc_info())
        lines = err.getvalue().splitlines()
        assert lines[0] == "Traceback (most recent call last):", lines
        assert lines[-1] == "ValueError: the script's own error", lines
    finally:
        sys.excepthook = plain


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
    # an op after shutdown (a thread the script left running) says why it cannot run
    with pytest.raises(ValueError, match=r"hvd.shutdown\(\) was called; call hvd.init\(\) again"):
        hvd_module.allreduce(torch.ones(1))
    hvd_module.shutdown()  # harmless when not initialized
    hvd_module.init()
    try:
        assert hvd_module.allreduce(torch.tensor([2.0])).item() == 2.0
    finally:
        hvd_module.shutdown()


def test_init_with_a_process_set_it_cannot_register_leaves_nothing_initialized(
    alone: None, caplog: pytest.LogCaptureFixture
) -> None:
    """init() is all or nothing: a set that cannot be registered fails it and the rank is
    not initialized, so a corrected init() registers its sets (before, the first call left
    the rank initialized and the next one did nothing, without a word)."""
    with pytest.raises(ValueError, match=r"process set ranks \[5\] are not ranks of this job"):
        hvd_module.init(process_sets=[hvd_module.ProcessSet([0, 5])])
    assert not hvd_module.is_initialized() and not dist.is_initialized()
    good = hvd_module.ProcessSet([0])
    with pytest.raises(ValueError, match="already registered"):
        hvd_module.init(process_sets=[good])  # (the global set has ranks [0] already)
    assert not hvd_module.is_initialized()
    hvd_module.init()
    try:
        late = hvd_module.ProcessSet([0])
        hvd_module.init(process_sets=[late])  # initialized: registers nothing, and says so
        assert late.process_set_id is None
        assert "registers none of its process_sets" in caplog.text
    finally:
        hvd_module.shutdown()


def test_init_joins_an_existing_default_group(alone: None) -> None:
    # A framework made the default group first: hvd.init() joins it and leaves it be.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    default = dist.group.WORLD
    try:
        hvd_module.init()
        assert (hvd_module.rank(), hvd_module.size(), hvd_module.local_size()) == (0, 1, 1)
        assert hvd_module.allreduce(torch.tensor([3.0]), op=hvd_module.Sum).item() == 3.0
        hvd_module.shutdown()
        assert dist.is_initialized() and dist.group.WORLD is default
        tensor = torch.tensor([2.0])
        dist.all_reduce(tensor)
        assert tensor.item() == 2.0
        hvd_module.init()  # joins it again
        assert hvd_module.broadcast_object("again") == "again"
    finally:
        hvd_module.shutdown()
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_op_is_identity(hvd: ModuleType, dtype: torch.dtype) -> None:
    x = torch.tensor([[1, 2, 3], [4, 5, 7]], dtype=dtype)
    for op in (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product):
        out = hvd.allreduce(x, op=op)
        assert out.dtype == dtype and torch.equal(out, x), op
        assert out is not x
        assert torch.equal(hvd.reducescatter(x, op=op), x)
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Sum) is y and torch.equal(y, x)
    assert torch.equal(hvd.allgather(x), x)
    assert torch.equal(hvd.broadcast(x, 0), x)
    z = x.clone()
    assert hvd.broadcast_(z, 0) is z and torch.equal(z, x)
    assert [t.dtype for t in hvd.grouped_allreduce([x, x.double()])] == [dtype, torch.float64]
    assert torch.equal(hvd.alltoall(x), x)
    out, received = hvd.alltoall(x, splits=[2])
    assert torch.equal(out, x) and received.tolist() == [2] and received.dtype == torch.int32
    gathered = hvd.grouped_allgather([x, x[:1]])
    assert all(torch.equal(a, b) for a, b in zip(gathered, [x, x[:1]], strict=True))
    assert torch.equal(hvd.grouped_reducescatter([x], op=hvd.Sum)[0], x)
    for handle, want in [
        (hvd.allgather_async(x), x),
        (hvd.broadcast_async(x, 0), x),
        (hvd.reducescatter_async(x, op=hvd.Max), x),
        (hvd.grouped_allreduce_async([x], op=hvd.Sum), [x]),
        (hvd.grouped_allgather_async([x]), [x]),
        (hvd.grouped_reducescatter_async([x], op=hvd.Sum), [x]),
    ]:
        got = hvd.synchronize(handle)
        if isinstance(want, list):
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        else:
            assert torch.equal(got, want)


def test_bool_and_edge_shapes(hvd: ModuleType) -> None:
    flags = torch.tensor([True, False])
    assert torch.equal(hvd.allreduce(flags, op=hvd.Max), flags)
    assert torch.equal(hvd.allgather(flags), flags)
    assert torch.equal(hvd.broadcast(flags, 0), flags)
    scalar = torch.tensor(3.0)
    assert hvd.allreduce(scalar).shape == ()
    empty = torch.zeros(0, 3)
    assert hvd.allreduce(empty).shape == (0, 3)
    assert hvd.allgather(empty).shape == (0, 3)
    assert hvd.broadcast(empty, 0).shape == (0, 3)
    # A gradient expanded from a scalar has stride 0: it must still travel correctly.
    expanded = torch.ones(()).expand(1)
    assert torch.equal(hvd.allgather(expanded), torch.ones(1))
    assert torch.equal(hvd.allreduce(torch.ones(()).expand(2, 2)), torch.ones(2, 2))
    noncontiguous = torch.arange(6.0).reshape(2, 3).t()
    assert hvd.allreduce_(noncontiguous, op=hvd.Sum) is noncontiguous
    assert torch.equal(noncontiguous, torch.arange(6.0).reshape(2, 3).t())


def test_join_and_barrier(hvd: ModuleType) -> None:
    hvd.barrier()
    hvd.barrier(process_set=hvd.global_process_set)
    assert hvd.join() == 0
    assert hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist() == [1.0, 1.0]


def test_many_long_named_ops_overflow_one_negotiation_slot(hvd: ModuleType) -> None:
    # ~200 bytes per record: 500 of them are far more than one 4 KB negotiation slot.
    names = [f"model.layer{i}." + "x" * 150 for i in range(500)]
    handles = [hvd.allreduce_async(torch.full((3,), float(i)), name=n) for i, n in enumerate(names)]
    assert all(hvd.synchronize(h).tolist() == [float(i)] * 3 for i, h in enumerate(handles))
    handles = [hvd.allreduce_async(torch.ones(1), name=n) for n in names]  # after the growth
    assert all(hvd.synchronize(h).item() == 1.0 for h in handles)


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
    with pytest.raises(ValueError, match="supersedes average"):
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
    with pytest.raises(ValueError, match=r"^hvd\.broadcast_object: root_rank 1 is out of range"):
        hvd.broadcast_object({"a": 1}, root_rank=1)  # (named as called, not as its parts)
    with pytest.raises(TypeError, match="Adasum needs floating-point"):
        hvd.allreduce(torch.ones(1, dtype=torch.int32), op=hvd.Adasum)
    assert hvd.allreduce(torch.ones(2), op=hvd.Adasum).tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0]))
    with pytest.raises(ValueError, match="already registered"):
        hvd.add_process_set([0])  # the global set has the same ranks
    with pytest.raises(ValueError, match="not ranks of this job"):
        hvd.add_process_set([0, 1])
    with pytest.raises(ValueError, match="control character"):
        hvd.allreduce(torch.ones(1), name="a\x1fb")
    with pytest.raises(TypeError, match="tensors"):
        hvd.allgather([1, 2])
    with pytest.raises(ValueError, match="at least one dimension"):
        hvd.alltoall(torch.tensor(1.0))
    with pytest.raises(TypeError, match="splits must be integers"):
        hvd.alltoall(torch.ones(2), splits=[0.5, 1.5])
    with pytest.raises(TypeError, match="dtype"):
        hvd.allreduce(torch.ones(1, dtype=torch.uint64))
    with pytest.raises(TypeError, match="bool"):
        hvd.allreduce(torch.ones(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="not MIN"):
        hvd.DistributedOptimizer(torch.optim.SGD([torch.ones(1, requires_grad=True)]), op=hvd.Min)
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
    deadline = time.monotonic() + 10
    while not hvd.poll(handle) and time.monotonic() < deadline:  # the engine runs it alone
        time.sleep(0.001)
    assert hvd.poll(handle)
    result = hvd.synchronize(handle)
    assert result is not None and result.item() == 4.0
    assert hvd.synchronize(handle) is None
    with pytest.raises(ValueError, match="unknown handle"):
        hvd.poll(handle)


def test_results_that_carry_gradients_can_be_changed_in_place(hvd: ModuleType) -> None:
    # Horovod's outputs are tensors of their own: `y = hvd.allreduce(x); y += b` (and
    # ReLU(inplace=True)) work on them, small or large (the engine's pooled memory).
    for n in (3, 100_000):
        x = torch.ones(n, requires_grad=True)
        outputs = [
            hvd.allreduce(x, op=hvd.Sum),
            *hvd.grouped_allreduce([x, x * 2]),
            hvd.allgather(x),
            *hvd.grouped_allgather([x]),
            hvd.broadcast(x, 0),
            hvd.alltoall(x),
            hvd.reducescatter(x, op=hvd.Sum),
            *hvd.grouped_reducescatter([x], op=hvd.Sum),
        ]
        for y in outputs:
            y.mul_(3)
            torch.relu_(y)
        sum(y.sum() for y in outputs).backward()
        assert x.grad is not None and x.grad.tolist() == [30.0] * n  # (3 * (1 + 2 + 7))


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
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # empty: Horovod's dummy step
    assert len(optimizer.state) == 2
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
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
    # Horovod's parameter -> name table, which scripts read
    assert wrapped._parameter_names == {dist_model.weight: "weight", dist_model.bias: "bias"}
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


def test_distributed_optimizer_has_horovods_public_attributes(hvd: ModuleType) -> None:
    # Horovod's optimizer keeps its arguments under these names, and scripts read them
    # (``loss / opt.backward_passes_per_step``).
    model = torch.nn.Linear(2, 1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=3,
        gradient_predivide_factor=2.0,
        sparse_as_dense=True,
    )
    assert opt.backward_passes_per_step == 3 and opt.op == hvd.Average
    assert (opt.gradient_predivide_factor, opt.sparse_as_dense) == (2.0, True)
    assert opt.process_set is hvd.global_process_set
    opt.set_backward_passes_per_step(5)
    assert opt.backward_passes_per_step == 5


def test_distributed_optimizer_alone_steps_as_the_wrapped_optimizer(hvd: ModuleType) -> None:
    # As in Horovod: alone there is nothing to reduce, so the gradients stay exactly as
    # backward left them (fp16 compression rounds nothing), passes accumulate without the
    # backward_passes_per_step check, and zero_grad() may come anywhere. Adasum steps in
    # its hooks, so it keeps them (and its compression).
    for op in (hvd.Average, hvd.Adasum):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).double()
        ref = torch.nn.Linear(4, 2).double()
        ref.load_state_dict(model.state_dict())
        wrapped = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16,
            op=op,
        )
        plain = torch.optim.SGD(ref.parameters(), lr=0.1)
        x = torch.randn(5, 4, dtype=torch.float64) / 3
        for module, optimizer in ((model, wrapped), (ref, plain)):
            optimizer.zero_grad()
            module(x).pow(2).mean().backward()
            if op == hvd.Average:  # a second pass, and a zero_grad() before step()
                module(x).sum().backward()
                optimizer.zero_grad()
                module(x).pow(2).mean().backward()
            optimizer.step()
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            if op == hvd.Average:
                assert torch.equal(a, b)
            else:  # (the change of the parameter travels in fp16)
                assert torch.allclose(a, b, atol=1e-3) and not torch.equal(a, b)


def test_build_queries(alone: None) -> None:
    assert hvd_module.gloo_built() and hvd_module.gloo_enabled()
    assert not hvd_module.mpi_built() and not hvd_module.mpi_enabled()
    assert hvd_module.nccl_built() == dist.is_nccl_available()
    assert hvd_module.cuda_built() == (torch.backends.cuda.is_built() and torch.version.hip is None)
    assert hvd_module.rocm_built() == (torch.version.hip is not None)


def test_horovod_internal_error_is_runtime_error() -> None:
    assert issubclass(hvd_module.HorovodInternalError, RuntimeError)


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


@pytest.fixture
def slow_cycles(alone: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """An engine that negotiates only when someone waits: submitted ops stay in flight."""
    monkeypatch.setenv("HVDRUN_CYCLE_TIME", "60000")
    hvd_module.init()
    try:
        yield hvd_module
    finally:
        hvd_module.shutdown()


def test_async_ops_stay_in_flight_until_negotiated(slow_cycles: ModuleType) -> None:
    hvd = slow_cycles
    x = torch.ones(3)
    handle = hvd.allreduce_async_(x, name="pending", op=hvd.Sum)
    time.sleep(0.05)
    assert not hvd.poll(handle)
    with pytest.raises(ValueError, match="already in flight"):
        hvd.allreduce_async(torch.ones(3), name="pending")
    assert hvd.synchronize(handle) is x  # waiting negotiates at once
    again = hvd.allreduce_async(torch.ones(3), name="pending")  # free again
    assert hvd.synchronize(again).tolist() == [1.0, 1.0, 1.0]
    # Unnamed ops get distinct automatic names, so they never collide.
    handles = [hvd.allreduce_async(torch.full((2,), float(i))) for i in range(50)]
    assert [hvd.synchronize(h)[0].item() for h in handles] == [float(i) for i in range(50)]


def test_timeline_at_runtime(hvd: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "sub" / "timeline.json"
    hvd.start_timeline(str(path), mark_cycles=True)
    handles = [hvd.allreduce_async(torch.ones(4), name=f"t.{i}") for i in range(5)]
    hvd.allgather(torch.ones(2), name="g")
    with open(path) as file:
        json.load(file)  # valid while being written
    for handle in handles:
        hvd.synchronize(handle)
    hvd.stop_timeline()
    events = json.loads(path.read_text())
    rows = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert "allreduce.t.0" in rows.values() and "allgather.g" in rows.values()
    balance: dict[int, int] = {}
    for event in events:
        if event["ph"] in "BE":
            balance[event["pid"]] = balance.get(event["pid"], 0) + (1 if event["ph"] == "B" else -1)
            assert balance[event["pid"]] >= 0
    assert all(v == 0 for v in balance.values())
    assert any(e["name"] == "CYCLE_START" for e in events)
    hvd.stop_timeline()  # stopping twice is harmless
    hvd.allreduce(torch.ones(1), name="after")
    assert "allreduce.after" not in path.read_text()


def test_start_timeline_again_on_the_file_being_written(hvd: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    hvd.start_timeline(str(path))
    hvd.allreduce(torch.ones(2), name="first")
    # An op still negotiating when the recording restarts (a peer is late): its phase is
    # open, and the old recording ends it, in its own file, before the new one starts it.
    engine = runtime.engine("test")
    assert engine.timeline is not None
    engine.timeline.begin("allreduce.open", "NEGOTIATE_ALLREDUCE", time.monotonic())
    hvd.start_timeline(str(path))
    hvd.allreduce(torch.ones(2), name="second")
    hvd.stop_timeline()
    events = json.loads(path.read_text())
    rows = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert "allreduce.second" in rows and "allreduce.first" not in rows, rows


def test_a_timeline_that_cannot_be_written_is_skipped_with_a_warning(tmp_path: Path) -> None:
    # As Horovod: the job runs on without a timeline, and the rank says why (the path is a
    # setting of the whole job; a host may lack its directory).
    blocker = tmp_path / "file"
    blocker.write_text("")
    env = {**os.environ, "HOROVOD_TIMELINE": str(blocker / "t.json")}
    code = "import torch, collectives.torch as hvd; hvd.init(); print(hvd.allreduce(torch.ones(2)))"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "tensor([1., 1.])" in done.stdout
    assert "rank 0 writes no timeline" in done.stderr and str(blocker) in done.stderr
    assert "Traceback" not in done.stderr


def test_an_interface_the_host_lacks_is_named_at_init() -> None:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo,nosuchif9"}
    code = "import collectives.torch as hvd; hvd.init()"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "GLOO_SOCKET_IFNAME=lo,nosuchif9 names nosuchif9, which this host" in last, last
    assert "its interfaces: lo" in last


def test_config_reads_both_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "FUSION_THRESHOLD",
        "CYCLE_TIME",
        "TIMELINE",
        "TIMELINE_MARK_CYCLES",
        "STALL_CHECK_DISABLE",
        "STALL_CHECK_TIME_SECONDS",
        "STALL_SHUTDOWN_TIME_SECONDS",
        "GLOO_TIMEOUT_SECONDS",
    ):
        monkeypatch.delenv("HVDRUN_" + name, raising=False)
        monkeypatch.delenv("HOROVOD_" + name, raising=False)
    defaults = from_environment()
    assert defaults.fusion_threshold == 128 * 1024 * 1024
    assert defaults.cycle_time_ms == 1.0 and defaults.timeline is None
    assert defaults.stall_check and defaults.stall_warning_seconds == 60.0
    assert defaults.stall_shutdown_seconds == 0.0 and defaults.collective_timeout_seconds == 30.0
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1000")
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "3.5")
    monkeypatch.setenv("HOROVOD_TIMELINE", "/tmp/t.json")
    monkeypatch.setenv("HOROVOD_TIMELINE_MARK_CYCLES", "1")
    monkeypatch.setenv("HOROVOD_STALL_CHECK_DISABLE", "true")
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "5")
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "9")
    config = from_environment()
    assert (config.fusion_threshold, config.cycle_time_ms, config.timeline) == (
        1000,
        3.5,
        "/tmp/t.json",
    )
    assert config.timeline_mark_cycles and not config.stall_check
    assert (config.stall_warning_seconds, config.stall_shutdown_seconds) == (5.0, 9.0)
    monkeypatch.setenv("HOROVOD_TIMELINE", "DYNAMIC")  # Horovod's: none until start_timeline()
    assert from_environment().timeline is None
    monkeypatch.setenv("HVDRUN_FUSION_THRESHOLD", "2000")  # HVDRUN_ wins
    assert from_environment().fusion_threshold == 2000
    monkeypatch.setenv("HVDRUN_CYCLE_TIME", "soon")
    with pytest.raises(ValueError, match="HVDRUN_CYCLE_TIME must be a number"):
        from_environment()
    monkeypatch.setenv("HVDRUN_CYCLE_TIME", "-1")
    with pytest.raises(ValueError, match="HVDRUN_CYCLE_TIME must be at least 0"):
        from_environment()
    monkeypatch.setenv("HVDRUN_CYCLE_TIME", "1")
    monkeypatch.setenv("HVDRUN_TIMELINE_MARK_CYCLES", "maybe")
    with pytest.raises(ValueError, match="0 or 1"):
        from_environment()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ops_at_size_1(hvd: ModuleType) -> None:
    """The NCCL path at size 1 (run wherever a GPU is at hand; CI has none)."""
    device = torch.device("cuda", torch.cuda.current_device())
    for dtype in (torch.float16, torch.float32, torch.int64, torch.uint8):
        x = torch.arange(12, device=device).reshape(3, 4).to(dtype)
        for op in (hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product):
            assert torch.equal(hvd.allreduce(x, op=op), x)
        assert torch.equal(hvd.allgather(x), x)
        assert torch.equal(hvd.broadcast(x, 0), x)
        assert torch.equal(hvd.alltoall(x), x)
        assert torch.equal(hvd.reducescatter(x, op=hvd.Sum), x)
        outs = hvd.grouped_allreduce([x, x[:1]], op=hvd.Sum)
        assert torch.equal(outs[0], x) and torch.equal(outs[1], x[:1])
    flags = torch.tensor([True, False], device=device)
    assert torch.equal(hvd.allreduce(flags, op=hvd.Max), flags)
    y = torch.ones(1000, device=device)
    handles = [hvd.allreduce_async_(y[i::10], op=hvd.Sum) for i in range(10)]
    for handle in handles:
        hvd.synchronize(handle)
    assert torch.equal(y, torch.ones(1000, device=device))
    big = torch.randn(1 << 20, device=device)
    assert torch.equal(hvd.allreduce(big, op=hvd.Sum), big)


def test_error_classes_follow_horovod() -> None:
    # Horovod raises RuntimeError for these; elastic mode must not take them for a lost peer.
    for cls in (
        hvd_module.TensorMismatchError,
        hvd_module.NotSupportedWithJoinError,
        hvd_module.InvalidSplitsError,
    ):
        assert issubclass(cls, hvd_module.CollectiveError)
        assert issubclass(cls, RuntimeError)
        assert not issubclass(cls, hvd_module.HorovodInternalError)
    assert issubclass(hvd_module.TensorMismatchError, ValueError)
    assert issubclass(hvd_module.InvalidSplitsError, ValueError)
    assert issubclass(hvd_module.InvalidSplitsError, TypeError)


def test_broadcast_root_is_a_global_rank_of_the_set() -> None:
    from collectives.engine.execute import Group
    from collectives.ops import root_index

    odd = Group(1, [1, 3], 0)
    assert root_index(3, odd, "broadcast") == 1
    assert root_index(1, odd, "broadcast") == 0
    with pytest.raises(
        ValueError, match=r"root_rank 2 is not a member of the process set \[1, 3\]"
    ):
        root_index(2, odd, "broadcast")
    with pytest.raises(TypeError, match="root_rank must be an int"):
        root_index(1.0, odd, "broadcast")
    everyone = Group(0, [0, 1, 2, 3], 2)
    assert root_index(3, everyone, "broadcast") == 3
    with pytest.raises(ValueError, match="out of range for a job of size 4"):
        root_index(4, everyone, "broadcast")


def test_alltoall_splits_must_be_integers(hvd: ModuleType) -> None:
    for splits in (torch.ones(1), [1.0], torch.tensor([True]), 1):
        with pytest.raises(hvd.InvalidSplitsError, match="splits must be integers"):
            hvd.alltoall(torch.ones(1), splits=splits)
    out, received = hvd.alltoall(torch.ones(2), splits=torch.tensor([2], dtype=torch.int32))
    assert torch.equal(out, torch.ones(2)) and received.tolist() == [2]


def test_sparse_allreduce_async_alone(hvd: ModuleType) -> None:
    dense = torch.zeros(4, 2)
    dense[1] = torch.tensor([1.0, 2.0])
    for op in (hvd.Sum, hvd.Average):
        handle = hvd.sparse_allreduce_async(dense.to_sparse(1), "alone", op)
        assert isinstance(handle, int) and hvd.poll(handle) in (True, False)
        result = hvd.synchronize(handle)
        assert result.is_sparse and torch.equal(result.to_dense(), dense)
    assert torch.equal(hvd.sparse_allreduce_async(dense.to_sparse(), None, hvd.Sum)().to_dense(),
                       dense)  # fmt: skip
    with pytest.raises(TypeError, match="sparse COO tensor"):
        hvd.sparse_allreduce_async(dense, "dense", hvd.Sum)
    with pytest.raises(NotImplementedError, match="Average or Sum"):
        hvd.sparse_allreduce_async(dense.to_sparse(), "min", hvd.Min)
    # The dense ops refuse a sparse tensor by name, pointing to the sparse op.
    for call in (hvd.allreduce, hvd.allreduce_, hvd.allreduce_async):
        with pytest.raises(TypeError, match=r"sparse tensors.*sparse_allreduce_async"):
            call(dense.to_sparse())


def test_sparse_as_dense_gives_sparse_adam_sparse_gradients(hvd: ModuleType) -> None:
    for sparse_as_dense in (True, False):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(5, 2, sparse=True)
        ref = torch.nn.Embedding(5, 2, sparse=True)
        ref.load_state_dict(emb.state_dict())
        opt = hvd.DistributedOptimizer(
            torch.optim.SparseAdam(emb.parameters(), lr=0.1), sparse_as_dense=sparse_as_dense
        )
        ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
        for _ in range(2):
            for module, optimizer in ((emb, opt), (ref, ref_opt)):
                optimizer.zero_grad()
                module(torch.tensor([0, 3, 3])).sum().backward()
                optimizer.step()
            assert emb.weight.grad.is_sparse
            assert torch.equal(emb.weight.grad.to_dense(), ref.weight.grad.to_dense())
        assert torch.allclose(emb.weight, ref.weight)
