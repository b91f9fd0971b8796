"""How DistributedOptimizer groups gradients into buckets (no processes needed)."""

from __future__ import annotations

import torch

from collectives.torch.optim.gradient_buckets import (
    BUCKET_BYTES,
    FIRST_BUCKET_BYTES,
    parameter_names,
    plan_buckets,
)


def _named(
    *sizes: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> dict[torch.Tensor, str]:
    return {torch.zeros(size, dtype=dtype, device=device): f"p{i}" for i, size in enumerate(sizes)}


def _plan(names: dict[torch.Tensor, str], groups: object = None) -> list[list[str]]:
    return [
        [names[p] for p in bucket.params] for bucket in plan_buckets(list(names), names, groups)
    ]


def test_default_buckets_follow_backward_order_and_close_at_the_cap() -> None:
    floats = BUCKET_BYTES // 4
    names = _named(10, floats, 3, floats, 5, 7)
    # Reverse order; on the CPU every bucket closes once it reaches 25 MB.
    assert _plan(names) == [["p5", "p4", "p3"], ["p2", "p1"], ["p0"]]
    buckets = plan_buckets(list(names), names, None)
    assert [b.name for b in buckets] == ["p5+2", "p2+1", "p0"]
    small = _named(4, 4, 4)
    assert _plan(small) == [["p2", "p1", "p0"]]


def test_accelerator_buckets_start_small() -> None:
    # Off the CPU (here: meta tensors) the first bucket closes at 1 MB, so that
    # communication starts early in backward; the next ones at 25 MB.
    names = _named(10, FIRST_BUCKET_BYTES // 4, 3, BUCKET_BYTES // 4, 5, 7, device="meta")
    assert _plan(names) == [["p5", "p4", "p3"], ["p2", "p1", "p0"]]


def test_a_new_dtype_starts_a_new_bucket() -> None:
    names = {**_named(4), torch.zeros(4, dtype=torch.float64): "d", torch.zeros(2): "f"}
    assert _plan(names) == [["f"], ["d"], ["p0"]]


def test_horovod_groups() -> None:
    names = _named(1, 2, 3, 4, 5)
    params = list(names)
    assert _plan(names, 2) == [["p0", "p1"], ["p2", "p3", "p4"]]
    assert _plan(names, 9) == [[n] for n in ("p0", "p1", "p2", "p3", "p4")]
    assert _plan(names, [[params[3], params[0]]]) == [["p3", "p0"], ["p1"], ["p2"], ["p4"]]
    assert plan_buckets(params, names, [[params[1]]])[0].name == "p1"


def test_a_tied_weight_listed_under_two_names_keeps_one_name() -> None:
    """named_parameters(remove_duplicate=False) lists a tied weight under each of its
    names: accepted, as by Horovod, and every rank picks the same name (the last in sorted
    order), so that the gradient is reduced once under one name."""
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight  # tied
    named = list(model.named_parameters(remove_duplicate=False))
    assert [name for name, _ in named] == ["0.weight", "1.weight"]
    groups = [{"params": list(model.parameters())}]
    assert parameter_names(named, groups, groups[0]["params"]) == {model[0].weight: "1.weight"}
    assert parameter_names(named[::-1], groups, groups[0]["params"]) == {
        model[0].weight: "1.weight"
    }
