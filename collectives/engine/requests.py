"""What a rank submits, and how it describes it to the other ranks.

A :class:`Request` is one named operation of this process (a grouped op is one request with
several tensors). Negotiation sends each request to the other ranks as a short text record
of five fields: kind, process set id, name, *signature* and *per-rank part*.

* The signature holds everything that must be equal on every rank (dtypes, shapes, device
  types, op, scaling, root); ranks compare signatures as strings, so the common case costs
  one string comparison, and only a mismatch is decoded to say what differs.
* The per-rank part holds what may legitimately differ: each rank's first dimension for an
  allgather or alltoall, and its splits.

Text instead of pickle: peers' bytes are only ever split and parsed as numbers and names.
"""

from __future__ import annotations

import ast
import enum
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from collectives.common import ReduceOp
from collectives.engine.handles import Handle
from collectives.engine.reduction import PLAIN_SUM, Reduction

__all__ = [
    "NONAME_PREFIXES",
    "Computing",
    "Kind",
    "Request",
    "Signature",
    "TensorSpec",
    "adasum_name",
    "describe_mismatch",
    "noname",
    "parse_signature",
    "ranks_by_value",
    "signature",
    "who",
]

FIELD = "\x1f"
RECORD = "\x1e"


class Kind(enum.IntEnum):
    ALLREDUCE = 0
    ALLGATHER = 1
    BROADCAST = 2
    ALLTOALL = 3
    REDUCESCATTER = 4
    BARRIER = 5
    JOIN = 6
    ADD_PROCESS_SET = 7
    REMOVE_PROCESS_SET = 8

    @property
    def label(self) -> str:
        return _LABEL_LIST[self]

    @property
    def moves_data(self) -> bool:
        return self <= Kind.REDUCESCATTER

    @property
    def ragged(self) -> bool:
        """Whether ranks may differ in the first dimension (it travels in the per-rank part)."""
        return self == Kind.ALLGATHER or self == Kind.ALLTOALL


KIND_BY_TEXT = {str(int(kind)): kind for kind in Kind}

_LABELS = {
    Kind.ALLREDUCE: "allreduce",
    Kind.ALLGATHER: "allgather",
    Kind.BROADCAST: "broadcast",
    Kind.ALLTOALL: "alltoall",
    Kind.REDUCESCATTER: "reducescatter",
    Kind.BARRIER: "barrier",
    Kind.JOIN: "join",
    Kind.ADD_PROCESS_SET: "add_process_set",
    Kind.REMOVE_PROCESS_SET: "remove_process_set",
}

_LABEL_LIST = [_LABELS[kind] for kind in Kind]
#: Per kind, what the names of its unnamed ops start with (a counter follows).
NONAME_PREFIXES = [f"{_LABEL_LIST[kind]}.noname." for kind in Kind]


#: The data kinds as module globals, for code that compares an op's kind per op: an enum
#: member read through its class costs ~0.1 µs on Python 3.11, a global a fifth of that.
ALLREDUCE, ALLGATHER, BROADCAST = Kind.ALLREDUCE, Kind.ALLGATHER, Kind.BROADCAST
ALLTOALL, REDUCESCATTER, BARRIER = Kind.ALLTOALL, Kind.REDUCESCATTER, Kind.BARRIER


def noname(kind: Kind, counter: int) -> str:
    """The Horovod-style name of an unnamed op: its kind's label and its counter."""
    return f"{NONAME_PREFIXES[kind]}{counter}"


