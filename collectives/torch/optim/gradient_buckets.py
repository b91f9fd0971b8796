"""Which gradients ``DistributedOptimizer`` reduces together, and the names they travel by.

Every rank plans the same buckets from the optimizer's parameters: Horovod's ``groups`` when
given, otherwise consecutive parameters in reverse order (about the order backward produces
their gradients), the first bucket small so that communication starts early in the backward
pass. A bucket is one grouped allreduce, so one negotiation, however many tensors it holds.
Parameter names (from ``named_parameters``) name the buckets, so ranks agree on them.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

import torch

from collectives.engine import streams
from collectives.engine.handles import Handle

__all__ = [
    "BUCKET_BYTES",
    "FIRST_BUCKET_BYTES",
    "NOTHING",
    "Bucket",
    "check_groups",
    "parameter_names",
    "plan_buckets",
]

#: Gradients are reduced in buckets of consecutive parameters (in backward order), each
#: closed once it holds this many bytes; a bucket's allreduce starts once all its gradients
#: are ready. On accelerators the first bucket is smaller, so that communication starts
#: early in backward. Not on the CPU: there Gloo's copies and the engine's work take the
#: very cores backward computes on, so an early small reduction only slows backward down
#: (about 7% of a step in bench/training.py), while the later buckets still overlap it.
BUCKET_BYTES = 25 * 1024 * 1024
FIRST_BUCKET_BYTES = 1024 * 1024


class Bucket:
    """Parameters whose gradients travel as one grouped allreduce (one negotiation)."""

    __slots__ = (
        "early",
        "factor",
        "flat",
        "handle",
        "moved",
        "name",
        "params",
        "position",
        "producers",
        "sent",
        "views",
        "waiting",
    )

    def __init__(self, params: list[torch.Tensor], name: str) -> None:
        self.params = params
        self.position = {param: i for i, param in enumerate(params)}
        self.name = name
        self.waiting = -1  # gradients still to come this step; -1: not counted yet
        # Whether this step's gradients move into the flat tensor as each becomes ready
        # (None: not decided yet), and those that have moved.
        self.early: bool | None = None
        self.factor = 1.0  # what a gradient is scaled by on its way in (1/size: Average)
        self.moved: set[torch.Tensor] = set()
        # The CUDA streams this step's gradients not moved yet were produced on.
        self.producers: set[Any] = set()
        self.handle: Handle | None = None
        # (parameter, tensor that travels, compression context) of the running allreduce.
        self.sent: list[tuple[torch.Tensor, torch.Tensor, Any]] = []
        # The bucket's gradients as views of one flat tensor (see flat_views()).
        self.flat: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []

    def reset(self) -> None:
        """Forgets this step: the next gradient starts a new one."""
        self.waiting = -1
        self.early = None
        self.moved = set()
        self.producers = set()
        self.handle = None
        self.sent = []

    def produced(self, param: torch.Tensor) -> None:
        """A CUDA gradient that moves at the bucket's start: it was produced on the current
        stream, which the move must follow."""
        self.producers.add(streams.current(param.get_device()))

    def follow_producers(self) -> None:
        """Orders the current stream after every stream this step's CUDA gradients were
        produced on (before they move)."""
        if not self.producers:
            return
        here = streams.current(next(iter(self.producers)).device_index)
        for producer in self.producers:
            if producer is not here:
                here.wait_stream(producer)
        self.producers.clear()

    def move_together(self, moving: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Dense gradients (parameter, gradient not moved yet, shaped as the parameter) into
        their views of the flat tensor with one torch call for all (one multi-tensor kernel
        on a GPU, where a copy each would launch a kernel each), and one more to scale them
        by ``factor``; the views become the gradients."""
        if not moving:
            return
        views = [self.views[self.position[param]] for param, _ in moving]
        torch._foreach_copy_(views, [grad for _, grad in moving])
        if self.factor != 1.0:
            torch._foreach_mul_(views, self.factor)
        for (param, _), view in zip(moving, views, strict=True):
            self.moved.add(param)
            param.grad = view

    def flat_views(self) -> list[torch.Tensor] | None:
        """One view per parameter into a flat tensor the bucket keeps, shaped like the
        parameter; None when the parameters differ in dtype or device (no flat tensor)."""
        first = self.params[0]
        flat = self.flat
        if (
            flat is not None
            and flat.dtype == first.dtype
            and flat.device == first.device
            and all(v.shape == p.shape for v, p in zip(self.views, self.params, strict=True))
        ):
            return self.views
        if any((p.dtype, p.device) != (first.dtype, first.device) for p in self.params):
            return None
        counts = [p.numel() for p in self.params]
        flat = torch.zeros(sum(counts), dtype=first.dtype, device=first.device)
        self.views = [
            view.view(p.shape) for view, p in zip(flat.split(counts), self.params, strict=True)
        ]
        self.flat = flat
        return self.views


