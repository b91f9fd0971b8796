"""Helpers that move model and optimizer state and arbitrary objects between ranks.

``broadcast_parameters`` hands all tensors to the op layer in one call, so they travel as one
fused buffer per device rather than one collective per tensor.

An op that carries many tensors (``broadcast_parameters``, a bucket of
``DistributedOptimizer``) fails on ranks whose models differ with a mismatch that names its
fused buffer or "tensor N": :func:`explain_mismatch` then names the tensors that differ and
how, after one more collective that only a failed op costs.

``broadcast_optimizer_state`` sends root's ``optimizer.state_dict()`` as a picklable skeleton
(hyper-parameters, step counts, the structure), in one allgather that also carries every
rank's outline of its optimizer (so ranks whose optimizers differ all fail alike, first),
plus all its tensors in one fused broadcast; the other ranks rebuild the state dict and
``load_state_dict`` it. That way the result is
exactly root's state, whatever the optimizer keeps (scalars, tensors, nested lists) and
whatever state the other ranks had.

An optimizer without any state yet first takes Horovod's dummy step on each rank where it has
none: every parameter that requires a gradient gets a zero gradient (sparse for
``SparseAdam``, and for ``SGD`` on the sparse embeddings of ``model``) and the optimizer
steps once, so that its state exists (Adam's step count is 1 afterwards, as in Horovod).
The zero gradients stay, as in Horovod, since code reads them right after. Unlike Horovod,
the parameters are put back after that step: with weight decay a zero gradient still moves
them, which Horovod lets happen.

A public API module (Horovod's ``horovod.torch.functions``), built on the submission layer
(:mod:`collectives.ops`); the elastic states sync through it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from collectives import objects, ops, runtime
from collectives.common import ProcessSet, global_process_set
from collectives.engine.requests import ranks_by_value, who
from collectives.errors import CollectiveError, HorovodInternalError, TensorMismatchError

__all__ = [
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
]

# (framework-neutral: every frontend shares them)
broadcast_object = objects.broadcast_object
allgather_object = objects.allgather_object


def broadcast_parameters(
    params: Any, root_rank: int, process_set: ProcessSet = global_process_set
) -> None:
    """Overwrites parameters in place with root_rank's (a global rank, also in a process
    set): a state_dict/dict, or a list of tensors or (name, tensor) pairs such as
    ``model.named_parameters()``. Ranks whose tensors differ get a ``TensorMismatchError``
    that names the tensors that differ and each rank's shapes (see :func:`explain_mismatch`).
    """
    if isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda item: str(item[0]))
    elif isinstance(params, Iterable) and not isinstance(params, (str, bytes, torch.Tensor)):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}")
    named: list[tuple[str, torch.Tensor]] = []
    for name, tensor in items:
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(
                f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, not a tensor"
            )
        named.append((f"tensor {len(named)}" if name is None else repr(name), tensor))
    tensors = [tensor for _, tensor in named]
    try:
        ops.broadcast_(tensors, root_rank, process_set, "broadcast_parameters")
    except TensorMismatchError as error:
        order = " (sorted by name)" if isinstance(params, Mapping) else ""
        carried = f"The op broadcasts {_count(len(named), 'tensor')} together{order}"
        raise explain_mismatch(
            error, named, carried, process_set, "broadcast_parameters.mismatch"
        ) from None


#: How many of the tensors that differ between ranks a mismatch names at most.
_SHOWN = 6


def explain_mismatch(
    error: TensorMismatchError,
    named: Sequence[tuple[str, torch.Tensor]],
    carried: str,
    process_set: ProcessSet,
    name: str,
    gradients: bool = False,
) -> TensorMismatchError:
    """``error``, the mismatch of an op that carried several tensors, again (of its class,
    its message kept) saying which of the tensors differ between the ranks and how: the
    engine can only name the op's fused buffer or "tensor N". ``named``: each tensor as
    messages name it (a parameter's quoted name) and the tensor; ``carried``: a sentence
    saying what the op carries; ``gradients``: whether ``requires_grad`` counts too (a
    frozen parameter sends no gradient).

    It costs one ``allgather_object`` (named ``name``) of every member's outline of its
    tensors, and only once the op has failed: negotiation raises a mismatch on every member
    that submitted the op, so every member takes this path alike (a rank that did not
    submit the op, one that has joined, gets no error and takes no part). Where that
    allgather cannot run (a rank has joined, a peer is gone) the message lists this rank's
    own tensors instead. The error comes back unchanged where the outlines agree: the ranks
    disagree on something else (the op, the root)."""
    mine = [(label, _tensor_fields(tensor, gradients)) for label, tensor in named]
    _, group = ops.resolve_process_set(process_set, "the explanation of a mismatch")
    try:
        gathered = allgather_object(mine, name=name, process_set=process_set)
    except (CollectiveError, HorovodInternalError) as failed:
        held = [f"{label} {fields['shape']}" for label, fields in mine]
        return type(error)(
            f"{error}. {carried}. Those of rank {runtime.rank()}: {_listed(held, ', ')} (the "
            f"ranks could not compare theirs: {failed})"
        )
    said = _tensor_differences(dict(zip(group.ranks, gathered, strict=True)))
    if not said:
        return error
    return type(error)(f"{error}. {carried}. What differs between the ranks: {_listed(said, '; ')}")


def _tensor_fields(tensor: torch.Tensor, gradients: bool) -> dict[str, str]:
    """What must be alike on every rank for a tensor to travel in an op, as text."""
    fields = {
        "shape": str(list(tensor.shape)),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "device type": tensor.device.type,
    }
    if gradients:
        fields["requires_grad"] = str(tensor.requires_grad)
    return fields


def _tensor_differences(outlines: dict[int, list[tuple[str, dict[str, str]]]]) -> list[str]:
    """How the ranks' tensors differ, a clause per tensor that differs (in the order the
    ranks listed them): ``'fc.weight' has shape [3, 3] on rank 0, [4, 3] on rank 1``."""
    held: dict[str, dict[int, dict[str, str]]] = {}
    for rank, outline in sorted(outlines.items()):
        for label, fields in outline:
            held.setdefault(label, {})[rank] = fields
    said = []
    for label, by_rank in held.items():
        missing = [rank for rank in sorted(outlines) if rank not in by_rank]
        if missing:
            said.append(f"{label} is missing on {who(missing)}")
            continue
        differ = []
        for field in next(iter(by_rank.values())):
            groups = ranks_by_value({rank: f.get(field, "?") for rank, f in by_rank.items()})
            if len(groups) > 1:
                held_by = ", ".join(f"{value} on {who(ranks)}" for value, ranks in groups.items())
                differ.append(f"{field} {held_by}")
        if differ:
            said.append(f"{label} has {' and '.join(differ)}")
    return said


def _count(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _listed(items: list[str], separator: str) -> str:
    """The first items of a list for a message, and how many more there are."""
    shown = separator.join(items[:_SHOWN])
    return shown if len(items) <= _SHOWN else f"{shown}{separator}and {len(items) - _SHOWN} more"


@dataclass(frozen=True)
class _TensorSlot:
    """Stands for a tensor in a broadcast state skeleton."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device_type: str
    sparse: bool = False  # travels dense (SGD's momentum of a sparse embedding)