# Names of the leading signature fields, per kind (the tensors' specs follow them).
_COMMON_FIELDS: dict[Kind, tuple[str, ...]] = {
    Kind.ALLREDUCE: ("op", "prescale_factor", "postscale_factor"),
    Kind.REDUCESCATTER: ("op", "prescale_factor", "postscale_factor"),
    Kind.BROADCAST: ("root_rank",),
    Kind.ADD_PROCESS_SET: ("ranks",),
    Kind.REMOVE_PROCESS_SET: ("process_set_id",),
}


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]  # -1 for a ragged first dimension
    device_type: str
    numel: int = 0  # of the whole tensor (not meaningful for ragged specs)
    nbytes: int = 0

    @classmethod
    def of(cls, dtype: torch.dtype, shape: tuple[int, ...], device_type: str) -> TensorSpec:
        numel = math.prod(shape)
        return cls(dtype, shape, device_type, numel, numel * dtype.itemsize)

    def text(self, part: str) -> str:
        if part == "dtype":
            return _dtype_name(self.dtype)
        if part == "device":
            return self.device_type
        return _dims(self.shape)


def _dims(shape: Sequence[int]) -> str:
    return "[" + ", ".join("*" if d < 0 else str(d) for d in shape) + "]"


class Computing:
    """A request's ``finish`` that computes on the op's outputs (Adasum's tree, a sparse
    sum): on CUDA its kernels run after the op's, and the op's waiters wait for them
    (see ``Dispatch.complete``). Any other finish only hands out the outputs."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[Request], Any]) -> None:
        self.fn = fn

    def __call__(self, request: Request) -> Any:
        return self.fn(request)


@dataclass(eq=False, slots=True)
class Request:
    """One operation submitted by this process; lives until its handle is completed."""

    kind: Kind
    name: str  # the negotiated key, prefixed with the kind as in Horovod: "allreduce.grad.w"
    process_set_id: int
    inputs: list[torch.Tensor]
    # Preallocated for allreduce/broadcast/reducescatter (the inputs themselves when in
    # place); allgather and alltoall outputs are sized from the negotiation (None till then).
    outputs: list[Any]
    handle: Handle
    #: Allreduce and reducescatter: the op and its scaling (in the signature).
    reduction: Reduction = PLAIN_SUM
    #: Broadcast: the root's position in the process set (in the signature).
    root: int = 0
    extra: Any = None  # alltoall: the received splits
    # Turns the finished request into what synchronize() returns (None: ``extra``).
    finish: Callable[[Request], Any] | None = None
    sig: str = ""
    var: str = ""
    specs: Sequence[TensorSpec] = ()
    submitted: float = 0.0
    # CUDA: the submitting stream, and the event of the op's position on it (None for a
    # blocking op, whose caller queues nothing behind it: see engine/streams.py)
    stream: Any = None
    ready: Any = None
    remaining: int = 0  # buckets still to run
    # Filled by the engine: each member's first dimension per tensor (allgather, alltoall).
    rank_dims: list[list[int]] | None = None
    #: CUDA: the stream the op was submitted from (``stream`` is where it runs), where its
    #: caller uses and frees its outputs (see ``execute.engine_output``, ``Computing``).
    home: Any = None

    @property
    def label(self) -> str:
        """How error messages name the op: ``allreduce 'grad.w'``."""
        return label(self.kind, self.name)

    @property
    def row(self) -> str:
        """Its row of the timeline: its name, with its process set's id where that is not
        the global set (one name in two sets is two ops, so two rows)."""
        if self.process_set_id == 0:
            return self.name
        return f"{self.name} (process set {self.process_set_id})"

    def record(self) -> str:
        return FIELD.join(
            (str(int(self.kind)), str(self.process_set_id), self.name, self.sig, self.var)
        )


#: An allreduce with op=Adasum travels as this allgather (``collectives.ops``); messages name
#: it as the allreduce its caller submitted.
_ADASUM_PREFIX = f"{Kind.ALLGATHER.label}.adasum."


def adasum_name(kind: Kind, name: str) -> str | None:
    """The allreduce name of an Adasum op's allgather (``allgather.adasum.x`` -> ``x``,
    ``allgather.adasum.allreduce.noname.3`` -> ``allreduce.noname.3``); None for other ops."""
    if kind == Kind.ALLGATHER and name.startswith(_ADASUM_PREFIX):
        return name[len(_ADASUM_PREFIX) :]
    return None


def script_name(kind: Kind, name: str) -> str:
    """The name as the script gave it (``allreduce.grad`` -> ``grad``; an Adasum op's
    allgather ``allgather.adasum.grad`` -> ``grad``)."""
    adasum = adasum_name(kind, name)
    if adasum is not None:
        return script_name(Kind.ALLREDUCE, adasum)
    prefix = kind.label + "."
    return name[len(prefix) :] if name.startswith(prefix) else name


def label(kind: Kind, name: str) -> str:
    adasum = " (op=Adasum)" if adasum_name(kind, name) is not None else ""
    shown = Kind.ALLREDUCE.label if adasum else kind.label
    return f"{shown} {script_name(kind, name)!r}{adasum}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_spec(tensor: torch.Tensor, ragged: bool) -> str:
    shape = tuple(tensor.shape)
    dims = ",".join(["*", *map(str, shape[1:])]) if ragged else ",".join(map(str, shape))
    return f"{_dtype_name(tensor.dtype)}[{dims}]@{tensor.device.type}"


def signature(kind: Kind, common: tuple[Any, ...], tensors: list[torch.Tensor]) -> str:
    """The text every member must agree on: ``common`` values, then each tensor's spec."""
    ragged = kind.ragged
    specs = ";".join([tensor_spec(t, ragged) for t in tensors])
    if not common:
        return specs
    return "|".join([*map(repr, common), specs])


