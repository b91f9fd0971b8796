"""Worker for the 2- and 3-rank jobs: every op, dtype and variant on the global set and on
sub process sets, mismatches, duplicates, join, autograd. Values depend on the rank so a
wrong reduction cannot pass. Works for any job size >= 2."""

from __future__ import annotations

import os
import sys
import threading
import time
import warnings
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks

import collectives.torch as hvd

REDUCE_DTYPES = [
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
]
MOVE_DTYPES = [*REDUCE_DTYPES, torch.bool]
OPS = [hvd.Sum, hvd.Average, hvd.Min, hvd.Max, hvd.Product]


def values(r: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank r's contribution: small (no overflow in Product), mixed signs where signed."""
    base = torch.tensor([[1, 2, 3], [0, 3, 1]], dtype=torch.int64) + r
    if dtype.is_floating_point or dtype not in (torch.uint8, torch.bool):
        base = base - 2
    if dtype == torch.bool:
        return (base % 2).bool()
    return base.to(dtype)


def expected_reduce(op: hvd.ReduceOp, ranks: list[int], dtype: torch.dtype) -> torch.Tensor:
    stacked = torch.stack([values(r, dtype).to(torch.float64) for r in ranks])
    if op == hvd.Sum:
        out = stacked.sum(0)
    elif op == hvd.Min:
        out = stacked.min(0).values
    elif op == hvd.Max:
        out = stacked.max(0).values
    elif op == hvd.Product:
        out = stacked.prod(0)
    else:
        out = stacked.sum(0) / len(ranks)
        if not dtype.is_floating_point:
            out = torch.trunc(out)
    return out.to(dtype)


def expect_refused(
    c: Checks,
    what: str,
    calls: tuple[tuple[str, Callable[[], object]], ...],
    kind: type[Exception],
    words: str,
) -> None:
    """Each call raises ``kind`` saying ``words`` (checked as ``what.<label>``)."""
    for label_, call in calls:
        try:
            call()
            c.expect(f"{what}.{label_}", False, "no error")
        except kind as error:
            c.expect(f"{what}.{label_}", words in str(error), error)


def main() -> None:
    torch.set_num_threads(1)
    c = Checks()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    everyone = list(range(n))
    even = hvd.add_process_set(list(range(0, n, 2)))
    odd = hvd.add_process_set(list(range(1, n, 2)))
    mine = even if r % 2 == 0 else odd
    again = hvd.ProcessSet(odd.ranks)  # registered in process_sets(), reused in lifecycle()
    # Each rank runs every check on the global set and on the one sub set it belongs to;
    # the two sub sets run at the same time, on disjoint ranks.
    sets = [("global", hvd.global_process_set, everyone), ("sub", mine, mine.ranks)]

    def close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        tolerance = 1e-2 if want.dtype in (torch.float16, torch.bfloat16) else 1e-6
        if want.dtype.is_floating_point:
            c.close(name, got, want, tolerance)
        else:
            c.equal(name, got, want)

    def identity() -> None:
        c.expect("identity.size", n == int(os.environ["HVDRUN_SIZE"]), n)
        c.expect("identity.rank_env", r == int(os.environ["HVDRUN_RANK"]), r)
        c.expect("identity.unique", hvd.allgather_object(r) == everyone)
        c.expect("identity.sets", (even.ranks, odd.ranks) == (everyone[::2], everyone[1::2]))
        c.expect("identity.set_rank", mine.rank() == mine.ranks.index(r) and mine.included())
        c.expect("identity.set_ids", {even.process_set_id, odd.process_set_id} == {1, 2})

    def allreduce() -> None:
        for label, ps, ranks in sets:
            for dtype in REDUCE_DTYPES:
                for op in OPS:
                    want = expected_reduce(op, ranks, dtype)
                    tag = f"{label}.{op.name}.{dtype}"
                    x = values(r, dtype)
                    close(f"allreduce.{tag}", hvd.allreduce(x, op=op, process_set=ps), want)
                    close(f"allreduce.untouched.{tag}", x, values(r, dtype))
                    handle = hvd.allreduce_async(x, op=op, process_set=ps)
                    close(f"allreduce_async.{tag}", hvd.synchronize(handle), want)
                    y = values(r, dtype)
                    returned = hvd.allreduce_(y, op=op, process_set=ps)
                    c.expect(f"allreduce_.same.{tag}", returned is y)
                    close(f"allreduce_.{tag}", y, want)
                    z = values(r, dtype)
                    handle = hvd.allreduce_async_(z, op=op, process_set=ps, name=f"z.{tag}")
                    close(f"allreduce_async_.{tag}", hvd.synchronize(handle), want)
                    close(f"allreduce_async_.inplace.{tag}", z, want)
            for op in (hvd.Sum, hvd.Min, hvd.Max, hvd.Product):
                flags = values(r, torch.bool)
                stacked = torch.stack([values(q, torch.bool) for q in ranks])
                want = {
                    hvd.Sum: stacked.any(0),
                    hvd.Max: stacked.any(0),
                    hvd.Min: stacked.all(0),
                    hvd.Product: stacked.all(0),
                }[op]
                c.equal(
                    f"allreduce.{label}.{op.name}.bool",
                    hvd.allreduce(flags, op=op, process_set=ps),
                    want,
                )
        # Non-contiguous in place, and the default op (Average) with the deprecated flag.
        t = torch.arange(12.0).reshape(3, 4).t() * (r + 1)
        hvd.allreduce_(t, op=hvd.Sum)
        c.equal("allreduce_.noncontiguous", t, torch.arange(12.0).reshape(3, 4).t() * sum(
            q + 1 for q in everyone
        ))  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            out = hvd.allreduce(values(r, torch.float64), average=False)
        close("allreduce.average_false", out, expected_reduce(hvd.Sum, everyone, torch.float64))
        # 9.6 MB: over execute.SPLIT_BYTES, so it runs as concurrent allreduces of its parts.
        huge = torch.arange(2_400_000, dtype=torch.float32)
        weight = float(sum(q + 1 for q in everyone))
        c.equal("allreduce.split", hvd.allreduce(huge * (r + 1), op=hvd.Sum), huge * weight)
        mine_ = huge * (r + 1)
        hvd.allreduce_(mine_, op=hvd.Average)
        c.close("allreduce_.split", mine_, huge * weight / n, 1e-6 * 2_400_000 * weight)
        big = torch.full((300_000,), float(r + 1))  # 1.2 MB: more than the 1 MB threshold below
        c.equal("allreduce.large", hvd.allreduce(big, op=hvd.Sum), torch.full((300_000,), float(
            sum(q + 1 for q in everyone)
        )))  # fmt: skip

    def scaling() -> None:
        for label, ps, ranks in sets:
            x = values(r, torch.float64)
            total = expected_reduce(hvd.Sum, ranks, torch.float64)
            out = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0,
                                process_set=ps)  # fmt: skip
            close(f"scale.{label}.sum", out, total * 1.5)
            out = hvd.allreduce(x, op=hvd.Average, postscale_factor=2.0, process_set=ps)
            close(f"scale.{label}.average_post", out, total / len(ranks) * 2.0)
            ints = values(r, torch.int32)
            out = hvd.allreduce(ints, op=hvd.Sum, prescale_factor=1.5, process_set=ps)
            want = sum(torch.trunc(values(q, torch.int32).double() * 1.5) for q in ranks)
            c.equal(f"scale.{label}.prescale_int", out, torch.as_tensor(want).to(torch.int32))

    def grouped() -> None:
        for label, ps, ranks in sets:
            tensors = [values(r, torch.float32), values(r, torch.int64), torch.full((5,), r + 1.0)]
            wants = [
                expected_reduce(hvd.Sum, ranks, torch.float32),
                expected_reduce(hvd.Sum, ranks, torch.int64),
                torch.full((5,), float(sum(q + 1 for q in ranks))),
            ]
            outs = hvd.grouped_allreduce(tensors, op=hvd.Sum, process_set=ps)
            for i, (got, want) in enumerate(zip(outs, wants, strict=True)):
                c.equal(f"grouped.{label}.{i}", got, want)
            handle = hvd.grouped_allreduce_async(tensors, op=hvd.Sum, process_set=ps)
            for i, (got, want) in enumerate(zip(hvd.synchronize(handle), wants, strict=True)):
                c.equal(f"grouped_async.{label}.{i}", got, want)
            copies = [t.clone() for t in tensors]
            hvd.synchronize(hvd.grouped_allreduce_async_(copies, op=hvd.Sum, process_set=ps))
            c.expect(f"grouped_async_.{label}", all(
                torch.equal(a, b) for a, b in zip(copies, wants, strict=True)
            ))  # fmt: skip
            returned = hvd.grouped_allreduce_(tensors, op=hvd.Max, process_set=ps)
            c.expect(f"grouped_.{label}.same", returned is tensors)
            c.equal(
                f"grouped_.{label}.max", tensors[1], expected_reduce(hvd.Max, ranks, torch.int64)
            )
        c.expect("grouped.empty", hvd.grouped_allreduce([]) == [])
        # Empty tensors come back as empty tensors: alone in a dtype reduced wider (int16),
        # and all of a fused bucket.
        empty = torch.zeros(0, 3, dtype=torch.int16)
        alone = hvd.synchronize(hvd.allreduce_async(empty, op=hvd.Sum, name="empty.int16"))
        c.equal("empty.int16", alone, empty)
        outs = hvd.grouped_allreduce([torch.zeros(0, 3), torch.zeros(0)], name="empty.grouped")
        c.expect(
            "empty.grouped",
            [(o.shape, o.dtype) for o in outs] == [((0, 3), torch.float32), ((0,), torch.float32)],
            outs,
        )
        # An in-place target whose elements share memory is refused at the call, on every
        # rank (the root of a broadcast too), and the job's collectives go on.
        expanded = torch.tensor([float(r)]).expand(5)
        refused = (
            ("allreduce_", lambda: hvd.allreduce_(expanded, op=hvd.Sum)),
            ("broadcast_", lambda: hvd.broadcast_(expanded, root_rank=0)),
        )
        expect_refused(c, "overlap", refused, ValueError, "share memory")
        c.equal(
            "overlap.after", hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n))
        )
        # A tensor made under inference_mode (a validation metric) written in place: torch
        # refuses writes to it outside that mode, which the engine's thread is not in (the
        # caller's may be), so the op refuses it at the call, and the job goes on; the
        # out-of-place op reduces it.
        with torch.inference_mode():
            metric = torch.tensor([float(r)])
        inside = torch.inference_mode
        inference_writes = (
            ("allreduce_", lambda: hvd.allreduce_(metric, op=hvd.Sum)),
            ("grouped_allreduce_", lambda: hvd.grouped_allreduce_([metric], op=hvd.Sum)),
            ("allreduce_async_", lambda: hvd.allreduce_async_(metric, op=hvd.Sum)),
            ("broadcast_", lambda: hvd.broadcast_(metric, root_rank=0)),
            ("inside.allreduce_async_", lambda: inside()(hvd.allreduce_async_)(metric)),
        )
        expect_refused(c, "inference", inference_writes, RuntimeError, "inference_mode")
        c.equal(
            "inference.out_of_place",
            hvd.allreduce(metric, op=hvd.Sum),
            torch.tensor([float(sum(range(n)))]),
        )
        c.equal(
            "inference.after", hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(n))
        )
        # A tensor that autograd saved for backward and a collective then overwrote in place:
        # backward() raises, as after torch's own in-place ops (dist.broadcast among them),
        # instead of computing gradients from values it never saw (the 1M-element tensor is
        # written by the collective itself, not through a copy).
        for label_, call in (
            ("broadcast_", lambda t: hvd.broadcast_(t, root_rank=0)),
            ("broadcast_async_", lambda t: hvd.synchronize(hvd.broadcast_async_(t, 0))),
            ("allreduce_", lambda t: hvd.allreduce_(t, op=hvd.Sum)),
            ("allreduce_async_", lambda t: hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Sum))),
            ("grouped_allreduce_", lambda t: hvd.grouped_allreduce_([t], op=hvd.Sum)),
        ):
            for size in (4, 1 << 20):
                x = torch.ones(size, requires_grad=True)
                y = x * (r + 1)
                z = y.sin()  # (saves y)
                call(y)
                try:
                    z.sum().backward()
                    c.expect(f"autograd.{label_}.{size}", False, "backward() did not notice")
                except RuntimeError as error:
                    noticed = "modified by an inplace operation" in str(error)
                    c.expect(f"autograd.{label_}.{size}", noticed, error)

    def allgather() -> None:
        for label, ps, ranks in sets:
            me = ranks.index(r)
            for dtype in MOVE_DTYPES:
                x = torch.full((me + 1, 2, 3), me + 1, dtype=dtype)
                want = torch.cat([torch.full((i + 1, 2, 3), i + 1, dtype=dtype)
                                  for i in range(len(ranks))])  # fmt: skip
                c.equal(f"allgather.{label}.{dtype}", hvd.allgather(x, process_set=ps), want)
                handle = hvd.allgather_async(x, process_set=ps)
                c.equal(f"allgather_async.{label}.{dtype}", hvd.synchronize(handle), want)
            parts = [
                torch.full((me + 1,), float(me)),
                torch.full((me + 1, 2), me, dtype=torch.int16),
            ]
            outs = hvd.grouped_allgather(parts, process_set=ps)
            c.equal(f"grouped_allgather.{label}.0", outs[0], torch.cat(
                [torch.full((i + 1,), float(i)) for i in range(len(ranks))]
            ))  # fmt: skip
            c.equal(f"grouped_allgather.{label}.1", outs[1], torch.cat(
                [torch.full((i + 1, 2), i, dtype=torch.int16) for i in range(len(ranks))]
            ))  # fmt: skip
            handle = hvd.grouped_allgather_async(parts[:1], process_set=ps)
            c.equal(f"grouped_allgather_async.{label}", hvd.synchronize(handle)[0], outs[0])
        rows = 0 if r == 1 else 2
        out = hvd.allgather(torch.full((rows, 4), float(r)))
        want = torch.cat([torch.full((0 if q == 1 else 2, 4), float(q)) for q in everyone])
        c.equal("allgather.empty_rank", out, want)
        c.equal("allgather.scalar_rows", hvd.allgather(torch.tensor([r])), torch.tensor(everyone))

    def broadcast() -> None:
        # root_rank is a global rank, also in a sub set (as in Horovod); tags count the
        # root's position in the set.
        for label, ps, ranks in sets:
            for root, global_root in enumerate(ranks):
                for dtype in MOVE_DTYPES:
                    tag = f"{label}.root{root}.{dtype}"
                    x = values(r, dtype)
                    want = values(global_root, dtype)
                    got = hvd.broadcast(x, global_root, process_set=ps)
                    c.equal(f"broadcast.{tag}", got, want)
                    c.equal(f"broadcast.untouched.{tag}", x, values(r, dtype))
                    y = values(r, dtype)
                    same = hvd.broadcast_(y, global_root, process_set=ps) is y
                    c.expect(f"broadcast_.same.{tag}", same)
                    c.equal(f"broadcast_.{tag}", y, want)
                handle = hvd.broadcast_async(values(r, torch.float32), global_root, process_set=ps)
                c.equal(f"broadcast_async.{label}.{root}", hvd.synchronize(handle),
                        values(global_root, torch.float32))  # fmt: skip
                z = values(r, torch.int64)
                hvd.synchronize(hvd.broadcast_async_(z, global_root, process_set=ps))
                c.equal(f"broadcast_async_.{label}.{root}", z, values(global_root, torch.int64))
        try:
            hvd.broadcast(torch.ones(1), root_rank=n)
            c.expect("broadcast.bad_root_raises", False, "no error")
        except ValueError as error:
            c.expect("broadcast.bad_root_raises", "out of range" in str(error), error)

    def alltoall() -> None:
        for label, ps, ranks in sets:
            size, me = len(ranks), ranks.index(r)
            for dtype in MOVE_DTYPES:
                # Rank i sends j+1 rows to rank j, each row holding (sender, receiver).
                splits = [j + 1 for j in range(size)]
                rows = [torch.tensor([[me, j]] * (j + 1)) for j in range(size)]
                x = torch.cat(rows).to(dtype)
                out, received = hvd.alltoall(x, splits=splits, process_set=ps)
                want = torch.cat([torch.tensor([[i, me]] * (me + 1)) for i in range(size)])
                c.equal(f"alltoall.{label}.{dtype}", out, want.to(dtype))
                c.equal(f"alltoall.received.{label}.{dtype}", received,
                        torch.full((size,), me + 1, dtype=torch.int32))  # fmt: skip
            even_rows = torch.arange(2.0 * size).reshape(size, 2) + 100 * me
            out = hvd.alltoall(even_rows, process_set=ps)
            want = torch.stack([torch.arange(2.0 * size).reshape(size, 2)[me] + 100 * i
                                for i in range(size)])  # fmt: skip
            c.equal(f"alltoall.even.{label}", out, want)
            splits = torch.tensor([0] * (size - 1) + [2])  # everything to the last rank
            handle = hvd.alltoall_async(torch.full((2, 3), float(me)), splits=splits,
                                        process_set=ps)  # fmt: skip
            got, received = hvd.synchronize(handle)
            if me == size - 1:
                want = torch.cat([torch.full((2, 3), float(i)) for i in range(size)])
            else:
                want = torch.empty(0, 3)
            c.equal(f"alltoall_async.{label}", got, want)
            c.expect(f"alltoall_async.received.{label}",
                     received.tolist() == [2 if me == size - 1 else 0] * size)  # fmt: skip

    def reducescatter() -> None:
        for label, ps, ranks in sets:
            size, me = len(ranks), ranks.index(r)
            for rows in (size * 2, size * 2 + 1):  # even and uneven splits
                split = "even" if rows == size * 2 else "uneven"
                x = torch.arange(rows * 3.0).reshape(rows, 3) * (r + 1)
                total = torch.arange(rows * 3.0).reshape(rows, 3) * sum(q + 1 for q in ranks)
                counts = [rows // size + (1 if i < rows % size else 0) for i in range(size)]
                start = sum(counts[:me])
                want = total[start : start + counts[me]]
                out = hvd.reducescatter(x, op=hvd.Sum, process_set=ps)
                c.equal(f"reducescatter.{label}.{split}", out, want)
                out = hvd.reducescatter(x, process_set=ps)  # default: Average
                c.close(f"reducescatter.avg.{label}.{split}", out, want / size, 1e-5)
                out = hvd.reducescatter(x, op=hvd.Sum, process_set=ps, prescale_factor=2.0,
                                        postscale_factor=0.25)  # fmt: skip
                c.close(f"reducescatter.scaled.{label}.{split}", out, want * 0.5, 1e-5)
                handle = hvd.reducescatter_async(x.long(), op=hvd.Sum, process_set=ps)
                c.equal(f"reducescatter_async.{label}.{split}", hvd.synchronize(handle),
                        want.long())  # fmt: skip
                outs = hvd.grouped_reducescatter([x, x.double()], op=hvd.Sum, process_set=ps)
                c.equal(f"grouped_reducescatter.{label}.{split}", outs[1], want.double())
                handle = hvd.grouped_reducescatter_async([x], op=hvd.Max, process_set=ps)
                c.expect(f"grouped_reducescatter_async.{label}.{split}",
                         hvd.synchronize(handle)[0].shape == want.shape)  # fmt: skip

    def autograd() -> None:
        size = n
        # allreduce: d/dx of sum(w * allreduce(x)) is allreduce(w) with the same op.
        for op, scale in ((hvd.Sum, 1.0), (hvd.Average, 1.0 / size)):
            x = torch.ones(3, requires_grad=True)
            weight = torch.tensor([1.0, 2.0, 3.0]) * (r + 1)
            (hvd.allreduce(x, op=op, prescale_factor=2.0) * weight).sum().backward()
            want = torch.tensor([1.0, 2.0, 3.0]) * sum(q + 1 for q in everyone) * scale * 2.0
            c.close(f"grad.allreduce.{op.name}", x.grad, want, 1e-6)
        xs = [torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)]
        outs = hvd.grouped_allreduce(xs, op=hvd.Sum)
        (outs[0].sum() * (r + 1) + outs[1].sum()).backward()
        c.equal("grad.grouped_allreduce.0", xs[0].grad, torch.full((2,), float(sum(
            q + 1 for q in everyone
        ))))  # fmt: skip
        c.equal("grad.grouped_allreduce.1", xs[1].grad, torch.full((3,), float(size)))
        # allgather: this rank's rows of the averaged upstream gradient.
        x = torch.ones(r + 1, 2, requires_grad=True)
        gathered = hvd.allgather(x)
        upstream = torch.cat([torch.full((q + 1, 2), float(q)) for q in everyone]) * (r + 1)
        gathered.backward(upstream)
        mean_factor = sum(q + 1 for q in everyone) / size
        c.close("grad.allgather", x.grad, torch.full((r + 1, 2), r * mean_factor), 1e-6)
        ys = [torch.ones(r + 1, requires_grad=True)]
        hvd.grouped_allgather(ys)[0].sum().backward()
        c.equal("grad.grouped_allgather", ys[0].grad, torch.ones(r + 1))
        # broadcast: the averaged gradient on the root, zeros elsewhere.
        x = torch.ones(4, requires_grad=True)
        (hvd.broadcast(x, root_rank=1) * (r + 1)).sum().backward()
        want = torch.full((4,), mean_factor if r == 1 else 0.0)
        c.close("grad.broadcast", x.grad, want, 1e-6)
        # alltoall: the gradient travels back along the received splits.
        x = torch.arange(float(size * 2)).reshape(size * 2, 1).requires_grad_()
        out, _ = hvd.alltoall(x, splits=[2] * size)
        (out * torch.arange(float(size * 2)).reshape(size * 2, 1)).sum().backward()
        want = torch.cat([torch.tensor([[2.0 * r], [2.0 * r + 1]])] * size)
        c.equal("grad.alltoall", x.grad, want)
        # reducescatter: Horovod's convention, allgather of the gradient (times the size for
        # Sum, not divided for Average).
        x = torch.ones(size * 2, 2, requires_grad=True)
        (hvd.reducescatter(x, op=hvd.Average) * (r + 1)).sum().backward()
        want = torch.cat([torch.full((2, 2), float(q + 1)) for q in everyone])
        c.close("grad.reducescatter", x.grad, want, 1e-6)
        x = torch.ones(size, requires_grad=True)
        hvd.grouped_reducescatter([x], op=hvd.Sum)[0].sum().backward()
        c.equal("grad.grouped_reducescatter", x.grad, torch.full((size,), float(size)))

    def join() -> None:
        # Rank r runs r + 1 steps, then joins: the others contribute neutral values to
        # allreduces; allgather and broadcast raise while a rank has joined (as in Horovod).
        for step in range(r + 1):
            active = [q for q in everyone if q >= step]
            out = hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum, name="join.step")
            c.equal(f"join.sum.step{step}", out, torch.tensor([float(sum(q + 1 for q in active))]))
            out = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Min, name="join.min")
            c.equal(f"join.min.step{step}", out, torch.tensor([float(min(active))]))
            out = hvd.allreduce(torch.tensor([r + 1]), op=hvd.Product, name="join.prod")
            c.equal(f"join.prod.step{step}", out, torch.tensor([int(torch.tensor(
                [q + 1 for q in active]
            ).prod())]))  # fmt: skip
            if step == 0:
                out = hvd.allgather(torch.tensor([r]), name="join.gather")
                c.equal(f"join.allgather.step{step}", out, torch.tensor(active))
                out = hvd.broadcast(torch.tensor([r]), root_rank=n - 1, name="join.bcast")
                c.equal(f"join.broadcast.step{step}", out, torch.tensor([n - 1]))
                continue
            for what, call in (
                ("allgather", lambda: hvd.allgather(torch.tensor([r]), name="join.gather")),
                ("broadcast", lambda: hvd.broadcast(torch.tensor([r]), n - 1, name="join.bcast")),
            ):
                try:
                    call()
                    c.expect(f"join.{what}_refused.step{step}", False, "no error")
                except hvd.NotSupportedWithJoinError as error:
                    # (the sparse-gradient hint only where it helps: an allgather)
                    said = str(error)
                    hinted = ("sparse_as_dense" in said) == (what == "allgather")
                    c.expect(f"join.{what}_refused.step{step}", "join" in said and hinted, said)
        last = hvd.join()
        c.expect("join.last_rank", last == n - 1, last)
        out = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)
        c.equal("join.after", out, torch.tensor([float(n)]))

    def expect_mismatch(name: str, call: Callable[[], object], words: list[str]) -> None:
        try:
            call()
            c.expect(name, False, "no error")
        except hvd.TensorMismatchError as error:
            text = str(error)
            # Horovod raises RuntimeError here; never a lost peer (HorovodInternalError).
            kind = isinstance(error, RuntimeError) and not isinstance(
                error, hvd.HorovodInternalError
            )
            c.expect(name, kind and all(w in text for w in words), text)

    def mismatches() -> None:
        expect_mismatch("mismatch.shape", lambda: hvd.allreduce(torch.ones(r + 1), name="m.shape"),
                        ["allreduce 'm.shape'", "shape", "rank 0: [1]", "rank 1: [2]"])  # fmt: skip
        expect_mismatch(
            "mismatch.dtype",
            lambda: hvd.allreduce(torch.ones(2, dtype=torch.float32 if r else torch.float64),
                                  name="m.dtype"),
            ["allreduce 'm.dtype'", "dtype", "rank 0: float64", "1", ": float32"],
        )  # fmt: skip
        expect_mismatch("mismatch.op",
                        lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if r else hvd.Max,
                                              name="m.op"),
                        ["allreduce 'm.op'", "the op", "rank 0: Max", ": Sum"])  # fmt: skip
        expect_mismatch("mismatch.prescale",
                        lambda: hvd.allreduce(torch.ones(2), prescale_factor=1.0 + r,
                                              name="m.pre"),
                        ["prescale_factor", "rank 0: 1.0", "rank 1: 2.0"])  # fmt: skip
        expect_mismatch("mismatch.root",
                        lambda: hvd.broadcast(torch.ones(2), root_rank=min(r, 1), name="m.root"),
                        ["broadcast 'm.root'", "root_rank", "rank 0: 0", ": 1"])  # fmt: skip
        expect_mismatch("mismatch.allgather_dims",
                        lambda: hvd.allgather(torch.ones(2, r + 1), name="m.gather"),
                        ["allgather 'm.gather'", "all dimensions but the first"])  # fmt: skip
        expect_mismatch("mismatch.splits",
                        lambda: hvd.alltoall(torch.ones(n, 2),
                                             splits=[n] + [0] * (n - 1) if r else [1] * (n - 1),
                                             name="m.splits"),
                        ["alltoall 'm.splits'", "splits"])  # fmt: skip
        expect_mismatch("mismatch.device",
                        lambda: hvd.allreduce(torch.ones(2, device="meta" if r else "cpu"),
                                              name="m.device"),
                        ["allreduce 'm.device'", "device", "rank 0: cpu", ": meta"])  # fmt: skip
        expect_mismatch("mismatch.grouped_count",
                        lambda: hvd.grouped_allreduce([torch.ones(1)] * (r + 1), name="m.count"),
                        ["number of tensors"])  # fmt: skip
        expect_mismatch("mismatch.broadcast_parameters",
                        lambda: hvd.broadcast_parameters({"w": torch.zeros(2 + r)}, root_rank=0),
                        ["broadcast", "shape"])  # fmt: skip
        c.equal("mismatch.after", hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum),
                torch.tensor([float(n)]))  # fmt: skip

    def duplicates_and_async() -> None:
        first = hvd.allreduce_async(torch.ones(1), name="dup", op=hvd.Sum)
        try:
            hvd.allreduce_async(torch.ones(1), name="dup")
            c.expect("duplicate.raises", False, "no error")
        except ValueError as error:
            c.expect("duplicate.raises", "already in flight" in str(error), error)
        c.equal("duplicate.first_ok", hvd.synchronize(first), torch.tensor([float(n)]))
        # The same name again, once the first finished, is fine.
        c.equal("duplicate.reuse", hvd.allreduce(torch.ones(1), name="dup", op=hvd.Sum),
                torch.tensor([float(n)]))  # fmt: skip
        # Truly asynchronous: rank 0's op cannot finish while rank 1 has not submitted it.
        if r == 1:
            time.sleep(0.5)
        handle = hvd.allreduce_async(torch.ones(2), name="slow", op=hvd.Sum)
        if r == 0:
            c.expect("async.pending", not hvd.poll(handle))
        c.equal("async.result", hvd.synchronize(handle), torch.full((2,), float(n)))
        c.expect("async.unknown_handle", hvd.synchronize(handle) is None)
        # Ops submitted in different orders by different ranks still match by name.
        names = [f"order.{i}" for i in range(5)]
        order = names if r % 2 == 0 else names[::-1]
        handles = {k: hvd.allreduce_async(torch.tensor([float(i)]), name=k, op=hvd.Sum)
                   for i, k in enumerate(order)}  # fmt: skip
        got = {k: hvd.synchronize(h).item() for k, h in handles.items()}
        want = {k: sum(float(order_of(q, names).index(k)) for q in everyone) for k in names}
        c.expect("async.out_of_order", got == want, (got, want))
        # Ops from several threads at once.
        results: dict[int, torch.Tensor] = {}

        def worker(index: int) -> None:
            results[index] = hvd.allreduce(torch.tensor([float(index)]), op=hvd.Sum,
                                           name=f"thread.{index}")  # fmt: skip

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        c.expect("threads", all(results[i].item() == i * n for i in range(4)), results)
        # 300 small async ops in one burst: fused, all correct.
        burst = [hvd.allreduce_async(torch.full((10,), float(i)), op=hvd.Sum) for i in range(300)]
        c.expect("burst", all(
            torch.equal(hvd.synchronize(h), torch.full((10,), float(i * n)))
            for i, h in enumerate(burst)
        ))  # fmt: skip
        # Bursts of small ops whose data rides with the negotiation (in the slot or in
        # one allgather after it): every dtype and op, scaling, 0-d/1-d/2-d, in place or
        # not, with ops that cannot ride (int16, a grouped op) in the same round. Repeated,
        # since the first burst of a pattern may grow the slot.
        shapes: list[Callable[[torch.Tensor], torch.Tensor]] = [
            lambda t: t.clone(), lambda t: t[1, 2].clone(), lambda t: t.flatten()
        ]  # fmt: skip
        for repeat in range(3):
            pending = []
            for i in range(90):
                dtype, op = REDUCE_DTYPES[i % len(REDUCE_DTYPES)], OPS[i % len(OPS)]
                shape = shapes[i % 3]
                scale = 2.0 if dtype.is_floating_point and op == hvd.Sum and i % 2 else 1.0
                want = shape(expected_reduce(op, everyone, dtype).double() * scale).to(dtype)
                x = shape(values(r, dtype))
                if i % 4 == 0:
                    pending.append((hvd.allreduce_async_(x, op=op, name=f"mix.{i}",
                                    postscale_factor=scale), x, want, True))  # fmt: skip
                else:
                    pending.append((hvd.allreduce_async(x, op=op, prescale_factor=scale),
                                    x, want, False))  # fmt: skip
            grouped_ = hvd.grouped_allreduce_async([torch.ones(3), torch.ones(2)], op=hvd.Sum)
            for i, (handle, x, want, in_place) in enumerate(pending):
                out = hvd.synchronize(handle)
                close(f"burst.mixed.{repeat}.{i}", out, want)
                if in_place:
                    c.expect(f"burst.mixed.{repeat}.{i}.in_place", out is x)
                else:
                    close(
                        f"burst.mixed.{repeat}.{i}.untouched", x, shapes[i % 3](values(r, x.dtype))
                    )
            c.expect(f"burst.mixed.{repeat}.grouped", all(
                torch.equal(t, torch.full_like(t, n)) for t in hvd.synchronize(grouped_)
            ))  # fmt: skip

    def process_sets() -> None:
        hvd.barrier()
        hvd.barrier(process_set=mine)
        c.expect("barrier", True)
        try:
            hvd.add_process_set(list(range(0, n, 2)))
            c.expect("process_set.duplicate_raises", False, "no error")
        except ValueError:
            c.expect("process_set.duplicate_raises", True)
        other = odd if mine is even else even
        try:
            hvd.allreduce(torch.ones(1), process_set=other)
            c.expect("process_set.not_member_raises", False, "no error")
        except ValueError as error:
            c.expect("process_set.not_member_raises", "not a member" in str(error), error)
        try:
            hvd.allreduce(torch.ones(1), process_set=hvd.ProcessSet([0]))
            c.expect("process_set.unregistered_raises", False, "no error")
        except ValueError as error:
            c.expect("process_set.unregistered_raises", "not registered" in str(error), error)
        odd_ranks = odd.ranks
        c.expect("process_set.remove", hvd.remove_process_set(odd))
        c.expect("process_set.removed_id", odd.process_set_id is None)
        c.expect("process_set.remove_twice", not hvd.remove_process_set(odd))
        c.expect("process_set.remove_global", not hvd.remove_process_set(hvd.global_process_set))
        hvd.add_process_set(again)
        c.expect("process_set.readd_id", again.process_set_id == 3, again.process_set_id)
        if again.included():
            out = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=again)
            c.equal("process_set.readd_op", out, torch.tensor([float(sum(odd_ranks))]))

    def objects() -> None:
        obj = {"rank": r, "items": list(range(r))}
        c.expect("broadcast_object", hvd.broadcast_object(obj, root_rank=n - 1)["rank"] == n - 1)
        got = hvd.allgather_object(obj)
        c.expect("allgather_object", [g["rank"] for g in got] == everyone)
        model = torch.nn.Linear(3, 2)
        torch.nn.init.constant_(model.weight, float(r))
        hvd.broadcast_parameters(model.state_dict(), root_rank=n - 1)
        c.expect("broadcast_parameters", bool((model.weight == n - 1).all()))
        # An object its rank cannot pickle: every rank raises in that call, and the next
        # calls are not shifted by one (they got the next call's object, then hung).
        lock = threading.Lock()
        try:
            hvd.broadcast_object(lock if r == n - 1 else None, root_rank=n - 1)
            c.expect("objects.unpicklable_broadcast", False, "no error")
        except Exception as error:
            ok = r == n - 1 or f"rank {n - 1} could not pickle its object" in str(error)
            c.expect("objects.unpicklable_broadcast", ok, repr(error))
        try:
            hvd.allgather_object(lock if r == 0 else r)
            c.expect("objects.unpicklable_allgather", False, "no error")
        except Exception as error:
            ok = r == 0 or "rank 0 could not pickle its object" in str(error)
            c.expect("objects.unpicklable_allgather", ok, repr(error))
        after = hvd.broadcast_object({"from": r}, root_rank=0)
        c.expect("objects.after_unpicklable", after == {"from": 0}, after)
        c.expect("objects.after_unpicklable_gather", hvd.allgather_object(r) == everyone)

    for name, body in [
        ("identity", identity),
        ("allreduce", allreduce),
        ("scaling", scaling),
        ("grouped", grouped),
        ("allgather", allgather),
        ("broadcast", broadcast),
        ("alltoall", alltoall),
        ("reducescatter", reducescatter),
        ("autograd", autograd),
        ("join", join),
        ("mismatches", mismatches),
        ("duplicates_and_async", duplicates_and_async),
        ("process_sets", process_sets),
        ("objects", objects),
    ]:
        c.run(name, body)

    def lifecycle() -> None:
        hvd.shutdown()
        c.expect("lifecycle.shutdown", not hvd.is_initialized())
        # A new engine and process groups under a fresh store prefix; the sets of the
        # first engine are registered anew, as Horovod's init(process_sets=...) does.
        sets_again = [hvd.ProcessSet(everyone[::2]), again]
        hvd.init(process_sets=sets_again)
        c.expect("lifecycle.reinit_rank", (hvd.rank(), hvd.size()) == (r, n))
        out = hvd.allreduce(torch.tensor([r]), op=hvd.Sum)
        c.equal("lifecycle.reinit_allreduce", out, torch.tensor([sum(everyone)]))
        ids = [ps.process_set_id for ps in sets_again]
        c.expect("lifecycle.init_process_sets", ids == [1, 2], ids)
        member = sets_again[0] if r % 2 == 0 else sets_again[1]
        out = hvd.allreduce(torch.tensor([1]), op=hvd.Sum, process_set=member)
        c.equal("lifecycle.init_process_sets_op", out, torch.tensor([len(member.ranks)]))

    c.run("lifecycle", lifecycle)
    hvd.shutdown()
    c.finish(r)


def order_of(rank: int, names: list[str]) -> list[str]:
    return names if rank % 2 == 0 else names[::-1]


if __name__ == "__main__":
    main()
