"""Worker for the 2- and 3-rank jobs that check Horovod's semantics where scripts rely on
them: which errors are RuntimeErrors (and never HorovodInternalError), ops refused while a
rank has joined, global root ranks in process sets, the gradients' conventions, Horovod's
placement variables, sparse_allreduce_async, broadcast_optimizer_state with parameters that
have no gradient yet, and sparse_as_dense with a sparse-only optimizer."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks, states_equal

import collectives.torch as hvd


def main() -> None:
    torch.set_num_threads(1)
    c = Checks()
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    everyone = list(range(n))
    # Every rank but 0: [1] on two ranks, [1, 2] on three. Its last rank is the root below.
    tail = hvd.add_process_set(everyone[1:])
    root = n - 1

    def raises(
        name: str, call: Callable[[], object], kind: type[BaseException], words: list[str]
    ) -> BaseException | None:
        try:
            call()
        except kind as error:
            text = str(error)
            c.expect(name, all(w in text for w in words), text)
            return error
        except Exception as error:
            c.expect(name, False, f"{type(error).__name__}: {error}")
            return None
        c.expect(name, False, "no error")
        return None

    def program_error(name: str, error: BaseException | None, cls: type[BaseException]) -> None:
        """Horovod raises these as RuntimeError; they are never a lost peer."""
        c.expect(
            f"{name}.class",
            isinstance(error, RuntimeError)
            and isinstance(error, cls)
            and isinstance(error, hvd.CollectiveError)
            and not isinstance(error, hvd.HorovodInternalError),
            repr(error),
        )

    def environment() -> None:
        env = os.environ
        want = {
            "HOROVOD_RANK": r,
            "HOROVOD_SIZE": n,
            "HOROVOD_LOCAL_RANK": hvd.local_rank(),
            "HOROVOD_LOCAL_SIZE": hvd.local_size(),
            "HOROVOD_CROSS_RANK": hvd.cross_rank(),
            "HOROVOD_CROSS_SIZE": hvd.cross_size(),
        }
        got = {name: int(env.get(name, "-1")) for name in want}
        c.expect("env.horovod_placement", got == want, got)
        c.expect(
            "env.horovod_hostname",
            env.get("HOROVOD_HOSTNAME") == env.get("HVDRUN_HOSTNAME") == "localhost",
            env.get("HOROVOD_HOSTNAME"),
        )

    def mismatches() -> None:
        cases: list[tuple[str, Callable[[], object]]] = [
            ("shape", lambda: hvd.allreduce(torch.ones(r + 1), name="e.shape")),
            (
                "dtype",
                lambda: hvd.allreduce(
                    torch.ones(2, dtype=torch.float32 if r else torch.float64), name="e.dtype"
                ),
            ),
            (
                "op",
                lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if r else hvd.Max, name="e.op"),
            ),
            ("root", lambda: hvd.broadcast(torch.ones(2), root_rank=min(r, 1), name="e.root")),
            (
                "splits",
                lambda: hvd.alltoall(
                    torch.ones(n, 2),
                    splits=[n] + [0] * (n - 1) if r else [1] * (n - 1),
                    name="e.splits",
                ),
            ),
            ("gather", lambda: hvd.allgather(torch.ones(2, r + 1), name="e.gather")),
            ("reducescatter", lambda: hvd.reducescatter(torch.ones(n * (r + 1)), name="e.rs")),
            (  # as many elements, another shape
                "adasum_shape",
                lambda: hvd.allreduce(
                    torch.ones((3, 2) if r else (2, 3)), op=hvd.Adasum, name="e.adasum"
                ),
            ),
        ]
        for what, call in cases:
            error = raises(f"error.mismatch.{what}", call, RuntimeError, [])
            program_error(f"error.mismatch.{what}", error, hvd.TensorMismatchError)
        # Splits that are not integers: at the call, on the rank that passed them.
        for what, splits in (("float_tensor", torch.ones(n)), ("float_list", [1.5] * n)):
            error = raises(
                f"error.splits_type.{what}",
                lambda s=splits: hvd.alltoall(torch.ones(n), splits=s),  # type: ignore[misc]
                RuntimeError,
                ["splits must be integers"],
            )
            c.expect(
                f"error.splits_type.{what}.class",
                isinstance(error, ValueError)
                and isinstance(error, TypeError)
                and not isinstance(error, hvd.HorovodInternalError),
                repr(error),
            )
        out = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="e.after")
        c.equal("error.job_usable_after", out, torch.tensor([float(n)]))

    def elastic_does_not_retry() -> None:
        calls: list[int] = []

        @hvd.elastic.run
        def train(state: hvd.elastic.ObjectState) -> None:
            calls.append(1)
            hvd.allreduce(torch.ones(r + 1), name="e.elastic")

        error = raises(
            "error.elastic_propagates",
            lambda: train(hvd.elastic.ObjectState(epoch=0)),
            hvd.TensorMismatchError,
            ["e.elastic"],
        )
        c.expect("error.elastic_no_retry", calls == [1] and error is not None, calls)

    def join() -> None:
        # Rank 0 joins at once; the others' ops that join does not support raise on them,
        # as in Horovod, and an allreduce still runs (rank 0 adds zeros).
        if r == 0:
            last = hvd.join()
        else:
            refused: list[tuple[str, Callable[[], object]]] = [
                ("allgather", lambda: hvd.allgather(torch.ones(1), name="j.gather")),
                ("broadcast", lambda: hvd.broadcast(torch.ones(1), root_rank=1, name="j.bcast")),
                ("alltoall", lambda: hvd.alltoall(torch.ones(n), name="j.a2a")),
                ("reducescatter", lambda: hvd.reducescatter(torch.ones(n), name="j.rs")),
                ("broadcast_object", lambda: hvd.broadcast_object(r, root_rank=1, name="j.obj")),
                (
                    "sparse_allreduce",
                    lambda: hvd.synchronize(
                        hvd.sparse_allreduce_async(torch.eye(3).to_sparse(), "j.sparse", hvd.Sum)
                    ),
                ),
            ]
            for what, call in refused:
                error = raises(f"join.refuses.{what}", call, RuntimeError, ["join"])
                program_error(f"join.refuses.{what}", error, hvd.NotSupportedWithJoinError)
            out = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, name="j.sum")
            c.equal("join.allreduce_runs", out, torch.tensor([float(sum(everyone))]))
            # A set without the joined rank is not affected.
            got = hvd.broadcast(torch.tensor([r]), root_rank=root, process_set=tail)
            c.equal("join.other_set_runs", got, torch.tensor([root]))
            last = hvd.join()
        # The last rank to join (rank 0 joined first), the same on every rank.
        lasts = hvd.allgather_object(last)
        c.expect("join.returns_last", lasts == [lasts[0]] * n and lasts[0] != 0, lasts)
        out = hvd.allgather(torch.tensor([r]), name="j.after")
        c.equal("join.after_all_joined", out, torch.tensor(everyone))

    def join_late() -> None:
        # Rank 0 joins last, well after the others, though its engine was idle meanwhile
        # (so every join reaches the same negotiation round): join() still names rank 0.
        if r == 0:
            time.sleep(0.3)
        lasts = hvd.allgather_object(hvd.join())
        c.expect("join.late_low_rank", lasts == [0] * n, lasts)

    def join_late_high() -> None:
        # After cached ops, rank 0 joins first and the highest rank last: the early joins
        # wait in a cached round, and join runs in a full round the ranks enter together.
        for _ in range(3):
            hvd.allreduce(torch.ones(1), name="jh.warm")
        time.sleep(0.3 * r / max(n - 1, 1))
        lasts = hvd.allgather_object(hvd.join())
        c.expect("join.late_high_rank", lasts == [n - 1] * n, lasts)

    def roots() -> None:
        # root_rank is a global rank inside a process set, as in Horovod.
        if tail.included():
            got = hvd.broadcast(torch.tensor([r * 10]), root_rank=root, process_set=tail)
            c.equal("root.global.broadcast", got, torch.tensor([root * 10]))
            x = torch.tensor([float(r)])
            hvd.broadcast_(x, root_rank=root, process_set=tail)
            c.equal("root.global.broadcast_", x, torch.tensor([float(root)]))
            got = hvd.synchronize(hvd.broadcast_async(torch.tensor([r]), root, process_set=tail))
            c.equal("root.global.broadcast_async", got, torch.tensor([root]))
            obj = hvd.broadcast_object({"from": r}, root_rank=root, process_set=tail)
            c.expect("root.global.broadcast_object", obj == {"from": root}, obj)
            params = {"w": torch.full((2,), float(r))}
            hvd.broadcast_parameters(params, root_rank=root, process_set=tail)
            c.equal("root.global.broadcast_parameters", params["w"], torch.full((2,), float(root)))
            model = torch.nn.Linear(2, 1)
            opt = torch.optim.Adam(model.parameters(), lr=0.1)
            if r == root:
                model(torch.ones(1, 2)).sum().backward()
                opt.step()
            hvd.broadcast_optimizer_state(opt, root_rank=root, process_set=tail)
            c.expect("root.global.broadcast_optimizer_state", len(opt.state) == 2, opt.state)
            # A root outside the set: a clear error on every member, at the call.
            for what, call in [
                ("broadcast", lambda: hvd.broadcast(torch.ones(1), root_rank=0, process_set=tail)),
                (
                    "broadcast_object",
                    lambda: hvd.broadcast_object(1, root_rank=0, process_set=tail),
                ),
                (
                    "broadcast_parameters",
                    lambda: hvd.broadcast_parameters(
                        {"w": torch.ones(1)}, root_rank=0, process_set=tail
                    ),
                ),
            ]:
                raises(
                    f"root.outside.{what}",
                    call,
                    ValueError,
                    ["root_rank 0 is not a member of the process set", "global rank"],
                )
            got = hvd.broadcast(torch.tensor([r]), root_rank=root, process_set=tail)
            c.equal("root.outside.set_usable_after", got, torch.tensor([root]))
            # Members that disagree on the root: the message names the global ranks passed.
            if len(tail.ranks) > 1:
                raises(
                    "root.mismatch_in_set",
                    lambda: hvd.broadcast(torch.ones(1), r, process_set=tail, name="r.mm"),
                    hvd.TensorMismatchError,
                    ["root_rank", *(f"rank {q}: {q}" for q in tail.ranks)],
                )
            else:
                c.expect("root.mismatch_in_set", True)
        else:
            for name in (
                "broadcast",
                "broadcast_",
                "broadcast_async",
                "broadcast_object",
                "broadcast_parameters",
                "broadcast_optimizer_state",
            ):
                c.expect(f"root.global.{name}", True)
            for name in ("broadcast", "broadcast_object", "broadcast_parameters"):
                c.expect(f"root.outside.{name}", True)
            c.expect("root.outside.set_usable_after", True)
            c.expect("root.mismatch_in_set", True)
        raises(
            "root.out_of_job",
            lambda: hvd.broadcast(torch.ones(1), root_rank=n),
            ValueError,
            ["out of range"],
        )

    def gradients() -> None:
        # reducescatter: Horovod scales Sum's gradient by the set's size, Average's not at all.
        for label, op, factor in (("sum", hvd.Sum, n), ("average", hvd.Average, 1)):
            x = torch.ones(n * 2, 3, requires_grad=True)
            (hvd.reducescatter(x, op=op, name=f"g.rs.{label}") * (r + 1)).sum().backward()
            want = torch.cat([torch.full((2, 3), float((q + 1) * factor)) for q in everyone])
            c.close(f"grad.reducescatter.{label}", x.grad, want, 1e-6)
        x = torch.ones(n, requires_grad=True)
        out = hvd.reducescatter(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
        out.sum().backward()
        c.close("grad.reducescatter.scaled", x.grad, torch.full((n,), float(n)), 1e-6)
        xs = [torch.ones(n, requires_grad=True)]
        hvd.grouped_reducescatter(xs, op=hvd.Average)[0].sum().backward()
        c.close("grad.grouped_reducescatter.average", xs[0].grad, torch.ones(n), 1e-6)
        # In a process set: reducescatter (set size), broadcast (root global), allgather.
        if tail.included():
            m, me = len(tail.ranks), tail.ranks.index(r)
            x = torch.ones(m * 2, requires_grad=True)
            hvd.reducescatter(x, op=hvd.Sum, process_set=tail).sum().backward()
            c.close("grad.set.reducescatter", x.grad, torch.full((m * 2,), float(m)), 1e-6)
            x = torch.ones(2, requires_grad=True)
            (hvd.broadcast(x, root_rank=root, process_set=tail) * (r + 1)).sum().backward()
            mean = sum(q + 1 for q in tail.ranks) / m
            want = torch.full((2,), mean if r == root else 0.0)
            c.close("grad.set.broadcast", x.grad, want, 1e-6)
            x = torch.ones(me + 1, requires_grad=True)
            (hvd.allgather(x, process_set=tail) * (r + 1)).sum().backward()
            c.close("grad.set.allgather", x.grad, torch.full((me + 1,), mean), 1e-6)
        else:
            for name in ("reducescatter", "broadcast", "allgather"):
                c.expect(f"grad.set.{name}", True)

    def sparse() -> None:
        # Rank q contributes rows q and q+1 of a 6x2 matrix, values (q + 1) * [1, 2].
        def mine(q: int) -> torch.Tensor:
            dense = torch.zeros(6, 2)
            dense[q : q + 2] = torch.tensor([1.0, 2.0]) * (q + 1)
            return dense

        total = sum(mine(q) for q in everyone)
        assert isinstance(total, torch.Tensor)
        for label, op, want in (("sum", hvd.Sum, total), ("average", hvd.Average, total / n)):
            sparse_ = mine(r).to_sparse(1)
            handle = hvd.sparse_allreduce_async(sparse_, f"s.{label}", op)
            c.expect(f"sparse.{label}.is_int_handle", isinstance(handle, int))
            result = hvd.synchronize(handle)
            c.expect(f"sparse.{label}.is_sparse", result.is_sparse and result.is_coalesced())
            c.close(f"sparse.{label}.values", result.to_dense(), want, 1e-6)
            c.equal(f"sparse.{label}.input_untouched", sparse_.to_dense(), mine(r))
        # Horovod's callable handle, and a process set (divides by the set's size).
        handle = hvd.sparse_allreduce_async(mine(r).to_sparse(), "s.call", hvd.Average)
        c.close("sparse.callable", handle().to_dense(), total / n, 1e-6)
        if tail.included():
            handle = hvd.sparse_allreduce_async(mine(r).to_sparse(1), None, hvd.Average, tail)
            want = sum(mine(q) for q in tail.ranks) / len(tail.ranks)
            c.close("sparse.process_set", hvd.synchronize(handle).to_dense(), want, 1e-6)
        else:
            c.expect("sparse.process_set", True)
        # Tensors of different shapes (an embedding of another size): a mismatch, as for
        # dense ops, not indices combined out of range.
        error = raises(
            "sparse.shape_mismatch",
            lambda: hvd.synchronize(
                hvd.sparse_allreduce_async(torch.ones(4 + r, 2).to_sparse(1), "s.shape", hvd.Sum)
            ),
            hvd.TensorMismatchError,
            ["allgather 's.shape'", "shape"],
        )
        program_error("sparse.shape_mismatch", error, hvd.TensorMismatchError)
        raises(
            "sparse.dense_refused",
            lambda: hvd.sparse_allreduce_async(torch.ones(2), "s.dense", hvd.Sum),
            TypeError,
            ["sparse COO tensor"],
        )

    def optimizer_state_without_grads() -> None:
        # Only the first layer has a gradient (and state) yet; the second has neither.
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        if r == 0:
            model[0](torch.ones(2, 3)).sum().backward()
            opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        state = opt.state_dict()
        c.expect("optimizer_state.partial.params_with_state", sorted(state["state"]) == [0, 1])
        # Rank 1 had no state: Horovod's dummy step left zero gradients there.
        grad = model[1].weight.grad
        c.expect(
            "optimizer_state.partial.grads",
            grad is None if r == 0 else grad is not None and not grad.any(),
            grad,
        )
        gathered = hvd.allgather_object(state)
        c.expect(
            "optimizer_state.partial.equal", all(states_equal(gathered[0], s) for s in gathered)
        )
        # Wrapped in DistributedOptimizer, before any backward pass (Horovod's usual order).
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        model.zero_grad()
        dist_opt = hvd.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
        )
        hvd.broadcast_optimizer_state(dist_opt, root_rank=0)
        c.expect("optimizer_state.partial.fresh_wrapped", len(dist_opt.state) == 4)
        model(torch.ones(2, 3) * (r + 1)).sum().backward()
        dist_opt.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        rows = hvd.allgather(flat.unsqueeze(0))
        c.expect("optimizer_state.partial.trains", all(torch.equal(rows[0], row) for row in rows))

    def sparse_only_optimizer() -> None:
        ids = [torch.tensor([q, q + 1, 5]) for q in everyone]  # rank q looks up ids[q]
        for sparse_as_dense in (True, False):
            torch.manual_seed(1)
            emb = torch.nn.Embedding(8, 3, sparse=True)
            ref = torch.nn.Embedding(8, 3, sparse=True)
            ref.load_state_dict(emb.state_dict())
            opt = hvd.DistributedOptimizer(
                torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                named_parameters=emb.named_parameters(),
                sparse_as_dense=sparse_as_dense,
            )
            ref_opt = torch.optim.SparseAdam(ref.parameters(), lr=0.1)
            tag = "dense" if sparse_as_dense else "sparse"
            for step in range(2):
                opt.zero_grad()
                emb(ids[r]).pow(2).sum().mul(step + 1).backward()
                opt.step()
                c.expect(f"sparse_adam.{tag}.grad_sparse.{step}", emb.weight.grad.is_sparse)
                # The reference: one process, the average of every rank's loss.
                ref_opt.zero_grad()
                sum(ref(i).pow(2).sum() for i in ids).mul((step + 1) / n).backward()
                ref_opt.step()
            c.close(f"sparse_adam.{tag}", emb.weight.detach(), ref.weight.detach(), 1e-5)

    for name, body in [
        ("environment", environment),
        ("mismatches", mismatches),
        ("elastic_does_not_retry", elastic_does_not_retry),
        ("join", join),
        ("join_late", join_late),
        ("join_late_high", join_late_high),
        ("roots", roots),
        ("gradients", gradients),
        ("sparse", sparse),
        ("optimizer_state_without_grads", optimizer_state_without_grads),
        ("sparse_only_optimizer", sparse_only_optimizer),
    ]:
        c.run(name, body)
    hvd.shutdown()
    c.finish(r)


if __name__ == "__main__":
    main()
