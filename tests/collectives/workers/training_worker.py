"""Worker for the training-API jobs (2, 3 and 4 ranks): DistributedOptimizer, broadcasts,
compression, Adasum and SyncBatchNorm against single-process references.

Every reference is computed inside the worker, on every rank, from the same seeds: the
whole batch in one process for DistributedOptimizer and SyncBatchNorm, and a direct
float64 implementation of Adasum's formula over all ranks' tensors for Adasum.
"""

from __future__ import annotations

import copy
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks, states_equal

import collectives.torch as hvd
from collectives import ops

STEPS = 20
BATCH = 24  # divisible by 2, 3 and 4 ranks, and by two passes per rank


@dataclass
class Payload:
    """A module-level class: broadcast_object/allgather_object need only pickle."""

    name: str
    values: list[float]


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), torch.nn.Tanh(),
        torch.nn.Linear(8, 3),
    )  # fmt: skip


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, 6, generator=generator), torch.randint(
        0, 3, (BATCH,), generator=generator
    )


def max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(
        (x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters(), strict=True)
    )


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def same_on_all_ranks(tensor: torch.Tensor) -> bool:
    gathered = hvd.allgather(tensor.detach().reshape(1, -1).contiguous())
    return all(torch.equal(gathered[0], row) for row in gathered)


