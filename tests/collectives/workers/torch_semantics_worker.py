"""Worker for the 2-rank job of issue 28: Horovod's broadcast_optimizer_state on optimizers
without state (its dummy step), and DistributedOptimizer under torch.compile.

argv[1]: "state", "compile" or "all" (which groups of checks to run).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks, states_equal

import collectives.torch as hvd

STEPS = 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 4, generator=generator), torch.randn(6, 2, generator=generator)


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def main() -> None:
    torch.set_num_threads(1)
    groups = sys.argv[1]
    c = Checks()
    hvd.init()
    r, size = hvd.rank(), hvd.size()

    def same_everywhere(name: str, state: dict) -> None:
        gathered = hvd.allgather_object(state)
        c.expect(name, all(states_equal(gathered[0], s) for s in gathered))

    def dummy_step() -> None:
        factories = {
            # Weight decay: a zero gradient still moves the parameters in a real step.
            "adam": lambda p: torch.optim.Adam(p, lr=0.1 * (r + 1), weight_decay=0.1),
            "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1),
            "wrapped": lambda p: hvd.DistributedOptimizer(torch.optim.Adam(p, lr=0.1)),
            # Adasum's step() does not step the wrapped optimizer: state shows it was.
            "adasum": lambda p: hvd.DistributedOptimizer(
                torch.optim.SGD(p, lr=0.1, momentum=0.9), op=hvd.Adasum
            ),
        }
        for label, factory in factories.items():
            model = make_model()
            model[2].bias.requires_grad_(False)  # frozen: no gradient, no state
            optimizer = factory(list(model.parameters()))
            before = snapshot(model)
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            trainable = [p for p in model.parameters() if p.requires_grad]
            c.expect(
                f"dummy.{label}.zero_grads",
                all(
                    p.grad is not None and p.grad.shape == p.shape and not p.grad.any()
                    for p in trainable
                ),
                [p.grad for p in trainable],
            )
            c.expect(f"dummy.{label}.frozen_no_grad", model[2].bias.grad is None)
            c.expect(
                f"dummy.{label}.params_unchanged",
                all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)),
            )
            state = optimizer.state_dict()
            c.expect(f"dummy.{label}.state_per_trainable", sorted(state["state"]) == [0, 1, 2])
            if label == "adam":
                steps = [float(s["step"]) for s in optimizer.state.values()]
                c.expect("dummy.adam.one_step", steps == [1.0] * 3, steps)
                c.expect("dummy.adam.root_lr", optimizer.param_groups[0]["lr"] == 0.1)
            same_everywhere(f"dummy.{label}.state_equal", state)
        # Sparse gradients where Horovod makes them sparse.
        emb = torch.nn.Embedding(5, 3, sparse=True)
        hvd.broadcast_optimizer_state(torch.optim.SparseAdam(emb.parameters()), root_rank=0)
        grad = emb.weight.grad
        c.expect("dummy.sparse_adam", grad is not None and grad.is_sparse and grad._nnz() == 0)
        emb = torch.nn.Embedding(5, 3, sparse=True)
        model = torch.nn.Sequential(emb)
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # stateless: grads only
        hvd.broadcast_optimizer_state(sgd, root_rank=0, model=model)
        grad = emb.weight.grad
        c.expect("dummy.sgd_sparse_embedding", grad is not None and grad.is_sparse)
        # SGD with momentum on a sparse embedding keeps sparse state: it travels dense and
        # every rank gets the root's, sparse again (each rank's own step made it differ).
        emb = torch.nn.Embedding(4, 2, sparse=True)
        with torch.no_grad():
            emb.weight.fill_(1.0)
        sgd = torch.optim.SGD(emb.parameters(), lr=0.1, momentum=0.9)
        emb(torch.tensor([r, 2])).sum().backward()
        sgd.step()
        hvd.broadcast_optimizer_state(sgd, root_rank=0)
        buf = sgd.state[emb.weight]["momentum_buffer"]
        dense = buf.to_dense() if buf.is_sparse else buf
        want = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]])
        c.expect("state.sparse_momentum", buf.is_sparse and torch.equal(dense, want), dense)
        # A rank with state takes no dummy step: its gradients stay as they were. The other
        # rank's dummy step must not be the DistributedOptimizer's (it would allreduce alone).
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
        if r == 0:
            F.mse_loss(model(batch(0, 0)[0]), batch(0, 0)[1]).backward()
            optimizer.step()
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        if r == 0:
            c.expect(
                "dummy.stateful_root_untouched",
                all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters(), strict=True)),
            )
        same_everywhere("dummy.fresh_rank_gets_root_state", optimizer.state_dict())

    def compiled_training(variant: str) -> None:
        """``model``: torch.compile(model); ``step``: a compiled training step whose backward
        and optimizer step run outside the graph (torch.compiler.disable), the recipe of
        docs/migrating.md for compiling whole steps."""
        reference = make_model()
        model = make_model()
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
        )

        @torch.compiler.disable
        def backward_and_step(loss: torch.Tensor) -> None:
            loss.backward()
            optimizer.step()

        def whole_step(x: torch.Tensor, y: torch.Tensor) -> None:
            optimizer.zero_grad()
            backward_and_step(F.mse_loss(model(x), y))

        compiled_model = torch.compile(model)
        compiled_step = torch.compile(whole_step)
        plain = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step in range(STEPS):
            x, y = batch(r, step)
            if variant == "model":
                optimizer.zero_grad()
                F.mse_loss(compiled_model(x), y).backward()
                optimizer.step()
            else:
                compiled_step(x, y)
            # The reference: the same step in one process, gradients averaged over the ranks.
            plain.zero_grad()
            for rank in range(size):
                x, y = batch(rank, step)
                (F.mse_loss(reference(x), y) / size).backward()
            plain.step()
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        rows = hvd.allgather(flat.unsqueeze(0))
        c.expect(f"compile.{variant}.ranks_identical", all(torch.equal(rows[0], x) for x in rows))
        expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
        c.close(f"compile.{variant}.matches_single_process", flat, expected, atol=1e-5)
        initial = torch.cat([p.detach().reshape(-1) for p in make_model().parameters()])
        c.expect(f"compile.{variant}.trained", not torch.allclose(flat, initial, atol=1e-3))

    if groups in ("state", "all"):
        c.run("dummy_step", dummy_step)
    if groups in ("compile", "all"):
        c.run("compile.model", lambda: compiled_training("model"))
        if os.environ.get("COMPILE_STEP", "1") == "1":
            c.run("compile.step", lambda: compiled_training("step"))
    c.finish(r)


if __name__ == "__main__":
    main()
