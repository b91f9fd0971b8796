"""Worker for the 2-rank job: broadcast_optimizer_state and DistributedOptimizer.

DistributedOptimizer is checked against single-process training computed inside the worker:
each rank trains on its half of a batch, the reference on the whole batch; with averaged
gradients the parameters must agree to 1e-6 after every step.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks, states_equal

import collectives.torch as hvd

STEPS = 5


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def make_wide_model() -> torch.nn.Module:
    """A weight of 300 KB among small ones."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 300),
        torch.nn.Tanh(),
        torch.nn.Linear(300, 256),
        torch.nn.Tanh(),
        torch.nn.Linear(256, 3),
    )


def batches(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 6, generator=generator)
    y = torch.randint(0, 3, (8,), generator=generator)
    return x, y


def main() -> None:
    torch.set_num_threads(1)
    c = Checks()
    hvd.init()
    r = hvd.rank()

    def train_alone(
        model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            optimizer.zero_grad()
            x = torch.randn(4, 6, generator=generator)
            y = torch.randint(0, 3, (4,), generator=generator)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()

    def optimizer_state() -> None:
        factories: dict[str, Callable[[list], torch.optim.Optimizer]] = {
            "sgd": lambda p: torch.optim.SGD(
                p, lr=0.1 * (r + 1), momentum=0.9, weight_decay=1e-3 * r
            ),
            "adam": lambda p: torch.optim.Adam(p, lr=0.01 * (r + 1), betas=(0.9, 0.99 - 0.01 * r)),
        }
        for label, factory in factories.items():
            # Diverged ranks: different data, hyper-parameters and numbers of steps.
            model = make_model(r)
            optimizer = factory(list(model.parameters()))
            train_alone(model, optimizer, steps=3 + 2 * r, seed=r)
            root_state = hvd.broadcast_object(optimizer.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            c.expect(
                f"optimizer_state.{label}.equal_root",
                states_equal(optimizer.state_dict(), root_state),
            )
            c.expect(
                f"optimizer_state.{label}.lr",
                optimizer.param_groups[0]["lr"]
                == 0.1 * (label == "sgd") + 0.01 * (label == "adam"),
            )
            if label == "adam":
                steps = [float(s["step"]) for s in optimizer.state.values()]
                c.expect("optimizer_state.adam.step_count", steps == [3.0] * 4, steps)
                c.expect(
                    "optimizer_state.adam.betas", optimizer.param_groups[0]["betas"] == (0.9, 0.99)
                )
            # From the same state, an identical step keeps the ranks identical.
            train_alone(model, optimizer, steps=1, seed=99)
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            gathered = hvd.allgather(flat.unsqueeze(0))
            c.equal(f"optimizer_state.{label}.in_step", gathered[r], gathered[1 - r])
        # A fresh rank gets the root's state; a stateful rank gets the root's fresh state.
        model = make_model(r)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        if r == 0:
            train_alone(model, optimizer, steps=2, seed=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        c.expect("optimizer_state.fresh_rank_filled", len(optimizer.state) == 4)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        if r == 1:
            train_alone(model, optimizer, steps=2, seed=0)
        before = [p.detach().clone() for p in model.parameters()]
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        # The root had no state: its dummy step's state (step 1) replaces rank 1's.
        steps = [float(s["step"]) for s in optimizer.state.values()]
        c.expect("optimizer_state.empty_root_dummy_step", steps == [1.0] * 4, steps)
        c.expect(
            "optimizer_state.params_untouched",
            all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)),
        )

    def compare_training(
        label: str,
        factory: Callable[[list], torch.optim.Optimizer],
        wrap: Callable[[torch.optim.Optimizer, torch.nn.Module], torch.optim.Optimizer],
        atol: float = 1e-6,
        build: Callable[[], torch.nn.Module] = make_model,
        set_to_none: bool = True,
        set_grads: bool = False,
    ) -> None:
        """``set_grads``: the script sets the gradients itself (``torch.autograd.grad``), so
        no backward hook moves them into the buckets before ``step()``."""
        reference = build()
        ref_opt = factory(list(reference.parameters()))
        model = build()
        opt = wrap(factory(list(model.parameters())), model)
        worst = 0.0
        for step in range(STEPS):
            x, y = batches(step)
            ref_opt.zero_grad()
            F.cross_entropy(reference(x), y).backward()
            ref_opt.step()
            half = slice(r * 4, (r + 1) * 4)
            opt.zero_grad(set_to_none=set_to_none)
            loss = F.cross_entropy(model(x[half]), y[half])
            if set_grads:
                params = list(model.parameters())
                for param, grad in zip(params, torch.autograd.grad(loss, params), strict=True):
                    param.grad = grad
            else:
                loss.backward()
            opt.step()
            for a, b in zip(model.parameters(), reference.parameters(), strict=True):
                worst = max(worst, (a - b).abs().max().item())
        c.expect(f"distributed_optimizer.{label}", worst <= atol, f"max difference {worst:g}")

    def distributed_optimizer() -> None:
        def sgd(params: list) -> torch.optim.Optimizer:
            return torch.optim.SGD(params, lr=0.5, momentum=0.9)

        def adam(params: list) -> torch.optim.Optimizer:
            return torch.optim.Adam(params, lr=0.05)

        def plain(opt: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
            return hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())

        compare_training("sgd", sgd, plain)
        compare_training("adam", adam, plain)
        compare_training("unnamed", sgd, lambda o, m: hvd.DistributedOptimizer(o))
        compare_training("wide", sgd, plain, build=make_wide_model)
        compare_training("wide.in_place", sgd, plain, build=make_wide_model, set_to_none=False)
        compare_training("wide.set_grads", sgd, plain, build=make_wide_model, set_grads=True)
        compare_training(
            "predivide",
            sgd,
            lambda o, m: hvd.DistributedOptimizer(o, gradient_predivide_factor=2.0),
        )
        compare_training(
            "fp16",
            sgd,
            lambda o, m: hvd.DistributedOptimizer(o, compression=hvd.Compression.fp16),
            atol=5e-3,
        )

        # synchronize() + skip_synchronize(), with gradient clipping in between.
        reference, model = make_model(), make_model()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))
        x, y = batches(0)
        F.cross_entropy(reference(x), y).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
        ref_opt.step()
        F.cross_entropy(model(x[r * 4 : (r + 1) * 4]), y[r * 4 : (r + 1) * 4]).backward()
        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        with opt.skip_synchronize():
            opt.step()
        diff = max(
            (a - b).abs().max().item()
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )
        c.expect("distributed_optimizer.skip_synchronize", diff <= 1e-6, diff)
        # step() right after synchronize() warns and does not reduce twice.
        F.cross_entropy(model(x), y).backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        c.expect(
            "distributed_optimizer.double_sync_warns",
            any("synchronize" in str(w.message) for w in caught),
        )

        # Wrapper keeps the optimizer's identity and state.
        base = torch.optim.Adam(model.parameters(), lr=0.01)
        opt = hvd.DistributedOptimizer(base)
        c.expect(
            "distributed_optimizer.isinstance",
            isinstance(opt, torch.optim.Adam) and type(opt).__name__ == "Adam",
        )
        c.expect("distributed_optimizer.param_groups", opt.param_groups[0]["lr"] == 0.01)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        c.expect("distributed_optimizer.state", len(opt.state_dict()["state"]) == 4)
        opt.zero_grad()
        c.expect("distributed_optimizer.zero_grad", all(p.grad is None for p in model.parameters()))
        try:
            hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                named_parameters=[("only", next(model.parameters()))],
            )
            c.expect("distributed_optimizer.unnamed_raises", False, "no error")
        except ValueError:
            c.expect("distributed_optimizer.unnamed_raises", True)

        # A parameter without a gradient on one rank (dynamic graph) does not hang the job.
        torch.manual_seed(0)
        trunk, extra = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD([*trunk.parameters(), *extra.parameters()], lr=1.0)
        )
        out = trunk(torch.ones(1, 3))
        if r == 1:
            out = extra(out)
        out.sum().backward()
        opt.step()
        flat = torch.cat(
            [p.detach().reshape(-1) for p in [*trunk.parameters(), *extra.parameters()]]
        )
        gathered = hvd.allgather(flat.unsqueeze(0))
        c.equal("distributed_optimizer.missing_grad", gathered[0], gathered[1])

        # backward_passes_per_step: gradients of two passes accumulate, then one reduction.
        reference, model = make_model(), make_model()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5), backward_passes_per_step=2
        )
        x, y = batches(3)
        for part in range(2):
            rows = slice(r * 4 + 2 * part, r * 4 + 2 * part + 2)
            (F.cross_entropy(model(x[rows]), y[rows]) / 4).backward()
        opt.step()
        (F.cross_entropy(reference(x), y) * 2 / 4).backward()
        ref_opt.step()
        diff = max(
            (a - b).abs().max().item()
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )
        c.expect("distributed_optimizer.backward_passes", diff <= 1e-6, diff)

        # Sparse embedding gradients are gathered and averaged.
        torch.manual_seed(0)
        emb, ref_emb = (
            torch.nn.Embedding(10, 4, sparse=True),
            torch.nn.Embedding(10, 4, sparse=True),
        )
        ref_emb.load_state_dict(emb.state_dict())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0))
        ref_opt = torch.optim.SGD(ref_emb.parameters(), lr=1.0)
        ids = torch.tensor([[1, 2, 3, 3], [3, 7, 9, 1]])
        emb(ids[r]).pow(2).sum().backward()
        opt.step()
        (ref_emb(ids).pow(2).sum() / 2).backward()
        ref_opt.step()
        c.close("distributed_optimizer.sparse", emb.weight.detach(), ref_emb.weight.detach(), 1e-6)

    def process_set_optimizer() -> None:
        # Each rank alone in its own process set: its gradients are averaged over itself.
        sets = [hvd.add_process_set([0]), hvd.add_process_set([1])]
        model, reference = make_model(), make_model()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.5), process_set=sets[r]
        )
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
        x, y = batches(0)
        half = slice(r * 4, (r + 1) * 4)
        F.cross_entropy(model(x[half]), y[half]).backward()
        opt.step()
        F.cross_entropy(reference(x[half]), y[half]).backward()
        ref_opt.step()
        diff = max(
            (a - b).abs().max().item()
            for a, b in zip(model.parameters(), reference.parameters(), strict=True)
        )
        c.expect("distributed_optimizer.process_set", diff <= 1e-6, diff)
        # Rank 1 is outside the Adasum optimizer's process set: it steps on its own
        # gradient, as outside a set with any other op (it did not step at all).
        p = torch.nn.Parameter(torch.tensor([1.0, 1.0]))
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD([p], lr=1.0),
            named_parameters=[("adasum.outside", p)],
            op=hvd.Adasum,
            process_set=sets[0],
        )
        (p * torch.tensor([1.0, float(r)])).sum().backward()
        opt.step()
        c.close("adasum.outside_set", p.detach(), torch.tensor([0.0, 1.0 - r]), 0.0)

    def float16_average() -> None:
        # float16 Average sums, then divides, as Horovod does: every rank's gradient of
        # 3 * 2**-24 (subnormal) averages to itself. Dividing each first by the size (exact
        # for a power of two, but not for subnormals) gave 4 * 2**-24, or 0 for 2**-24.
        tiny = 2.0**-24
        for step in range(3):  # (the first op and its repetitions take different paths)
            for numel in (3, 40_000):  # (rides the negotiation; reduced on its own)
                got = hvd.allreduce(
                    torch.full((numel,), 3 * tiny, dtype=torch.float16), name=f"half.{numel}"
                )
                c.expect(f"fp16.average.{numel}.{step}", bool((got == 3 * tiny).all()), got[:2])
        weight = torch.nn.Parameter(torch.ones(8, dtype=torch.float16))
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD([weight], lr=1.0), named_parameters=[("weight", weight)]
        )
        for step in range(2):
            opt.zero_grad()
            (weight * torch.full((8,), tiny, dtype=torch.float16)).sum().backward()
            opt.synchronize()
            grad = weight.grad
            ok = grad is not None and bool((grad == tiny).all())
            c.expect(f"fp16.optimizer.{step}", ok, None if grad is None else grad[:2])
            with opt.skip_synchronize():
                opt.step()

    c.run("optimizer_state", optimizer_state)
    c.run("float16_average", float16_average)
    c.run("distributed_optimizer", distributed_optimizer)
    c.run("process_set_optimizer", process_set_optimizer)
    hvd.shutdown()
    c.finish(r)


if __name__ == "__main__":
    main()
