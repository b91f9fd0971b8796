"""Every CUDA path of the engine on N ranks sharing the GPUs (``hvdrun --cuda-backend gloo``):
every op and grouped op with exact values, fusion of many tensors, CPU and CUDA ops in one
job, inputs made on a side stream, results used on another stream, DistributedOptimizer,
SyncBatchNorm, broadcast_optimizer_state and object collectives holding CUDA tensors.

``TEST_DEVICE=cpu`` runs the same checks on CPU tensors (to try the worker without a GPU).
Values depend on the rank, so a wrong reduction or a misrouted slice cannot pass.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "collectives" / "workers"))

from checks import Checks

import collectives.torch as hvd

DTYPES = [
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]
MOVE_DTYPES = [*DTYPES, torch.bool, torch.int8]
BASE = torch.tensor([[1, 2, 3], [0, 3, 1]])


def values(q: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return (BASE + q).to(dtype).to(device)


def expected(op: object, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The reduction of every rank's values, computed on the CPU in the dtype itself (so
    integer products wrap as the collective's do)."""
    parts = [values(q, dtype, torch.device("cpu")) for q in range(n)]
    if op == hvd.Sum:
        return torch.stack([p.double() for p in parts]).sum(0).to(dtype)
    if op == hvd.Average:
        return (torch.stack([p.double() for p in parts]).sum(0) / n).to(dtype)
    if op == hvd.Min:
        return torch.stack(parts).min(0).values
    if op == hvd.Max:
        return torch.stack(parts).max(0).values
    out = parts[0].clone()
    for part in parts[1:]:
        out = out * part
    return out


