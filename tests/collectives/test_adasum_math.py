"""Adasum's combination rule and tree order, against a direct formula (no processes)."""

import itertools

import torch

from collectives.adasum import adasum_pair, adasum_tree, combine_range, halving_ranges, partial_dots


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


def halving_in_one_process(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Vector halving over len(per_rank) simulated ranks (each a list of tensors), with the
    exchanges and the dot products' sums done here as the engine's collectives would."""
    size = len(per_rank)
    shapes = [t.shape for t in per_rank[0]]
    bounds = [0]
    for t in per_rank[0]:
        bounds.append(bounds[-1] + t.numel())
    held = [torch.cat([t.reshape(-1) for t in tensors]).double() for tensors in per_rank]
    plans = [halving_ranges(bounds[-1], size, index) for index in range(size)]
    for level in range(size.bit_length() - 1):
        distance = 1 << level
        pairs = []
        for index in range(size):
            lo, _, keep_lo, keep_hi = plans[index][level]
            partner = index ^ distance
            mine = held[index][keep_lo - lo : keep_hi - lo]
            theirs = held[partner][keep_lo - lo : keep_hi - lo]
            a, b = (theirs, mine) if index & distance else (mine, theirs)
            pairs.append((a, b, keep_lo))
        sums: dict[int, torch.Tensor] = {}
        for index, (a, b, keep_lo) in enumerate(pairs):
            block = index >> (level + 1)
            sums[block] = sums.get(block, 0) + partial_dots(a, b, bounds, keep_lo)
        held = [
            combine_range(a, b, sums[index >> (level + 1)], bounds, keep_lo)
            for index, (a, b, keep_lo) in enumerate(pairs)
        ]
    whole = torch.empty(bounds[-1], dtype=torch.float64)
    for index in range(size):
        _, _, keep_lo, keep_hi = plans[index][-1]
        whole[keep_lo:keep_hi] = held[index]
    return [whole[bounds[i] : bounds[i + 1]].view(shapes[i]) for i in range(len(shapes))]


def test_vector_halving_gives_the_trees_result_for_each_tensor() -> None:
    # Three tensors of odd sizes, so halves cut through tensors and some ranks hold no part
    # of the smallest one; a zero gradient on one rank; 2, 4 and 8 ranks.
    gen = torch.Generator().manual_seed(2)
    for size in (2, 4, 8):
        per_rank = [
            [torch.randn(5, 3, generator=gen), torch.randn(2, generator=gen),
             torch.randn(11, generator=gen)]
            for _ in range(size)
        ]  # fmt: skip
        per_rank[1][0] = torch.zeros(5, 3)
        got = halving_in_one_process(per_rank)
        for i in range(3):
            want = adasum_tree([tensors[i].double() for tensors in per_rank])
            assert torch.allclose(got[i], want, atol=1e-12), (size, i)


def test_halving_ranges_split_the_vector_among_the_ranks() -> None:
    for length, size in ((10, 4), (3, 4), (1000, 8), (7, 2)):
        finals = sorted(halving_ranges(length, size, index)[-1][2:] for index in range(size))
        assert finals[0][0] == 0 and finals[-1][1] == length
        assert all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(finals))
        assert max(hi - lo for lo, hi in finals) <= -(-length // size)