@dataclass(frozen=True)
class Signature:
    """A decoded signature: the leading fields as text, and the tensors' specs."""

    common: tuple[str, ...]
    tensors: tuple[TensorSpec, ...]

    def reduction(self) -> Reduction:
        """An allreduce's or reducescatter's op and scaling."""
        return Reduction(int(self.common[0]), float(self.common[1]), float(self.common[2]))

    def root(self) -> int:
        """A broadcast's root (its position in the process set)."""
        return int(self.common[0])

    def ranks(self) -> list[int]:
        """An added process set's ranks."""
        text: str = ast.literal_eval(self.common[0])
        return [int(r) for r in text.split(",")]

    def process_set_id(self) -> int:
        """A removed process set's id."""
        return int(self.common[0])


@functools.lru_cache(maxsize=4096)
def parse_signature(kind: Kind, sig: str) -> Signature:
    """Decodes a peer's signature (only needed on a mismatch or by a joined rank)."""
    fields = _COMMON_FIELDS.get(kind, ())
    parts = sig.split("|") if fields else [sig]
    common = tuple(parts[: len(fields)])
    specs = parts[len(fields)] if len(parts) > len(fields) else ""
    tensors = []
    for spec in specs.split(";") if specs else []:
        dtype_name, rest = spec.split("[", 1)
        dims, device_type = rest.split("]@", 1)
        shape = tuple(-1 if d == "*" else int(d) for d in dims.split(",") if d)
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown dtype {dtype_name!r} in a peer's request")
        tensors.append(TensorSpec.of(dtype, shape, device_type))
    return Signature(common, tuple(tensors))