def main() -> None:
    c = Checks()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    kind = os.environ.get("TEST_DEVICE", "cuda")
    if kind == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    cpu = torch.device("cpu")
    weight = sum(q + 1 for q in range(n))  # the sum of (q + 1) over the ranks

    def same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        c.expect(f"{name}.device", got.device == device, got.device)
        c.equal(name, got.to(cpu), want.to(cpu))

    # ---- allreduce: every dtype and op, out of place and in place ----------------------
    for dtype in DTYPES:
        ops = [hvd.Sum, hvd.Min, hvd.Max, hvd.Product]
        if dtype.is_floating_point:
            ops.append(hvd.Average)
        for op in ops:
            tag = f"{op.name}.{dtype}"
            want = expected(op, n, dtype)
            x = values(r, dtype, device)
            same(f"allreduce.{tag}", hvd.allreduce(x, op=op), want)
            same(f"allreduce.input_untouched.{tag}", x, values(r, dtype, cpu))
            y = values(r, dtype, device)
            hvd.synchronize(hvd.allreduce_async_(y, op=op, name=f"inplace.{tag}"))
            same(f"allreduce_async_.{tag}", y, want)
    scaled = hvd.allreduce(
        values(r, torch.float64, device), op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0
    )
    same("allreduce.scaled", scaled, expected(hvd.Sum, n, torch.float64) * 1.5)

    # ---- allgather (ranks contribute different row counts), broadcast, alltoall ---------
    for dtype in MOVE_DTYPES:
        mine = torch.full((r + 1, 2), r % 2 if dtype == torch.bool else r, dtype=dtype)
        want = torch.cat(
            [
                torch.full((q + 1, 2), q % 2 if dtype == torch.bool else q, dtype=dtype)
                for q in range(n)
            ]
        )
        same(f"allgather.{dtype}", hvd.allgather(mine.to(device)), want)
        root = n - 1
        z = torch.full((3, 2), r, dtype=dtype).to(device)
        hvd.broadcast_(z, root_rank=root)
        same(f"broadcast_.{dtype}", z, torch.full((3, 2), root, dtype=dtype))
    # rank r sends q + 1 rows of value 10 r + q to rank q
    splits = torch.tensor([q + 1 for q in range(n)])
    send = torch.cat([torch.full((q + 1, 3), 10.0 * r + q) for q in range(n)]).to(device)
    got, received = hvd.alltoall(send, splits=splits)
    same(
        "alltoall.values", got, torch.cat([torch.full((r + 1, 3), 10.0 * p + r) for p in range(n)])
    )
    c.expect("alltoall.received_splits", received.tolist() == [r + 1] * n, received)

    # ---- reducescatter: uneven rows (Horovod's split), Sum and Average -------------------
    rows = 2 * n + 1
    base = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
    part = [rows // n + (1 if q < rows % n else 0) for q in range(n)]
    start = sum(part[:r])
    out = hvd.reducescatter(base.to(device) * (r + 1), op=hvd.Sum)
    same("reducescatter.sum", out, base[start : start + part[r]] * weight)
    out = hvd.reducescatter(base.to(device) * (r + 1), op=hvd.Average)
    same("reducescatter.average", out, base[start : start + part[r]] * weight / n)

    # ---- grouped ops ---------------------------------------------------------------------
    group = [values(r, torch.float32, device), values(r, torch.int64, device)]
    outs = hvd.grouped_allreduce(group, op=hvd.Sum)
    same("grouped_allreduce.0", outs[0], expected(hvd.Sum, n, torch.float32))
    same("grouped_allreduce.1", outs[1], expected(hvd.Sum, n, torch.int64))
    gathered = hvd.grouped_allgather([torch.full((r + 1,), float(r)).to(device), group[1]])
    same(
        "grouped_allgather.0",
        gathered[0],
        torch.cat([torch.full((q + 1,), float(q)) for q in range(n)]),
    )
    same(
        "grouped_allgather.1",
        gathered[1],
        torch.cat([values(q, torch.int64, cpu) for q in range(n)]),
    )
    scattered = hvd.grouped_reducescatter([base.to(device) * (r + 1), base.to(device)], op=hvd.Sum)
    same("grouped_reducescatter.0", scattered[0], base[start : start + part[r]] * weight)
    same("grouped_reducescatter.1", scattered[1], base[start : start + part[r]] * n)

    # ---- fusion: 200 small tensors in flight at once ------------------------------------
    many = [torch.full((i + 1,), float(r + 1), device=device) for i in range(200)]
    handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"fused.{i}") for i, t in enumerate(many)]
    for handle in handles:
        hvd.synchronize(handle)
    c.expect(
        "fusion.200",
        all(
            torch.equal(t.to(cpu), torch.full((i + 1,), float(weight))) for i, t in enumerate(many)
        ),
    )

    # ---- ops whose result is computed from an allgather: Adasum, a sparse sum ------------
    # Their finish runs kernels on the gathered rows, which must wait for the allgather's
    # (asynchronous: it runs on the engine's stream). Rank q adds a one-hot row at q: pairwise
    # orthogonal, so Adasum is their plain sum; large, so the allgather takes a while.
    hot = torch.zeros(1 << 20, device=device)
    hot[r] = 1.0
    summed = torch.zeros(1 << 20)
    summed[:n] = 1.0
    adasum = hvd.allreduce_async(hot, op=hvd.Adasum, name="adasum.async")
    same("adasum.async", hvd.synchronize(adasum), summed)
    hvd.synchronize(hvd.allreduce_async_(hot, op=hvd.Adasum, name="adasum.inplace"))
    same("adasum.in_place", hot, summed)
    at = torch.tensor([[r, n]], device=device)  # row r holds r + 1, row n holds 1
    sparse = torch.sparse_coo_tensor(
        at, torch.tensor([[r + 1.0] * 3, [1.0] * 3], device=device), (n + 1, 3)
    )
    dense = torch.cat([torch.arange(1.0, n + 1).repeat(3, 1).t(), torch.full((1, 3), float(n))])
    handle = hvd.sparse_allreduce_async(sparse, name="sparse.sum", op=hvd.Sum)
    same("sparse_allreduce.sum", hvd.synchronize(handle).to_dense(), dense)

    # ---- CPU and device ops in one job, in flight together ------------------------------
    on_cpu = torch.full((5,), float(r + 1))
    on_device = torch.full((5,), float(r + 1), device=device)
    first = hvd.allreduce_async(on_cpu, op=hvd.Sum, name="mixed.cpu")
    second = hvd.allreduce_async(on_device, op=hvd.Sum, name="mixed.device")
    c.equal("mixed.cpu", hvd.synchronize(first), torch.full((5,), float(weight)))
    same("mixed.device", hvd.synchronize(second), torch.full((5,), float(weight)))

    # ---- streams: an input written on a side stream, a result used on another ----------
    if device.type == "cuda":
        side, other = torch.cuda.Stream(device), torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            a = torch.full((512, 512), 1 / 512, device=device)
            for _ in range(30):  # a long chain that leaves a unchanged: a @ a == a
                a = a @ a
            produced = a * (r + 1)
            handle = hvd.allreduce_async(produced, op=hvd.Sum, name="stream.side")
        result = hvd.synchronize(handle)
        with torch.cuda.stream(other):
            other.wait_stream(torch.cuda.current_stream(device))
            used = result * 2
        other.synchronize()
        same("stream.side_input", result, torch.full((512, 512), weight / 512))
        same("stream.result_on_other_stream", used, torch.full((512, 512), 2 * weight / 512))

    # ---- training: DistributedOptimizer, SyncBatchNorm, optimizer state ------------------
    torch.manual_seed(0)
    batch = torch.randn(4 * n, 8)
    labels = torch.randn(4 * n, 4)
    reference = torch.nn.Linear(8, 4)
    model = torch.nn.Linear(8, 4).to(device)
    model.load_state_dict(reference.state_dict())
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    shard = slice(4 * r, 4 * r + 4)
    for _ in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(
            model(batch[shard].to(device)), labels[shard].to(device)
        )
        loss.backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(batch), labels).backward()
        ref_optimizer.step()
    c.close(
        "optimizer.matches_one_process",
        model.weight.detach().cpu(),
        reference.weight.detach(),
        1e-5,
    )

    norm = hvd.SyncBatchNorm(4).to(device)
    full = torch.randn(4 * n, 4, generator=torch.Generator().manual_seed(1)) * 3 + 1
    plain = torch.nn.BatchNorm1d(4)
    c.close(
        "sync_batch_norm.output",
        norm(full[shard].to(device)).detach().cpu(),
        plain(full)[shard].detach(),
        1e-4,
    )
    c.close("sync_batch_norm.running_mean", norm.running_mean.cpu(), plain.running_mean, 1e-5)

    adam_model = torch.nn.Linear(4, 2).to(device)
    adam = torch.optim.Adam(adam_model.parameters(), lr=0.01 * (r + 1))
    adam_model(torch.full((3, 4), float(r + 1), device=device)).sum().backward()
    adam.step()
    hvd.broadcast_parameters(adam_model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(adam, root_rank=0)
    moments = adam.state[adam_model.weight]["exp_avg"]
    everyone = hvd.allgather(moments.unsqueeze(0))
    c.expect(
        "broadcast_optimizer_state.moments",
        moments.device == device and all(torch.equal(everyone[0], row) for row in everyone),
    )
    c.expect("broadcast_optimizer_state.lr", math.isclose(adam.param_groups[0]["lr"], 0.01))

    # ---- object collectives holding device tensors ------------------------------------
    sent = hvd.broadcast_object({"t": torch.full((2,), float(r), device=device)}, root_rank=0)
    same("broadcast_object", sent["t"], torch.zeros(2))
    objects = hvd.allgather_object(torch.full((1,), float(r), device=device))
    c.expect("allgather_object", [float(o.item()) for o in objects] == [float(q) for q in range(n)])

    hvd.shutdown()
    c.finish(r)


if __name__ == "__main__":
    main()