def reference_adasum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Adasum straight from the formula, in float64: pairs (0,1), (2,3), ..., then their
    results, a rank without a partner carried up."""
    level = [t.double().reshape(-1) for t in tensors]
    while len(level) > 1:
        combined = []
        for i in range(0, len(level) - 1, 2):
            a, b = level[i], level[i + 1]
            dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
            ca = 1.0 - dot / (2 * aa) if aa else 1.0
            cb = 1.0 - dot / (2 * bb) if bb else 1.0
            combined.append(ca * a + cb * b)
        if len(level) % 2:
            combined.append(level[-1])
        level = combined
    return level[0].reshape(tensors[0].shape)


def main() -> None:
    torch.set_num_threads(1)
    c = Checks()
    early = hvd.elastic.ElasticSampler(list(range(12)), shuffle=False)  # (before hvd.init())
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    # A sampler made before hvd.init() takes this rank's share at its first use.
    shares = hvd.allgather_object((len(early), list(early)))
    got = sorted(i for _, indices in shares for i in indices)
    c.expect("sampler.made_before_init", shares[r][0] == 12 // n and got == list(range(12)), shares)
    rows = BATCH // n
    mine = slice(r * rows, (r + 1) * rows)

    def sgd(params: list) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    def adam(params: list) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=0.01)

    def compare(
        label: str,
        factory: Callable[[list], torch.optim.Optimizer],
        passes: int = 1,
        atol: float = 1e-6,
        freeze: Callable[[torch.nn.Module, int], None] | None = None,
        **options: object,
    ) -> None:
        """Trains on this rank's slice of each batch (in ``passes`` backward passes) and the
        reference on the whole batch; the parameters must agree after every step."""
        reference, model = make_model(), make_model()
        if freeze is not None:  # frozen parameters get their hook once they train
            freeze(reference, 0)
            freeze(model, 0)
        ref_opt = factory(list(reference.parameters()))
        if callable(options.get("groups")):
            options["groups"] = options["groups"](model)
        opt = hvd.DistributedOptimizer(
            factory(list(model.parameters())),
            named_parameters=model.named_parameters(),
            backward_passes_per_step=passes,
            **options,
        )
        scale = float(n) if options.get("op") == hvd.Sum else 1.0
        worst = 0.0
        for step in range(STEPS):
            if freeze is not None:
                freeze(reference, step)
                freeze(model, step)
            x, y = batch(step)
            ref_opt.zero_grad()
            F.cross_entropy(reference(x), y).backward()
            ref_opt.step()
            opt.zero_grad()
            part = rows // passes
            for k in range(passes):
                sub = slice(r * rows + k * part, r * rows + (k + 1) * part)
                (F.cross_entropy(model(x[sub]), y[sub]) / (passes * scale)).backward()
            opt.step()
            worst = max(worst, max_diff(model, reference))
        c.expect(f"equivalence.{label}", worst <= atol, f"max difference {worst:g}")
        c.expect(f"equivalence.{label}.same_on_ranks", same_on_all_ranks(flat(model)))

    def equivalence() -> None:
        for passes in (1, 2):
            compare(f"sgd.passes{passes}", sgd, passes)
            compare(f"adam.passes{passes}", adam, passes)
        compare("sum", sgd, op=hvd.Sum)
        # Horovod's groups: a number of groups, or lists (the other parameters alone).
        compare("groups.count", adam, groups=4)
        compare("groups.lists", adam, groups=lambda m: [[m[4].weight, m[0].bias], [m[2].weight]])
        compare("predivide", sgd, gradient_predivide_factor=float(n))
        compare("fp16", sgd, atol=2e-3, compression=hvd.Compression.fp16)
        compare("fp16.adam", adam, atol=2e-3, compression=hvd.Compression.fp16)

        def freeze_first_layer(model: torch.nn.Module, step: int) -> None:
            # Frozen at first, trained from step 4, frozen again from 12 to 16.
            for param in model[0].parameters():
                param.requires_grad_(4 <= step < 12 or step >= 16)

        compare("requires_grad_changes", sgd, freeze=freeze_first_layer)

    def hooks() -> None:
        # The gradients are reduced while (and after) backward runs, before step() is called.
        reference, model = make_model(), make_model()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
        )
        x, y = batch(0)
        F.cross_entropy(reference(x), y).backward()
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        expected = [p.grad for p in reference.parameters()]
        deadline = time.monotonic() + 30
        while True:
            reduced = all(
                torch.allclose(p.grad, g, rtol=0, atol=1e-6)
                for p, g in zip(model.parameters(), expected, strict=True)
            )
            if reduced or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        c.expect("hooks.reduced_before_step", reduced)
        # zero_grad() between backward and step is an error, and leaves everything usable.
        try:
            opt.zero_grad()
            c.expect("hooks.zero_grad_raises", False, "no error")
        except AssertionError as error:
            c.expect("hooks.zero_grad_raises", "before optimizer.step()" in str(error), error)
        opt.step()
        opt.zero_grad()
        c.expect("hooks.zero_grad_after_step", all(p.grad is None for p in model.parameters()))
        # More backward passes than backward_passes_per_step before step() is an error.
        model = make_model()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=2
        )
        try:
            for _ in range(3):
                F.cross_entropy(model(x[mine]), y[mine]).backward()
            c.expect("hooks.too_many_passes_raises", False, "no error")
        except AssertionError as error:  # (Horovod's class)
            c.expect(
                "hooks.too_many_passes_raises", "backward_passes_per_step=2" in str(error), error
            )
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
        opt.zero_grad()
        # set_backward_passes_per_step changes the accumulation of later steps.
        reference, model = make_model(), make_model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        opt.set_backward_passes_per_step(3)
        for _ in range(3):
            F.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
        F.cross_entropy(reference(x), y).mul(3).backward()
        ref_opt.step()
        c.expect("hooks.set_backward_passes_per_step", max_diff(model, reference) <= 1e-6)
        # An LR scheduler made before wrapping (it patches step() on the instance).
        reference, model = make_model(), make_model()
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
        base = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
        opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
        for step in range(3):
            x, y = batch(step)
            ref_opt.zero_grad()
            F.cross_entropy(reference(x), y).backward()
            ref_opt.step()
            ref_sched.step()
            opt.zero_grad()
            F.cross_entropy(model(x[mine]), y[mine]).backward()
            opt.step()
            sched.step()
        c.expect("hooks.scheduler_before_wrap", max_diff(model, reference) <= 1e-6)

    def dynamic_graphs() -> None:
        # A layer only rank 0 uses: the others reduce zeros for it, nobody hangs.
        torch.manual_seed(0)
        trunk, extra = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        ref_extra = copy.deepcopy(extra)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD([*trunk.parameters(), *extra.parameters()], lr=1.0)
        )
        out = trunk(torch.ones(1, 3))
        hidden = out.detach()
        if r == 0:
            out = extra(out)
        out.sum().backward()
        opt.step()
        ref_extra(hidden).sum().backward()
        with torch.no_grad():
            expected = ref_extra.weight - ref_extra.weight.grad / n
        c.expect("dynamic.same_on_ranks", same_on_all_ranks(flat(extra)))
        c.close("dynamic.extra_weight", extra.weight.detach(), expected, 1e-6)

    def added_group() -> None:
        # A group added with add_param_group() after wrapping is reduced like the others.
        reference, model = make_model(), make_model()
        ref_layers, layers = list(reference.children()), list(model.children())
        ref_opt = torch.optim.SGD(ref_layers[0].parameters(), lr=0.1)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(layers[0].parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
        )
        for step in range(4):
            if step == 2:  # (one group named by named_parameters, one not in a list)
                ref_opt.add_param_group({"params": ref_layers[2].parameters(), "lr": 0.2})
                opt.add_param_group({"params": layers[2].parameters(), "lr": 0.2})
                ref_opt.add_param_group({"params": ref_layers[4].parameters()})
                opt.add_param_group({"params": list(layers[4].parameters())})
            x, y = batch(step)
            ref_opt.zero_grad()
            F.cross_entropy(reference(x), y).backward()
            ref_opt.step()
            opt.zero_grad()
            F.cross_entropy(model(x[mine]), y[mine]).backward()
            opt.step()
        worst = max_diff(model, reference)
        c.expect("added_group.reduced", worst <= 1e-6, f"max difference {worst:g}")
        c.expect("added_group.same_on_ranks", same_on_all_ranks(flat(model)))

    def closure_of(
        opt: torch.optim.Optimizer, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
    ) -> Callable[[], float]:
        def closure() -> float:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss.item()  # (float(loss) would spend torch's warning, given once)

        return closure

    def closures() -> None:
        # step(closure): the gradients the closure computes are the ones reduced and used,
        # also by LBFGS, which calls it several times per step.
        for label, factory in (
            ("sgd", sgd),
            ("lbfgs", lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=4)),
            # (its line search reads the loss: the ranks' losses differ, their mean does not)
            (
                "lbfgs_wolfe",
                lambda p: torch.optim.LBFGS(p, max_iter=5, line_search_fn="strong_wolfe"),
            ),
        ):
            reference, model = make_model(), make_model()
            ref_opt = factory(list(reference.parameters()))
            opt = hvd.DistributedOptimizer(
                factory(list(model.parameters())), named_parameters=model.named_parameters()
            )
            for step in range(3):
                x, y = batch(step)
                ref_opt.step(closure_of(ref_opt, reference, x, y))
                opt.step(closure_of(opt, model, x[mine], y[mine]))
            worst = max_diff(model, reference)
            c.expect(f"closure.{label}", worst <= 1e-5, f"max difference {worst:g}")
            c.expect(f"closure.{label}.same_on_ranks", same_on_all_ranks(flat(model)))
        # A backward before step(closure) and a closure that runs none: the gradients are
        # reduced once (op=Sum: twice would multiply them by the size).
        reference, model = make_model(), make_model()
        ref_opt = sgd(list(reference.parameters()))
        opt = hvd.DistributedOptimizer(
            sgd(list(model.parameters())), named_parameters=model.named_parameters(), op=hvd.Sum
        )
        for step in range(3):
            x, y = batch(step)
            ref_opt.zero_grad()
            (F.cross_entropy(reference(x), y) * n).backward()  # (the shards' means, summed)
            ref_opt.step()
            opt.zero_grad()
            loss = F.cross_entropy(model(x[mine]), y[mine])
            loss.backward()
            opt.step(lambda: loss.item())  # noqa: B023 (called within this iteration)
        worst = max_diff(model, reference)
        c.expect("closure.no_backward", worst <= 1e-5, f"max difference {worst:g}")
        # A closure that returns the loss tensor, as torch's docs write it: no warning.
        x, y = batch(0)

        def tensor_loss() -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x[mine]), y[mine])
            loss.backward()
            return loss

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step(tensor_loss)
        c.expect("closure.tensor_loss_no_warning", not caught, [str(w.message) for w in caught])
        # A closure that runs a backward on rank 0 only (rank 1 skips its batch): every rank
        # still takes part in the reduction (rank 1 with zeros), and none waits for ever.
        model = make_model()
        opt = hvd.DistributedOptimizer(
            sgd(list(model.parameters())), named_parameters=model.named_parameters()
        )

        def one_sided() -> float:
            opt.zero_grad()
            loss = F.cross_entropy(model(x[mine]), y[mine])
            if r == 0:
                loss.backward()
            return float(loss)

        for _ in range(2):
            opt.step(one_sided)
        c.expect("closure.one_sided.same_on_ranks", same_on_all_ranks(flat(model)))

    def name_errors() -> None:
        model = make_model()
        named = list(model.named_parameters())
        for label, bad, text in (
            ("missing", named[:-1], "are not in it"),
            ("duplicate", [*named[:-1], (named[0][0], named[-1][1])], "unique"),
            ("not_pairs", [p for _, p in named], "tuples"),
        ):
            try:
                hvd.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=bad
                )
                c.expect(f"names.{label}", False, "no error")
            except ValueError as error:
                c.expect(f"names.{label}", text in str(error), error)
        try:
            hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                groups=[[model[0].weight], [model[0].weight, model[0].bias]],
            )
            c.expect("names.groups_twice", False, "no error")
        except ValueError as error:
            c.expect("names.groups_twice", "more than once" in str(error), error)

    def sparse() -> None:
        for label, options in (("allgather", {}), ("as_dense", {"sparse_as_dense": True})):
            torch.manual_seed(0)
            emb = torch.nn.Embedding(10, 4, sparse=True)
            ref_emb = copy.deepcopy(emb)
            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(emb.parameters(), lr=1.0),
                named_parameters=emb.named_parameters(),
                **options,
            )
            ref_opt = torch.optim.SGD(ref_emb.parameters(), lr=1.0)
            ids = torch.arange(4 * n).reshape(n, 4) * 7 % 10
            for _ in range(2):
                opt.zero_grad()
                emb(ids[r]).pow(2).sum().backward()
                opt.step()
                ref_opt.zero_grad()
                (ref_emb(ids).pow(2).sum() / n).backward()
                ref_opt.step()
            c.close(f"sparse.{label}", emb.weight.detach(), ref_emb.weight.detach(), 1e-6)

    def optimizer_state() -> None:
        factories: dict[str, Callable[[list], torch.optim.Optimizer]] = {
            "SGD": lambda p: torch.optim.SGD(p, lr=0.1 * (r + 1), momentum=0.9),
            "Adam": lambda p: torch.optim.Adam(p, lr=0.01 * (r + 1), amsgrad=r == 0),
            "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1 * r),
            "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.01, lr_decay=0.01 * r),
            "Adadelta": lambda p: torch.optim.Adadelta(p, rho=0.9 - 0.1 * r),
            "Adamax": lambda p: torch.optim.Adamax(p, lr=0.01),
            "ASGD": lambda p: torch.optim.ASGD(p, lr=0.01, t0=10.0 + r),
            "NAdam": lambda p: torch.optim.NAdam(p, lr=0.01),
            "RAdam": lambda p: torch.optim.RAdam(p, lr=0.01),
            "RMSprop": lambda p: torch.optim.RMSprop(p, lr=0.01, centered=r == 0),
            "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
        }
        for label, factory in factories.items():
            # A diverged rank: other weights, data, hyper-parameters and step counts.
            model = make_model(r)
            optimizer = factory(list(model.parameters()))
            for step in range(2 + r):
                optimizer.zero_grad()
                x, y = batch(100 * r + step)
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
            root = hvd.broadcast_object(copy.deepcopy(optimizer.state_dict()), root_rank=0)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            restored = optimizer.state_dict()
            c.expect(f"state.{label}.equal_root", states_equal(restored, root), label)
            # From the same state, the same steps keep every rank bit-identical.
            for step in range(2):
                optimizer.zero_grad()
                x, y = batch(500 + step)
                F.cross_entropy(model(x), y).backward()
                optimizer.step()
            c.expect(f"state.{label}.same_after_steps", same_on_all_ranks(flat(model)))
        model = make_model()
        try:
            hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), root_rank=0)
            c.expect("state.lbfgs_raises", False, "no error")
        except ValueError as error:
            c.expect("state.lbfgs_raises", "LBFGS" in str(error), error)
        # Optimizers that differ across ranks: every rank fails alike, naming the difference,
        # and the job goes on.
        for label, build, text in (
            (
                "class",
                lambda m: torch.optim.Adam(m.parameters()) if r == 0 else sgd(m.parameters()),
                "rank 1 has SGD where rank 0 has Adam",
            ),
            (
                "groups",
                lambda m: sgd(list(m.parameters())[: 2 if r == 0 else 1]),
                "rank 1's parameter groups hold [1] parameters where rank 0's hold [2]",
            ),
        ):
            try:
                hvd.broadcast_optimizer_state(build(make_model()), root_rank=0)
                c.expect(f"state.differ.{label}", False, "no error")
            except ValueError as error:
                c.expect(f"state.differ.{label}", text in str(error), error)
        c.expect("state.differ.goes_on", float(hvd.allreduce(torch.ones(1), op=hvd.Sum)) == n)
        # broadcast_parameters takes a list of (name, tensor) pairs as well as a dict.
        model = make_model(r)
        hvd.broadcast_parameters(list(model.named_parameters()), root_rank=n - 1)
        c.close("broadcast_parameters.pairs", flat(model), flat(make_model(n - 1)), 0.0)

    def objects() -> None:
        obj = Payload(f"rank{r}", [float(r)] * (r + 1))
        got = hvd.broadcast_object(obj if r == n - 1 else None, root_rank=n - 1)
        c.expect("objects.broadcast", got == Payload(f"rank{n - 1}", [float(n - 1)] * n), got)
        gathered = hvd.allgather_object({"rank": r, "payload": obj})
        expected = [
            {"rank": i, "payload": Payload(f"rank{i}", [float(i)] * (i + 1))} for i in range(n)
        ]
        c.expect("objects.allgather", gathered == expected, gathered)
        # What the standard pickle cannot send goes through cloudpickle (installed here).
        double = hvd.broadcast_object((lambda v: 2 * v) if r == 0 else None, root_rank=0)
        c.expect("objects.lambda", double(21) == 42)

    def adasum_allreduce() -> None:
        generator = torch.Generator().manual_seed(7 + r)
        shapes = [(5,), (3, 4), (2, 3, 2)]
        every = [
            [torch.randn(s, generator=torch.Generator().manual_seed(7 + k)) for s in shapes]
            for k in range(n)
        ]

        def mine_and_expected(dtype: torch.dtype) -> tuple[list, list, str]:
            expected = [
                reference_adasum([every[k][i].to(dtype) for k in range(n)]).to(dtype)
                for i in range(len(shapes))
            ]
            return [t.to(dtype) for t in every[r]], expected, str(dtype).split(".")[-1]

        for dtype in (torch.float32, torch.float64):
            mine_t, expected, tag = mine_and_expected(dtype)
            out = hvd.allreduce(mine_t[0], op=hvd.Adasum, name=f"adasum.{tag}")
            c.close(f"adasum.allreduce.{tag}", out, expected[0], 1e-5)
            c.expect(f"adasum.allreduce.{tag}.identical", same_on_all_ranks(out))
            grouped = hvd.grouped_allreduce(mine_t, op=hvd.Adasum)
            c.expect(
                f"adasum.grouped.{tag}",
                all(
                    torch.allclose(g, e, rtol=0, atol=1e-5)
                    for g, e in zip(grouped, expected, strict=True)
                ),
            )
            inplace = mine_t[1].clone()
            hvd.synchronize(hvd.allreduce_async_(inplace, op=hvd.Adasum))
            c.close(f"adasum.inplace.{tag}", inplace, expected[1], 1e-5)
        # Vector halving (2 and 4 ranks; 3 gathers): small tensors forced through it, then
        # one large enough to take it by itself at 4 ranks (ops.HALVING_MIN_BYTES).
        threshold, min_ranks = ops.HALVING_MIN_BYTES, ops.HALVING_MIN_RANKS
        ops.HALVING_MIN_BYTES, ops.HALVING_MIN_RANKS = 0, 2
        try:
            for dtype in (torch.float32, torch.float64):
                mine_t, expected, tag = mine_and_expected(dtype)
                grouped = hvd.grouped_allreduce(mine_t, op=hvd.Adasum, postscale_factor=0.5)
                c.expect(
                    f"adasum.halving.grouped.{tag}",
                    all(
                        torch.allclose(g, 0.5 * e, rtol=0, atol=1e-5)
                        for g, e in zip(grouped, expected, strict=True)
                    )
                    and all(same_on_all_ranks(g) for g in grouped),
                )
                inplace = mine_t[2].clone()
                hvd.synchronize(hvd.allreduce_async_(inplace, op=hvd.Adasum))
                c.close(f"adasum.halving.inplace.{tag}", inplace, expected[2], 1e-5)
            # On a process set: the set's own ranks pair up (ranks n-2 and n-1; the global
            # set at 2 ranks).
            pair = hvd.add_process_set([n - 2, n - 1]) if n > 2 else hvd.global_process_set
            if r >= n - 2:
                got = hvd.allreduce(every[r][1], op=hvd.Adasum, process_set=pair)
                want = reference_adasum([every[k][1] for k in (n - 2, n - 1)]).float()
                c.close("adasum.halving.process_set", got, want, 1e-5)
            else:
                c.expect("adasum.halving.process_set", True)
            if n > 2:
                hvd.remove_process_set(pair)
            # Ranks that disagree on the tensor, rank 0 taking the halving and the others
            # the gathering way (at 3 ranks both gather): the allreduce's mismatch error.
            ops.HALVING_MIN_BYTES = (n - 1) * 4 * 75
            try:
                odd = torch.ones(100 if r == 0 else 50)
                hvd.allreduce(odd, op=hvd.Adasum, name="adasum.odd")
                c.expect("adasum.halving.mismatch", False, "no error")
            except hvd.TensorMismatchError as error:
                c.expect("adasum.halving.mismatch", "'adasum.odd' (op=Adasum)" in str(error), error)
        finally:
            ops.HALVING_MIN_BYTES, ops.HALVING_MIN_RANKS = threshold, min_ranks
        numel, ranks = -(-threshold // (4 * max(n - 1, 1))), range(n)
        big = [torch.randn(numel, generator=torch.Generator().manual_seed(70 + k)) for k in ranks]
        c.expect("adasum.halving.chosen", ops.by_halving(n, big[:1]) == (n == 4), n)
        out = hvd.allreduce(big[r], op=hvd.Adasum, name="adasum.big")
        c.close("adasum.halving.big", out, reference_adasum(big).float(), 1e-4)
        c.expect("adasum.halving.big.identical", same_on_all_ranks(out))
        # Parallel gradients are averaged, orthogonal ones summed (the defining property).
        same = hvd.allreduce(torch.tensor([1.0, 2.0, 3.0]), op=hvd.Adasum)
        c.close("adasum.parallel_averaged", same, torch.tensor([1.0, 2.0, 3.0]), 1e-6)
        if n == 2:
            orth = hvd.allreduce(torch.eye(2)[r], op=hvd.Adasum)
            c.close("adasum.orthogonal_summed", orth, torch.ones(2), 1e-6)
        half = hvd.allreduce(torch.randn(8, generator=generator).half(), op=hvd.Adasum)
        c.expect("adasum.half.identical", half.dtype == torch.float16 and same_on_all_ranks(half))
        try:
            hvd.allreduce(torch.ones(2, dtype=torch.int64), op=hvd.Adasum)
            c.expect("adasum.int_raises", False, "no error")
        except TypeError as error:
            c.expect("adasum.int_raises", "floating-point" in str(error), error)

    def adasum_optimizer() -> None:
        def adam_eps(params: list) -> torch.optim.Optimizer:
            # Adam's first steps are about lr * sign(gradient): with the default eps, float32
            # rounding in components near zero flips whole steps (the reference is float64).
            return torch.optim.Adam(params, lr=0.01, eps=1e-3)

        fp16 = {"compression": hvd.Compression.fp16}
        for label, factory, options, atol in (
            ("sgd", sgd, {}, 1e-5),
            ("adam", adam_eps, {}, 1e-5),
            ("sgd.fp16", sgd, fp16, 1e-3),
        ):
            model = make_model()
            opt = hvd.DistributedOptimizer(
                factory(list(model.parameters())),
                named_parameters=model.named_parameters(),
                op=hvd.Adasum,
                **options,
            )
            # The reference: every rank's own optimizer steps on its own slice from the
            # shared parameters; the parameters' changes combine with Adasum.
            shared = make_model()
            sims = [make_model() for _ in range(n)]
            sim_opts = [factory(list(m.parameters())) for m in sims]
            worst = 0.0
            for step in range(5):
                x, y = batch(step)
                deltas = []
                for k, (sim, sim_opt) in enumerate(zip(sims, sim_opts, strict=True)):
                    sim.load_state_dict(shared.state_dict())
                    sim_opt.zero_grad()
                    part = slice(k * rows, (k + 1) * rows)
                    F.cross_entropy(sim(x[part]), y[part]).backward()
                    sim_opt.step()
                    deltas.append(
                        [
                            a.detach() - b.detach()
                            for a, b in zip(sim.parameters(), shared.parameters(), strict=True)
                        ]
                    )
                with torch.no_grad():
                    for i, param in enumerate(shared.parameters()):
                        param.add_(reference_adasum([d[i] for d in deltas]).float())
                opt.zero_grad()
                F.cross_entropy(model(x[mine]), y[mine]).backward()
                opt.step()
                worst = max(worst, max_diff(model, shared))
            c.expect(f"adasum.optimizer.{label}", worst <= atol, f"max difference {worst:g}")
            c.expect(f"adasum.optimizer.{label}.identical", same_on_all_ranks(flat(model)))

    def sync_batch_norm() -> None:
        # Uneven slices: rank k holds k + 2 samples.
        sizes = [k + 2 for k in range(n)]
        start = sum(sizes[:r])
        part = slice(start, start + sizes[r])
        for label, shape, reference_type in (
            ("1d", (6,), torch.nn.BatchNorm1d),
            ("2d", (3, 4, 5), torch.nn.BatchNorm2d),
        ):
            channels = shape[0]
            torch.manual_seed(3)
            reference = reference_type(channels)
            with torch.no_grad():
                reference.weight.uniform_(0.5, 1.5)
                reference.bias.uniform_(-0.5, 0.5)
            sync = hvd.SyncBatchNorm(channels)
            sync.load_state_dict(reference.state_dict())
            worst_out = worst_grad = worst_param = 0.0
            for step in range(3):
                generator = torch.Generator().manual_seed(50 + step)
                x = torch.randn(sum(sizes), *shape, generator=generator) * 2 + 1
                upstream = torch.randn(sum(sizes), *shape, generator=generator)
                x_ref = x.clone().requires_grad_()
                x_mine = x[part].clone().requires_grad_()
                reference.zero_grad()
                sync.zero_grad()
                out_ref = reference(x_ref)
                out = sync(x_mine)
                (out_ref * upstream).sum().backward()
                (out * upstream[part]).sum().backward()
                worst_out = max(worst_out, (out - out_ref[part]).abs().max().item())
                assert x_mine.grad is not None and x_ref.grad is not None
                worst_grad = max(worst_grad, (x_mine.grad - x_ref.grad[part]).abs().max().item())
                for mine_p, ref_p in zip(sync.parameters(), reference.parameters(), strict=True):
                    total = hvd.allreduce(mine_p.grad, op=hvd.Sum)
                    worst_param = max(worst_param, (total - ref_p.grad).abs().max().item())
            c.expect(f"syncbn.{label}.output", worst_out <= 1e-5, worst_out)
            c.expect(f"syncbn.{label}.input_grad", worst_grad <= 1e-5, worst_grad)
            c.expect(f"syncbn.{label}.param_grad", worst_param <= 1e-4, worst_param)
            c.close(f"syncbn.{label}.running_mean", sync.running_mean, reference.running_mean, 1e-5)
            c.close(f"syncbn.{label}.running_var", sync.running_var, reference.running_var, 1e-5)
            c.expect(
                f"syncbn.{label}.batches_tracked",
                int(sync.num_batches_tracked) == int(reference.num_batches_tracked) == 3,
            )
            # Eval mode: the running statistics, no communication (rank-local inputs).
            sync.eval()
            reference.eval()
            x = torch.randn(r + 1, *shape)
            c.close(f"syncbn.{label}.eval", sync(x).detach(), reference(x).detach(), 1e-5)

    def bursts() -> None:
        # A loop's repeated burst of small named gradients (24 x 1000 random float32, too
        # many for a cache round): once the cache predicts it (the same ops round after
        # round), it is one allreduce of the burst. Sums that rounding makes order-dependent
        # still come out bit-identical on every rank, and within float32 rounding of the
        # float64 sum.
        from collectives import runtime

        before = runtime.engine().stats["predicted_rounds"]
        sent, results = [], []
        # (Enough steps to outlast a backoff to full negotiations left by earlier checks.)
        for step in range(24):
            seed = torch.Generator().manual_seed(1000 * step + r)
            grads = [torch.randn(1000, generator=seed) * 10.0**k for k in range(-12, 12)]
            handles = [hvd.allreduce_async(g, name=f"burst.{k}") for k, g in enumerate(grads)]
            results.append(torch.cat([hvd.synchronize(handle) for handle in handles]))
            sent.append(torch.cat(grads))
        predicted = runtime.engine().stats["predicted_rounds"] - before
        for step, (mine, result) in enumerate(zip(sent, results, strict=True)):
            parts = hvd.allgather(mine.double().reshape(1, -1))
            reference, scale = parts.sum(0) / n, parts.abs().sum(0) / n
            c.expect(f"burst.{step}.identical", same_on_all_ranks(result))
            worst = float(((result.double() - reference).abs() / scale).max())
            c.expect(f"burst.{step}.close", worst <= 1e-6, worst)
        c.expect("burst.predicted", predicted >= 3, predicted)

    c.run("equivalence", equivalence)
    c.run("bursts", bursts)
    c.run("hooks", hooks)
    c.run("dynamic_graphs", dynamic_graphs)
    c.run("added_group", added_group)
    c.run("closures", closures)
    c.run("name_errors", name_errors)
    c.run("sparse", sparse)
    c.run("optimizer_state", optimizer_state)
    c.run("objects", objects)
    c.run("adasum_allreduce", adasum_allreduce)
    c.run("adasum_optimizer", adasum_optimizer)
    c.run("sync_batch_norm", sync_batch_norm)
    hvd.shutdown()
    c.finish(r)


if __name__ == "__main__":
    main()
