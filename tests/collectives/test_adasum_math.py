"""Adasum's combination rule and tree order, against a direct formula (no processes)."""

import torch

from collectives.adasum import adasum_pair, adasum_tree


def reference_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a64, b64 = a.double().flatten(), b.double().flatten()
    dot = float(a64 @ b64)
    out = (1 - dot / (2 * float(a64 @ a64))) * a64 + (1 - dot / (2 * float(b64 @ b64))) * b64
    return out.view(a.shape)


def test_parallel_gradients_average_and_orthogonal_ones_add() -> None:
    a = torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(adasum_pair(a, a), a)
    assert torch.allclose(adasum_pair(a, 3 * a), 2 * a)  # (1-3/2)a + (1-1/6)3a = 2a
    x, y = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 5.0])
    assert torch.equal(adasum_pair(x, y), x + y)


def test_pair_matches_formula_and_handles_zero() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 3, generator=gen), torch.randn(4, 3, generator=gen)
    assert torch.allclose(adasum_pair(a, b).double(), reference_pair(a, b), atol=1e-6)
    zero = torch.zeros(4, 3)
    assert torch.equal(adasum_pair(zero, b), b)


def test_tree_order_for_two_three_and_four_ranks() -> None:
    gen = torch.Generator().manual_seed(1)
    g = [torch.randn(7, generator=gen, dtype=torch.float64) for _ in range(4)]
    assert torch.allclose(adasum_tree(g[:2]), reference_pair(g[0], g[1]))
    three = reference_pair(reference_pair(g[0], g[1]), g[2])
    assert torch.allclose(adasum_tree(g[:3]), three)
    four = reference_pair(reference_pair(g[0], g[1]), reference_pair(g[2], g[3]))
    assert torch.allclose(adasum_tree(g), four)
    assert torch.equal(adasum_tree(g[:1]), g[0])


def test_keeps_dtype() -> None:
    halves = [torch.ones(3, dtype=torch.float16), torch.ones(3, dtype=torch.float16)]
    assert adasum_tree(halves).dtype == torch.float16


def test_never_reads_a_value_on_the_host() -> None:
    # On a CUDA tensor a read on the host (``if a_sq > 0``) waits for the GPU; meta tensors
    # have no values at all, so any such read raises here.
    a, b = torch.ones(5, device="meta"), torch.ones(5, device="meta")
    assert adasum_tree([a, b, a]).shape == (5,)
    zero = torch.zeros(3)
    assert torch.equal(adasum_pair(zero, zero), zero)