def who(ranks: Sequence[int]) -> str:
    """Ranks for a message: ``rank 2``, ``ranks 0, 1``."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks))


def ranks_by_value(values: Mapping[int, str]) -> dict[str, list[int]]:
    """Each value the ranks hold, with the ranks that hold it (in rank order)."""
    groups: dict[str, list[int]] = {}
    for rank_, value in sorted(values.items()):
        groups.setdefault(value, []).append(rank_)
    return groups


def _differences(values: dict[int, str]) -> str:
    groups = ranks_by_value(values)
    return "; ".join(f"{who(ranks)}: {value}" for value, ranks in groups.items())


def describe_mismatch(kind: Kind, name: str, sigs: dict[int, str]) -> str:
    """Says which field differs between ranks' signatures, naming the ranks and values; for
    an unnamed op, also how such ops are matched (the usual cause is ranks submitting
    unnamed ops in different orders, which pairs different tensors)."""
    message = _describe_mismatch(kind, name, sigs)
    adasum = adasum_name(kind, name)
    kind, name = (Kind.ALLREDUCE, adasum) if adasum is not None else (kind, name)
    if kind in (Kind.ADD_PROCESS_SET, Kind.REMOVE_PROCESS_SET):
        # (these take no name= argument: the order of the calls pairs them)
        return (
            f"{message}. Every rank must call hvd.{kind.label}() for the same process sets "
            "in the same order"
        )
    counter = name[len(NONAME_PREFIXES[kind]) :]
    if name.startswith(NONAME_PREFIXES[kind]) and counter.isdigit():
        message += (
            f". The op has no name: it is each rank's unnamed {kind.label} number "
            f"{counter} (counted from 0 per kind and process set), so ranks "
            "that submit unnamed ops in different orders pair different tensors; give the "
            "ops names (name=...)"
        )
    return message


def _describe_mismatch(kind: Kind, name: str, sigs: dict[int, str]) -> str:
    what = label(kind, name)
    parsed = {rank_: parse_signature(kind, sig) for rank_, sig in sigs.items()}
    fields = _COMMON_FIELDS.get(kind, ())
    for index, field_name in enumerate(fields):
        values = {r: s.common[index] if index < len(s.common) else "?" for r, s in parsed.items()}
        if len(set(values.values())) > 1:
            if field_name == "op":
                values = {r: _op_name(v) for r, v in values.items()}
            return f"{what}: ranks disagree on the {field_name}: {_differences(values)}"
    counts = {r: len(s.tensors) for r, s in parsed.items()}
    if len(set(counts.values())) > 1:
        shown = {r: str(c) for r, c in counts.items()}
        return f"{what}: ranks disagree on the number of tensors: {_differences(shown)}"
    adasum = adasum_name(kind, name) is not None
    for index in range(next(iter(counts.values()))):
        which = f" of tensor {index}" if next(iter(counts.values())) > 1 else ""
        for part in ("dtype", "shape", "device"):
            values = {r: s.tensors[index].text(part) for r, s in parsed.items()}
            if len(set(values.values())) > 1:
                noun = {"device": "device type"}.get(part, part)
                if part == "shape" and adasum:  # (gathered as a row: [*, its shape...])
                    values = {r: _dims(s.tensors[index].shape[1:]) for r, s in parsed.items()}
                elif part == "shape" and kind.ragged:
                    noun = "shape (all dimensions but the first)"
                return f"{what}: ranks disagree on the {noun}{which}: {_differences(values)}"
    return f"{what}: ranks submitted different requests: {_differences(sigs)}"


def _op_name(value: str) -> str:
    try:
        return ReduceOp(int(value)).name.capitalize()
    except ValueError:
        return value


def parse_ragged(kind: Kind, var: str) -> tuple[list[int], list[int] | None]:
    """A rank's per-rank part: (first dimension of each tensor, splits or None)."""
    if kind == Kind.ALLTOALL:
        dim0, _, splits = var.partition("/")
        return [int(dim0)], [int(s) for s in splits.split(",")] if splits else None
    return [int(d) for d in var.split(",")] if var else [], None


def check_alltoall(name: str, members: list[int], vars_: dict[int, str]) -> str | None:
    """Validates every rank's splits; returns an error message or None."""
    size = len(members)
    for rank_ in members:
        if rank_ not in vars_:
            continue
        (dim0,), splits = parse_ragged(Kind.ALLTOALL, vars_[rank_])
        what = label(Kind.ALLTOALL, name)
        if splits is None:
            if dim0 % size:
                return (
                    f"{what}: rank {rank_}'s tensor has {dim0} rows, which do not split evenly "
                    f"over {size} ranks; pass splits="
                )
            continue
        if len(splits) != size:
            return (
                f"{what}: rank {rank_} passed {len(splits)} splits {splits}, but the process "
                f"set has {size} ranks"
            )
        if any(s < 0 for s in splits) or sum(splits) != dim0:
            return (
                f"{what}: rank {rank_}'s splits {splits} must be non-negative and sum to its "
                f"tensor's first dimension {dim0}"
            )
    return None