def _strip(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """A copy of a nested container with every tensor replaced by a _TensorSlot."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj.to_dense() if obj.is_sparse else obj)
        return _TensorSlot(
            len(tensors) - 1, tuple(obj.shape), obj.dtype, obj.device.type, obj.is_sparse
        )
    if isinstance(obj, dict):
        return {key: _strip(value, tensors) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_strip(value, tensors) for value in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_strip(value, tensors) for value in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of _strip: puts the received tensors back in place of their slots."""
    if isinstance(obj, _TensorSlot):
        return tensors[obj.index].to_sparse() if obj.sparse else tensors[obj.index]
    if isinstance(obj, dict):
        return {key: _fill(value, tensors) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_fill(value, tensors) for value in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_fill(value, tensors) for value in obj)
    return obj


def _empty_for(slot: _TensorSlot) -> torch.Tensor:
    if slot.device_type == "cuda" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    return torch.empty(slot.shape, dtype=slot.dtype, device=device)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    model: Any = None,
    process_set: ProcessSet = global_process_set,
) -> None:
    """Makes every rank's optimizer state (tensors, step counts and param_group
    hyper-parameters) equal to root_rank's (a global rank, also in a process set); parameters
    without state on the root (no gradient yet) end up without state everywhere. A rank whose
    optimizer has no state at all first takes Horovod's dummy step (see the module's
    docstring): zero gradients on the parameters that require one, state created, parameters
    unchanged. ``model`` marks sparse embeddings, as in Horovod."""
    runtime.require("hvd.broadcast_optimizer_state()")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "hvd.broadcast_optimizer_state() does not support torch.optim.LBFGS: its state "
            "is not per parameter; broadcast the parameters and build LBFGS alike on every rank"
        )
    if not optimizer.state_dict()["state"]:
        _dummy_step(optimizer, model)
    # One allgather carries every rank's outline of its optimizer and root's skeleton: ranks
    # whose optimizers differ (class, parameter groups, shapes) all fail alike, before any
    # state moves, instead of one rank failing in load_state_dict while the others go on.
    what = "hvd.broadcast_optimizer_state()"
    _, group = ops.resolve_process_set(process_set, what)
    members = list(group.ranks)
    root_index = ops.root_index(root_rank, group, what)
    root = runtime.rank() == root_rank
    tensors: list[torch.Tensor] = []
    mine = (_outline(optimizer), _strip(optimizer.state_dict(), tensors) if root else None)
    gathered = allgather_object(mine, name="broadcast_optimizer_state", process_set=process_set)
    outlines = {rank: outline for rank, (outline, _) in zip(members, gathered, strict=True)}
    differ = _differences(outlines, root_rank, functools.partial(_label, optimizer, model))
    if differ:
        raise ValueError(
            f"{what}: the ranks' optimizers differ, so root "
            f"{root_rank}'s state fits no other: {differ}; build the same optimizer over "
            "the same model on every rank"
        )
    if root:
        _broadcast_by_device(tensors, [t.device.type for t in tensors], root_rank, process_set)
        return
    skeleton = gathered[root_index][1]
    slots: list[_TensorSlot] = []
    _strip_slots(skeleton, slots)
    ordered = sorted(slots, key=lambda s: s.index)
    received = [_empty_for(slot) for slot in ordered]
    _broadcast_by_device(received, [slot.device_type for slot in ordered], root_rank, process_set)
    optimizer.load_state_dict(_fill(skeleton, received))


