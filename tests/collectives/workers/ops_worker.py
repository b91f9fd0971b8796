"""Worker for the 3-rank job: identity, every op on several dtypes, allgather, broadcast,
parameters and objects. Values depend on the rank so a wrong reduction cannot pass."""

from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks

import collectives.torch as hvd

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64]


def rank_values(r: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank r's contribution: mixed signs, not evenly divisible, so Average's rounding shows."""
    base = torch.tensor([[1, -2, 3], [4, 5, -7]], dtype=torch.int64)
    return (base * (r + 1) + r).to(dtype)


def main() -> None:
    torch.set_num_threads(1)
    c = Checks()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    everyone = [rank_values(i, torch.int64) for i in range(n)]
    stacked = torch.stack(everyone)

    def identity() -> None:
        c.expect("identity.size", n == 3, n)
        c.expect("identity.rank_env", r == int(os.environ["HVDRUN_RANK"]), r)
        c.expect("identity.local", (hvd.local_rank(), hvd.local_size()) == (r, 3))
        c.expect("identity.cross", (hvd.cross_rank(), hvd.cross_size()) == (0, 1))
        c.expect("identity.torch", torch.distributed.get_rank() == r)
        c.expect("identity.initialized", hvd.is_initialized())
        c.expect("identity.unique", hvd.allgather_object(r) == [0, 1, 2])
        ranks = hvd.allgather(torch.tensor([r]))
        c.equal("identity.allgather_ranks", ranks, torch.tensor([0, 1, 2]))

    def allreduce_ops() -> None:
        for dtype in DTYPES:
            mine = rank_values(r, dtype)
            total = stacked.sum(0)
            expect = {
                hvd.Sum: total,
                hvd.Min: stacked.min(0).values,
                hvd.Max: stacked.max(0).values,
                hvd.Product: stacked.prod(0),
            }
            for op, value in expect.items():
                out = hvd.allreduce(mine, op=op)
                c.equal(f"allreduce.{op.name}.{dtype}", out, value.to(dtype))
            if dtype.is_floating_point:
                average = total.to(dtype) / n
            else:
                average = torch.div(total, n, rounding_mode="trunc").to(dtype)
            c.close(
                f"allreduce.AVERAGE.{dtype}", hvd.allreduce(mine, op=hvd.Average), average, 1e-6
            )
            c.close(f"allreduce.default_average.{dtype}", hvd.allreduce(mine), average, 1e-6)
            c.equal(f"allreduce.input_untouched.{dtype}", mine, rank_values(r, dtype))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                c.close(
                    f"allreduce.average_true.{dtype}",
                    hvd.allreduce(mine, average=True),
                    average,
                    1e-6,
                )
                c.equal(
                    f"allreduce.average_false.{dtype}",
                    hvd.allreduce(mine, average=False),
                    total.to(dtype),
                )
            inplace = rank_values(r, dtype)
            returned = hvd.allreduce_(inplace, op=hvd.Sum)
            c.expect(f"allreduce_.same_object.{dtype}", returned is inplace)
            c.equal(f"allreduce_.value.{dtype}", inplace, total.to(dtype))

    def scaling() -> None:
        mine = rank_values(r, torch.float64)
        total = stacked.sum(0).to(torch.float64)
        out = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
        c.close("scale.sum.float64", out, total * 1.5, 1e-9)
        out = hvd.allreduce(mine, op=hvd.Average, postscale_factor=2.0)
        c.close("scale.average_post.float64", out, total / n * 2.0, 1e-9)
        out = hvd.allreduce(mine.float(), op=hvd.Average, prescale_factor=4.0)
        c.close("scale.average_pre.float32", out, (total / n * 4.0).float(), 1e-5)
        # Integers are scaled in double precision and truncated toward zero, as Horovod does.
        ints = rank_values(r, torch.int32)
        out = hvd.allreduce(ints, op=hvd.Sum, prescale_factor=1.5)
        expect = torch.stack([torch.trunc(v.double() * 1.5) for v in everyone]).sum(0)
        c.equal("scale.prescale.int32", out, expect.to(torch.int32))

    def other_dtypes() -> None:
        for dtype in (torch.float16, torch.bfloat16, torch.int16, torch.int8, torch.uint8):
            mine = torch.tensor([r + 1, 2 * r + 1], dtype=dtype)
            c.equal(
                f"allreduce.sum.{dtype}",
                hvd.allreduce(mine, op=hvd.Sum),
                torch.tensor([6, 9], dtype=dtype),
            )
        flags = torch.tensor([r == 0, True, False])
        c.equal(
            "allreduce.max.bool",
            hvd.allreduce(flags, op=hvd.Max),
            torch.tensor([True, True, False]),
        )

    def grouped() -> None:
        tensors = [
            rank_values(r, torch.float32),
            rank_values(r, torch.int64),
            torch.full((5,), float(r)),
        ]
        outs = hvd.grouped_allreduce(tensors, op=hvd.Sum)
        c.equal("grouped.float32", outs[0], stacked.sum(0).float())
        c.equal("grouped.int64", outs[1], stacked.sum(0))
        c.equal("grouped.third", outs[2], torch.full((5,), 3.0))
        hvd.grouped_allreduce_(tensors, op=hvd.Max)
        c.equal("grouped_.max", tensors[1], stacked.max(0).values)

    def compression() -> None:
        mine = torch.tensor([0.5, -1.25, 2.0, 1024.0]) * (r + 1)
        out = hvd.allreduce(mine, op=hvd.Sum, compression=hvd.Compression.fp16)
        c.equal("fp16.exact", out, torch.tensor([0.5, -1.25, 2.0, 1024.0]) * 6)
        noisy = torch.linspace(-1, 1, 50, dtype=torch.float64) + r * 0.001
        out = hvd.allreduce(noisy, compression=hvd.Compression.fp16)
        expect = torch.linspace(-1, 1, 50, dtype=torch.float64) + 0.001
        c.close("fp16.average", out, expect, 2e-3)
        packed, ctx = hvd.Compression.fp16.compress(noisy)
        c.expect("fp16.compressed_dtype", packed.dtype == torch.float16)
        c.expect(
            "fp16.roundtrip_dtype",
            hvd.Compression.fp16.decompress(packed, ctx).dtype == torch.float64,
        )
        ints = torch.tensor([r])
        c.expect("fp16.ints_untouched", hvd.Compression.fp16.compress(ints)[0] is ints)

    def allgather() -> None:
        for dtype in (torch.float32, torch.int64, torch.float16, torch.int16, torch.bool):
            mine = torch.full((r + 1, 2, 3), r, dtype=dtype)
            out = hvd.allgather(mine)
            expect = torch.cat([torch.full((i + 1, 2, 3), i, dtype=dtype) for i in range(n)])
            c.equal(f"allgather.uneven.{dtype}", out, expect)
        empty_on_1 = torch.full((0 if r == 1 else 2, 4), float(r))
        out = hvd.allgather(empty_on_1)
        c.equal("allgather.empty_rank", out, torch.tensor([[0.0] * 4] * 2 + [[2.0] * 4] * 2))
        try:
            hvd.allgather(torch.zeros(2, r + 1), name="bad_shape")
            c.expect("allgather.shape_mismatch_raises", False, "no error")
        except ValueError as error:
            c.expect(
                "allgather.shape_mismatch_raises",
                "all dimensions but the first" in str(error),
                error,
            )
        try:
            hvd.allgather(torch.zeros(2, dtype=torch.float32 if r else torch.float64))
            c.expect("allgather.dtype_mismatch_raises", False, "no error")
        except ValueError as error:
            c.expect("allgather.dtype_mismatch_raises", "dtype" in str(error), error)
        # The job is still in step after the errors above.
        c.equal("allgather.after_error", hvd.allgather(torch.tensor([r])), torch.tensor([0, 1, 2]))
        x = torch.ones(r + 1, 2, requires_grad=True)
        hvd.allgather(x).sum().backward()
        c.equal("allgather.grad", x.grad, torch.ones(r + 1, 2))

    def broadcast() -> None:
        root = 2
        mine = rank_values(r, torch.float32)
        out = hvd.broadcast(mine, root_rank=root)
        c.equal("broadcast.value", out, rank_values(root, torch.float32))
        c.equal("broadcast.input_untouched", mine, rank_values(r, torch.float32))
        for dtype in (torch.int64, torch.int16, torch.bool, torch.float16):
            t = torch.full((3, 2), r % 2, dtype=dtype)
            returned = hvd.broadcast_(t, 1)
            c.expect(f"broadcast_.same_object.{dtype}", returned is t)
            c.equal(f"broadcast_.value.{dtype}", t, torch.full((3, 2), 1, dtype=dtype))
        try:
            hvd.broadcast_parameters({"w": torch.zeros(2 + r)}, root_rank=0)
            c.expect("broadcast.size_mismatch_raises", False, "no error")
        except ValueError as error:
            c.expect("broadcast.size_mismatch_raises", "different collectives" in str(error), error)
        c.equal("broadcast.after_error", hvd.broadcast(torch.tensor([r]), 1), torch.tensor([1]))
        try:
            hvd.broadcast(mine, root_rank=3)
            c.expect("broadcast.bad_root_raises", False, "no error")
        except ValueError:
            c.expect("broadcast.bad_root_raises", True)

    def make_model(seed: int) -> torch.nn.Sequential:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2)
        )
        norm = model[1]
        assert isinstance(norm, torch.nn.BatchNorm1d) and norm.running_mean is not None
        norm.running_mean.fill_(float(seed))
        return model

    def parameters() -> None:
        root = 1
        reference = make_model(100 + root).state_dict()
        model = make_model(100 + r)
        hvd.broadcast_parameters(model.state_dict(), root_rank=root)
        same = all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
        c.expect("broadcast_parameters.state_dict", same)
        model = make_model(100 + r)
        hvd.broadcast_parameters(list(model.named_parameters()), root_rank=root)
        params = dict(model.named_parameters())
        c.expect(
            "broadcast_parameters.pairs", all(torch.equal(params[k], reference[k]) for k in params)
        )
        c.expect(
            "broadcast_parameters.pairs_leave_buffers",
            model.state_dict()["1.running_mean"][0].item() == 100 + r,
        )
        plain = {"a": torch.full((2,), float(r)), "b": torch.tensor([r])}
        hvd.broadcast_parameters(plain, root_rank=2)
        c.expect(
            "broadcast_parameters.dict",
            plain["a"].tolist() == [2.0, 2.0] and plain["b"].item() == 2,
        )
        c.expect(
            "broadcast_parameters.requires_grad_kept",
            all(p.requires_grad for p in model.parameters()),
        )

    def objects() -> None:
        obj = {"rank": r, "items": list(range(r)), "name": f"worker-{r}"}
        c.expect(
            "broadcast_object.root2",
            hvd.broadcast_object(obj, root_rank=2)
            == {"rank": 2, "items": [0, 1], "name": "worker-2"},
        )
        c.expect("broadcast_object.default_root", hvd.broadcast_object(obj)["rank"] == 0)
        got = hvd.allgather_object(obj)
        c.expect(
            "allgather_object", [g["rank"] for g in got] == [0, 1, 2] and got[2]["items"] == [0, 1]
        )
        big = "x" * (100_000 * (r + 1))
        c.expect(
            "allgather_object.uneven",
            [len(s) for s in hvd.allgather_object(big)] == [100_000, 200_000, 300_000],
        )

    def misc() -> None:
        x = torch.full((3,), float(r + 1), requires_grad=True)
        hvd.allreduce(x, op=hvd.Sum).sum().backward()
        c.equal("allreduce.grad_sum", x.grad, torch.full((3,), 3.0))
        handle = hvd.allreduce_async(torch.tensor([float(r)]), op=hvd.Sum)
        c.expect("async.poll", hvd.poll(handle))
        c.equal("async.synchronize", hvd.synchronize(handle), torch.tensor([3.0]))
        handle = hvd.broadcast_async_(torch.tensor([r]), 2)
        c.equal("async.broadcast_", hvd.synchronize(handle), torch.tensor([2]))
        try:
            hvd.allreduce(torch.ones(2), op=hvd.Adasum)
            c.expect("adasum.not_implemented", False, "no error")
        except NotImplementedError:
            c.expect("adasum.not_implemented", True)
        try:
            hvd.allreduce(torch.ones(2), process_set=hvd.ProcessSet([0, 1], process_set_id=1))
            c.expect("process_set.not_implemented", False, "no error")
        except NotImplementedError:
            c.expect("process_set.not_implemented", True)
        out = hvd.allreduce(torch.ones(2), process_set=hvd.global_process_set)
        c.equal("process_set.global", out, torch.ones(2))
        hvd.barrier()
        c.expect("barrier", True)

    for name, body in [
        ("identity", identity),
        ("allreduce_ops", allreduce_ops),
        ("scaling", scaling),
        ("other_dtypes", other_dtypes),
        ("grouped", grouped),
        ("compression", compression),
        ("allgather", allgather),
        ("broadcast", broadcast),
        ("parameters", parameters),
        ("objects", objects),
        ("misc", misc),
    ]:
        c.run(name, body)

    def lifecycle() -> None:
        hvd.shutdown()
        c.expect("lifecycle.shutdown", not hvd.is_initialized())
        hvd.init()  # a new process group under a fresh store prefix
        c.expect("lifecycle.reinit_rank", (hvd.rank(), hvd.size()) == (r, n))
        out = hvd.allreduce(torch.tensor([r]), op=hvd.Sum)
        c.equal("lifecycle.reinit_allreduce", out, torch.tensor([3]))

    c.run("lifecycle", lifecycle)
    hvd.shutdown()
    c.finish(r)


if __name__ == "__main__":
    main()
