"""Worker for ranks whose models differ, on 2 ranks (see test_parameter_mismatch.py).

The classic mistake, ``torch.nn.Linear(3, 3 + hvd.rank())``: a ``DistributedOptimizer``
step and ``broadcast_parameters`` must fail on both ranks with a ``TensorMismatchError`` that
keeps the engine's words (the fused buffer's shapes, "tensor 0") and names the parameters
that differ with each rank's shape, dtype or ``requires_grad``; each check is followed by
ops that must run (the job stays usable). Ranks that disagree on something other than their
tensors (a broadcast's root) get the engine's message unchanged, and
``broadcast_optimizer_state`` names the parameters whose shapes differ.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from checks import Checks

import collectives.torch as hvd

#: What the messages say of Linear(3, 3) on rank 0 and Linear(3, 4) on rank 1.
WEIGHT = "'weight' has shape [3, 3] on rank 0, [4, 3] on rank 1"
BIAS = "'bias' has shape [3] on rank 0, [4] on rank 1"


def raised(body: Callable[[], Any]) -> BaseException | None:
    try:
        body()
    except Exception as error:
        return error
    return None


def expect_mismatch(
    c: Checks, name: str, error: BaseException | None, engine: str, *parts: str
) -> None:
    """A TensorMismatchError (the very class, not a new one) that keeps the engine's
    ``engine`` words and says each of ``parts``."""
    text = str(error)
    c.expect(f"{name}.class", type(error) is hvd.TensorMismatchError, repr(error))
    c.expect(f"{name}.engine_words", engine in text, text)
    for index, part in enumerate(parts):
        c.expect(f"{name}.names.{index}", part in text, text)


def still_usable(c: Checks, name: str) -> None:
    """A step of a DistributedOptimizer over models alike on both ranks runs and averages."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters()
    )
    optimizer.zero_grad()
    (model(torch.ones(1, 3)).sum() * (hvd.rank() + 1)).backward()
    optimizer.step()
    assert model.bias.grad is not None
    c.equal(f"{name}.usable_after", model.bias.grad, torch.full((2,), 1.5))


def optimizer_step(c: Checks, r: int) -> None:
    # The default plan: one bucket, one flat tensor of both gradients ([12] and [16]).
    model = torch.nn.Linear(3, 3 + r)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    optimizer.zero_grad()
    model(torch.ones(2, 3)).sum().backward()
    error = raised(optimizer.step)
    engine = "allreduce 'bias+1': ranks disagree on the shape: rank 0: [12]; rank 1: [16]"
    expect_mismatch(c, "optimizer.flat", error, engine, "2 parameters", BIAS, WEIGHT)
    optimizer.zero_grad()  # (the failed step is forgotten)
    still_usable(c, "optimizer.flat")


def optimizer_grouped(c: Checks, r: int) -> None:
    # Compressed: the gradients travel as a grouped op of two tensors ("tensor 0").
    model = torch.nn.Linear(3, 3 + r)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16,
    )
    model(torch.ones(2, 3)).sum().backward()
    error = raised(optimizer.step)
    engine = "ranks disagree on the shape of tensor 0: rank 0: [3]; rank 1: [4]"
    expect_mismatch(c, "optimizer.grouped", error, engine, BIAS, WEIGHT)
    still_usable(c, "optimizer.grouped")


def optimizer_dtype_and_frozen(c: Checks, r: int) -> None:
    # Rank 1's model is float64; then rank 1 freezes a bias that rank 0 trains.
    model = torch.nn.Linear(3, 3, dtype=torch.float64 if r else torch.float32)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    model(torch.ones(2, 3, dtype=model.weight.dtype)).sum().backward()
    error = raised(optimizer.step)
    dtype = "'weight' has dtype float32 on rank 0, float64 on rank 1"
    expect_mismatch(c, "optimizer.dtype", error, "ranks disagree on the dtype", dtype)
    model = torch.nn.Linear(3, 3)
    model.bias.requires_grad_(r == 0)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    model(torch.ones(2, 3)).sum().backward()
    error = raised(optimizer.step)
    frozen = "'bias' has requires_grad True on rank 0, False on rank 1"
    expect_mismatch(c, "optimizer.frozen", error, "allreduce 'bias+1'", frozen)
    c.expect("optimizer.frozen.only_it", "'weight'" not in str(error), str(error))
    still_usable(c, "optimizer.frozen")