def _outline(optimizer: torch.optim.Optimizer) -> tuple[str, list[list[tuple[int, ...]]]]:
    """What must be alike on every rank for root's state to fit: the optimizer's own class
    (a DistributedOptimizer's wrapped one) and its parameter groups' shapes."""
    shapes = [[tuple(p.shape) for p in g["params"]] for g in optimizer.param_groups]
    return _own_class(optimizer).__name__, shapes


def _differences(outlines: dict[int, Any], root_rank: int, label: Callable[[int, int], str]) -> str:
    """How each rank's outline differs from root's ('' if none does); ``label(group,
    index)`` names a parameter."""
    kind, groups = outlines[root_rank]
    said: list[str] = []
    for rank, (other_kind, other_groups) in sorted(outlines.items()):
        if other_kind != kind:
            said.append(f"rank {rank} has {other_kind} where rank {root_rank} has {kind}")
        elif [len(g) for g in other_groups] != [len(g) for g in groups]:
            said.append(
                f"rank {rank}'s parameter groups hold {[len(g) for g in other_groups]} "
                f"parameters where rank {root_rank}'s hold {[len(g) for g in groups]}"
            )
        elif other_groups != groups:
            g, i, theirs, ours = next(
                (g, i, a, b)
                for g, (xs, ys) in enumerate(zip(other_groups, groups, strict=True))
                for i, (a, b) in enumerate(zip(xs, ys, strict=True))
                if a != b
            )
            said.append(
                f"rank {rank}'s {label(g, i)} has shape {list(theirs)} where "
                f"rank {root_rank}'s has {list(ours)}"
            )
    return "; ".join(said)


def _label(optimizer: torch.optim.Optimizer, model: Any, group: int, index: int) -> str:
    """How a message names parameter ``index`` of parameter group ``group``: by its name
    where this rank knows one (a DistributedOptimizer's ``named_parameters``, else
    ``model``'s), else by its place."""
    param = optimizer.param_groups[group]["params"][index]
    name = getattr(optimizer, "_parameter_names", {}).get(param)
    if (name is None or name.startswith("noname.")) and model is not None:
        name = next((n for n, p in model.named_parameters() if p is param), None)
    if name is None or name.startswith("noname."):
        return f"parameter {index} of group {group}"
    return f"parameter {name!r} ({index} of group {group})"


def _broadcast_by_device(
    tensors: list[torch.Tensor], devices: list[str], root_rank: int, process_set: ProcessSet
) -> None:
    """Broadcasts the state's tensors, one op per device type: on a GPU an optimizer keeps
    some state on the CPU beside its CUDA moments (Adam's ``step``), and one op holds
    tensors of one device."""
    for device in sorted(set(devices)):
        group = [t for t, d in zip(tensors, devices, strict=True) if d == device]
        ops.broadcast_(group, root_rank, process_set, f"broadcast_optimizer_state.{device}")


def _dummy_step(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Horovod's state initialisation: zero gradients on every parameter that requires one,
    then one step of the optimizer itself (never a DistributedOptimizer's step, which would
    reduce and wait for every rank); the parameters are restored afterwards."""
    sparse_params: set[int] = set()
    if model is not None:
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding) and module.sparse:
                sparse_params.update(id(p) for p in module.parameters())
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    for p in params:
        grad = torch.zeros_like(p.detach())
        sparse = isinstance(optimizer, torch.optim.SparseAdam) or (
            isinstance(optimizer, torch.optim.SGD) and id(p) in sparse_params
        )
        p.grad = grad.to_sparse() if sparse else grad
    _own_step(optimizer)
    with torch.no_grad():
        for p, before in zip(params, saved, strict=True):
            p.copy_(before)


def _own_step(optimizer: torch.optim.Optimizer) -> None:
    """The wrapped optimizer's own step. ``hvd.DistributedOptimizer`` returns an instance of
    a class made from (its mixin, the optimizer's class), with the optimizer's class last
    among its bases; its step() would reduce the gradients (and Adasum's does not step)."""
    _own_class(optimizer).step(optimizer)


def _own_class(optimizer: torch.optim.Optimizer) -> Any:
    """The optimizer's own class: a DistributedOptimizer's wrapped one (its last base)."""
    if hasattr(optimizer, "skip_synchronize") and hasattr(optimizer, "synchronize"):
        return type(optimizer).__bases__[-1]
    return type(optimizer)


def _strip_slots(obj: Any, slots: list[_TensorSlot]) -> None:
    if isinstance(obj, _TensorSlot):
        slots.append(obj)
    elif isinstance(obj, dict):
        for value in obj.values():
            _strip_slots(value, slots)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _strip_slots(value, slots)
