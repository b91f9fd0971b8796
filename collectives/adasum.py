"""Adasum, the adaptive summation of gradients described in Horovod's documentation.

Two gradients combine as ``(1 - g1.g2 / (2|g1|^2)) g1 + (1 - g1.g2 / (2|g2|^2)) g2``: parallel
gradients are averaged, orthogonal ones summed. Over a job the combination is applied
pairwise in a binary tree over the ranks in rank order - ranks (0,1), (2,3), ... first, then
the pairs' results, and so on; with a rank count that is not a power of two a node without a
partner is carried up unchanged. Each tensor is combined on its own (its own dot products).

Every rank gathers all ranks' tensors and evaluates the same tree in the same order, so all
ranks get bit-identical results. That costs ``size`` times the tensor's memory, which suits
the moderate rank counts this launcher targets; a recursive-halving variant is the known
next step for very large jobs.

This module is the math only, a leaf: :func:`collectives.ops.submit_adasum_allreduce`
runs an allreduce with ``op=hvd.Adasum`` as an allgather followed by :func:`adasum_tree`, and
the Adasum optimizer (:mod:`collectives.torch.optim.adasum_optimizer`) submits through it.
"""

from __future__ import annotations

import torch

__all__ = ["adasum_pair", "adasum_tree"]


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
    work = torch.float64 if dtype == torch.float64 else torch.float32
    level = [t.to(work) for t in per_rank]
    while len(level) > 1:
        nxt = [adasum_pair(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    result = level[0] if scale == 1.0 else level[0] * scale
    return result.to(dtype)