def broadcast(c: Checks, r: int) -> None:
    model = torch.nn.Linear(3, 3 + r)
    # A state_dict: sorted by name, so tensor 0 is the bias.
    error = raised(lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=0))
    engine = "broadcast 'broadcast_parameters': ranks disagree on the shape of tensor 0: "
    engine += "rank 0: [3]; rank 1: [4]"
    expect_mismatch(c, "broadcast.state_dict", error, engine, "2 tensors", BIAS, WEIGHT)
    # A list of tensors: named by their places.
    error = raised(lambda: hvd.broadcast_parameters(list(model.parameters()), root_rank=0))
    places = ("tensor 0 has shape [3, 3] on rank 0, [4, 3] on rank 1", "tensor 1 has shape")
    expect_mismatch(c, "broadcast.list", error, "of tensor 0", *places)
    # Only one parameter of many differs: only it is named.
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2 + r))
    error = raised(lambda: hvd.broadcast_parameters(layers.state_dict(), root_rank=0))
    one = "'1.weight' has shape [2, 5] on rank 0, [3, 5] on rank 1"
    expect_mismatch(c, "broadcast.one", error, "ranks disagree on the shape", one)
    c.expect("broadcast.one.only_them", "'0.weight'" not in str(error), str(error))
    # Alike models: the broadcast runs.
    torch.manual_seed(r)
    same = torch.nn.Linear(3, 2)
    hvd.broadcast_parameters(same.state_dict(), root_rank=0)
    torch.manual_seed(0)
    c.equal("broadcast.usable_after", same.weight.detach(), torch.nn.Linear(3, 2).weight.detach())


def broadcast_roots(c: Checks, r: int) -> None:
    # The ranks disagree on the root, not on their tensors: the engine's words alone.
    model = torch.nn.Linear(3, 3)
    error = raised(lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=r))
    text = str(error)
    c.expect("roots.class", type(error) is hvd.TensorMismatchError, repr(error))
    c.expect("roots.unchanged", "root" in text and "differ between" not in text, text)


def optimizer_state(c: Checks, r: int) -> None:
    model = torch.nn.Linear(3, 3 + r)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters()
    )
    error = raised(lambda: hvd.broadcast_optimizer_state(optimizer, root_rank=0))
    text = str(error)
    said = "rank 1's parameter 'weight' (0 of group 0) has shape [4, 3] where rank 0's has [3, 3]"
    c.expect("optimizer_state.names", isinstance(error, ValueError) and said in text, text)
    plain = torch.optim.Adam(model.parameters())
    error = raised(lambda: hvd.broadcast_optimizer_state(plain, root_rank=0, model=model))
    c.expect("optimizer_state.model_names", said in str(error), str(error))


def main() -> None:
    torch.set_num_threads(1)
    # A hang (a rank that skipped the explanation's allgather) must fail, not wait forever.
    watchdog = threading.Timer(120, lambda: os._exit(3))
    watchdog.daemon = True
    watchdog.start()
    c = Checks()
    hvd.init()
    r = hvd.rank()
    for check in (
        optimizer_step,
        optimizer_grouped,
        optimizer_dtype_and_frozen,
        broadcast,
        broadcast_roots,
        optimizer_state,
    ):
        c.run(check.__name__, lambda check=check: check(c, r))
    hvd.shutdown()
    c.finish(r)
    os._exit(0)


if __name__ == "__main__":
    main()