def plan_buckets(
    params: list[torch.Tensor], names: dict[torch.Tensor, str], groups: Any
) -> list[Bucket]:
    """Horovod's ``groups`` (a count, or lists of parameters) or, by default, size-capped
    buckets of parameters in reverse order, which is about the order backward makes them."""
    if isinstance(groups, int) and groups > 0:
        count = min(groups, len(params)) or 1
        chunks = [
            params[len(params) * i // count : len(params) * (i + 1) // count] for i in range(count)
        ]
    elif isinstance(groups, list):
        # The listed groups, then every other parameter on its own, as in Horovod.
        grouped = {p for group in groups for p in group}
        chunks = [list(group) for group in groups]
        chunks += [[p] for p in params if p not in grouped]
    else:
        chunks = []
        current: list[torch.Tensor] = []
        size, cap = 0, BUCKET_BYTES
        if params and params[-1].device.type != "cpu":
            cap = FIRST_BUCKET_BYTES
        for param in reversed(params):
            if current and (current[0].dtype, current[0].device) != (param.dtype, param.device):
                chunks.append(current)
                current, size = [], 0
            current.append(param)
            size += param.numel() * param.element_size()
            # Closed once it reaches the cap (as DDP does), so the first bucket holds at
            # least the last layer's weight however large that is.
            if size >= cap:
                chunks.append(current)
                current, size, cap = [], 0, BUCKET_BYTES
        if current:
            chunks.append(current)
    return [
        Bucket(chunk, names[chunk[0]] if len(chunk) == 1 else f"{names[chunk[0]]}+{len(chunk) - 1}")
        for chunk in chunks
        if chunk
    ]


# Stands for the handle of a bucket that had nothing to send (all its gradients sparse).
NOTHING = Handle()
NOTHING.complete()


def parameter_names(
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
    param_groups: list[dict[str, Any]],
    all_params: list[torch.Tensor],
) -> dict[torch.Tensor, str]:
    """Each parameter's name, checked as Horovod does (no name twice, no parameter
    missing; a parameter under two names is allowed and keeps one)."""
    if named_parameters is not None:
        named = list(named_parameters)
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
            raise ValueError(
                "named_parameters must be a sequence of (name, parameter) tuples, "
                "as model.named_parameters() yields"
            )
    else:
        named = [
            (f"noname.{i}.{j}", param)
            for i, group in enumerate(param_groups)
            for j, param in enumerate(group["params"])
        ]
    counts = collections.Counter(name for name, _ in named)
    duplicates = sorted(name for name, count in counts.items() if count > 1)
    if duplicates:
        raise ValueError(
            f"parameter names in named_parameters must be unique; repeated: {duplicates}"
        )
    by_param: dict[torch.Tensor, str] = {}
    for name, param in named:
        if not isinstance(name, str) or not isinstance(param, torch.Tensor):
            raise ValueError(
                f"named_parameters must hold (str, tensor) pairs, got "
                f"({type(name).__name__}, {type(param).__name__})"
            )
        # A parameter listed under two names (tied weights, with
        # named_parameters(remove_duplicate=False)) keeps one, the same on every rank: as
        # in Horovod, the last in sorted order.
        known = by_param.get(param)
        by_param[param] = name if known is None else max(name, known)
    unnamed = [param for param in all_params if param not in by_param]
    if unnamed:
        shapes = ", ".join(str(tuple(p.shape)) for p in unnamed[:5])
        raise ValueError(
            f"named_parameters was given but {len(unnamed)} of the optimizer's parameters "
            f"are not in it (shapes {shapes}); pass model.named_parameters() of the "
            "model whose parameters the optimizer holds"
        )
    # (The names of parameters the optimizer does not hold yet stay, for add_param_group.)
    names = {param: by_param[param] for param in all_params}
    names.update(by_param)
    return names


def check_groups(groups: Any, optimizer: torch.optim.Optimizer) -> None:
    """Validates ``groups`` as Horovod does."""
    if groups is None:
        return
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups must be a non-negative integer, got {groups}")
        return
    if not isinstance(groups, list) or not all(isinstance(g, list) for g in groups):
        raise ValueError("groups must be an integer or a list of lists of parameters")
    known = {id(p) for group in optimizer.param_groups for p in group["params"]}
    listed: set[int] = set()
    for group in groups:
        for param in group:
            if id(param) not in known:
                raise ValueError("groups contains a tensor that is not one of the optimizer's")
            if id(param) in listed:
                raise ValueError("groups lists a parameter more than once")
            listed.add(id(param))
