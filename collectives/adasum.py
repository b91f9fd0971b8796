"""Adasum, the adaptive summation of gradients described in Horovod's documentation.

Two gradients combine as ``(1 - g1.g2 / (2|g1|^2)) g1 + (1 - g1.g2 / (2|g2|^2)) g2``: parallel
gradients are averaged, orthogonal ones summed. Over a job the combination is applied
pairwise in a binary tree over the ranks in rank order - ranks (0,1), (2,3), ... first, then
the pairs' results, and so on; with a rank count that is not a power of two a node without a
partner is carried up unchanged. Each tensor is combined on its own (its own dot products).

Two ways to evaluate that tree, both giving every rank bit-identical results:

* gathering: every rank gathers all ranks' tensors and evaluates the whole tree
  (:func:`adasum_tree`). One collective, but ``size`` times the tensors' memory and
  ``size - 1`` pair combinations of the whole tensors on every rank.
* vector halving, for a power-of-two number of ranks: at level ``l`` each rank pairs with
  the rank ``2**l`` away, the two swap halves of the range they hold, and each combines the
  two blocks' vectors on its half (:func:`halving_ranges`, :func:`partial_dots`,
  :func:`combine_range`). The dot products of a pair of blocks are summed over every rank of
  the two blocks (one small allreduce per level); at the end each rank holds ``1/size`` of
  the result, and an allgather hands every rank the whole. About twice the tensors'
  size sent per rank whatever the rank count, the memory of about two copies, one
  combination's work.
  Results equal the gathering way's up to the order of the dot products' sums.

This module is the math only, a leaf: :func:`collectives.ops.submit_adasum_allreduce` runs an
allreduce with ``op=hvd.Adasum`` either way, and the Adasum optimizer
(:mod:`collectives.torch.optim.adasum_optimizer`) submits through it.
"""

from __future__ import annotations

import torch

__all__ = [
    "adasum_pair",
    "adasum_tree",
    "combine_range",
    "halving_ranges",
    "partial_dots",
    "work_dtype",
]


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Adasum of two gradients of the same shape (computed in a precision >= float32)."""
    dot = torch.dot(a.flatten(), b.flatten())
    a_sq = torch.dot(a.flatten(), a.flatten())
    b_sq = torch.dot(b.flatten(), b.flatten())
    # A zero gradient contributes nothing; its coefficient is irrelevant, keep it finite.
    # (torch.where, not a Python test of ``a_sq > 0``: that would read the value on the
    # host, which for a CUDA tensor waits for the GPU twice per pair.)
    a_coef = torch.where(a_sq > 0, 1 - dot / (2 * a_sq), 1.0)
    b_coef = torch.where(b_sq > 0, 1 - dot / (2 * b_sq), 1.0)
    return a_coef * a + b_coef * b


def adasum_tree(per_rank: list[torch.Tensor], scale: float = 1.0) -> torch.Tensor:
    """Combines one tensor from every rank (index = rank) with Adasum's pairwise tree, times
    ``scale`` (applied before the result returns to the inputs' dtype)."""
    if not per_rank:
        raise ValueError("adasum_tree needs at least one tensor")
    dtype = per_rank[0].dtype
    work = work_dtype([dtype])
    level = [t.to(work) for t in per_rank]
    while len(level) > 1:
        nxt = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    result = level[0] if scale == 1.0 else level[0] * scale
    return result.to(dtype)


def work_dtype(dtypes: list[torch.dtype]) -> torch.dtype:
    """The precision Adasum computes in: float64 for float64 tensors, else float32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def halving_ranges(length: int, size: int, index: int) -> list[tuple[int, int, int, int]]:
    """Vector halving of a flat vector of ``length`` elements over ``size`` ranks (a power of
    two): for each level, ``(lo, hi, keep_lo, keep_hi)``: the range rank ``index`` holds
    before the level (the same as its partner's, ``index ^ 2**level``) and the half it keeps
    (the rank whose bit ``level`` is 0 the first half). The last half kept is the part of the
    result the rank computes."""
    ranges = []
    lo, hi, distance = 0, length, 1
    while distance < size:
        mid = lo + (hi - lo) // 2
        keep = (mid, hi) if index & distance else (lo, mid)
        ranges.append((lo, hi, *keep))
        lo, hi = keep
        distance *= 2
    return ranges


def _overlaps(bounds: list[int], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``(tensor, start, end)`` of each tensor's part within ``[lo, hi)``, relative to
    ``lo``; ``bounds``: the tensors' offsets in the flat vector, and its length last."""
    found = []
    for tensor in range(len(bounds) - 1):
        start, end = max(bounds[tensor], lo), min(bounds[tensor + 1], hi)
        if start < end:
            found.append((tensor, start - lo, end - lo))
    return found


def partial_dots(a: torch.Tensor, b: torch.Tensor, bounds: list[int], lo: int) -> torch.Tensor:
    """Per tensor, ``[a.b, a.a, b.b]`` over the part of the flat vector that ``a`` and ``b``
    (two blocks' vectors on the range starting at ``lo``) cover: a ``(tensors, 3)`` tensor."""
    dots = torch.zeros(len(bounds) - 1, 3, dtype=a.dtype, device=a.device)
    for tensor, start, end in _overlaps(bounds, lo, lo + a.numel()):
        x, y = a[start:end], b[start:end]
        dots[tensor] = torch.stack((torch.dot(x, y), torch.dot(x, x), torch.dot(y, y)))
    return dots


def combine_range(
    a: torch.Tensor, b: torch.Tensor, dots: torch.Tensor, bounds: list[int], lo: int
) -> torch.Tensor:
    """:func:`adasum_pair` of two blocks' vectors on the range starting at ``lo``, each
    tensor's part with the coefficients of that tensor's whole dot products ``dots``."""
    ab, aa, bb = dots.unbind(1)
    a_coef = torch.where(aa > 0, 1 - ab / (2 * aa), 1.0)
    b_coef = torch.where(bb > 0, 1 - ab / (2 * bb), 1.0)
    out = torch.empty_like(a)
    for tensor, start, end in _overlaps(bounds, lo, lo + a.numel()):
        torch.mul(a[start:end], a_coef[tensor], out=out[start:end])
        out[start:end].add_(b[start:end] * b_coef[tensor])
    return out
