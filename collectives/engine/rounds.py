"""The response cache's rounds: ops seen before are agreed by one number per cached op.

While the table of pending ops is empty (the steady state of a training loop), a cycle
starts with a *cache round* instead of the allgather of full descriptions: one allreduce
(Sum, float64) of a small vector holding

* per cached op (see :mod:`.cache`), how many members submitted it: every member, and it
  runs (the AND of Horovod's bit vector); only some, and a named op waits on those members
  for a later round (ops of a burst that the ranks' cycles split differently), until it
  waited HOLD_SECONDS and goes to the full negotiation, where the stall inspector sees it --
  and, for unnamed ops, whose auto-generated names differ only in their counter, the
  counter's sum and sum of squares, so that ranks whose counters differ never match (an
  unnamed op that only some members submitted falls back at once);
* how many members have something the cache cannot say (a new op, an op whose description
  changed, a control op, a shutdown): any, and the cycle falls back to the full
  negotiation (the allgather of :mod:`.negotiation`) right away, as if there were no cache;
* the data of the small Sum/Average allreduces that counted rounds agreed on in their last
  RECENT_ROUNDS (*riders*, see :class:`_RecentRiders`): members lay them out alike from
  what all agreed on, so the op costs one collective. A rider runs from this data only
  when every member contributed it.

The first slot also counts, in multiples of FLAG_WEIGHT, the members that ask for the
arrival accounting's flush (see :mod:`.insight`): one more element could take Gloo one more
step.

Once the clean rounds repeat a pattern (the last ``p`` rounds held the same ops as the ``p``
before them, unnamed ones with counters that moved on; ``p`` up to MAX_PERIOD: one op in a
loop, or a loss and an accuracy averaged in turn), the next round is *predicted* (the ops of
the round ``p`` back, unnamed ones' counters moved on as much again): one allreduce of just
the riders' data (see ``CacheRound._predicted``), with the accounting's flag where it costs
nothing. Each round of the pattern keeps the riders' layout planned from its own ops. A
burst of riders too large for a cache round (up to PREDICTED_BYTES in float32 or float64)
rides predicted rounds only. A member whose ops are not the predicted ones sends NaN, and
every member falls back.

Every round notes how long this member spent in its collective, and flushes the accounting
when a member raised its flag (see :mod:`.insight`).

Every member derives the layout, the prediction and the back-off from what all saw alike,
so all choose the same kind of round. A :class:`CacheRound` is owned by its process set's
cycle runner: only the holder of the set's cycle lock calls it.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from collectives.common import ReduceOp
from collectives.engine.cache import Key, ResponseCache, is_unnamed, keys_of, request_key
from collectives.engine.execute import Sums, check_unchanged
from collectives.engine.insight import IDLE, Arrivals
from collectives.engine.reduction import Reduction
from collectives.engine.requests import ALLREDUCE, REDUCESCATTER, Request

__all__ = ["AGREED", "DIFFERED", "HOLD_SECONDS", "MAX_COUNTER", "RODE", "CacheRound", "rides"]

#: Riders' elements (as float64) one cache round may carry; also the most one rider holds.
RIDER_ELEMENTS = 16 * 1024
#: Counted rounds after which a rider no round agreed on since loses its slot in them.
RECENT_ROUNDS = 32
#: The most rounds a predicted pattern spans (ops that take turns: A, B, A, B is two; a loop
#: that logs 20 metrics one by one, 20).
MAX_PERIOD = 32
#: Riders' bytes one predicted round may carry when they share float32 or float64 (a burst
#: of small gradients: one allreduce of their data in their own dtype, as a fused allreduce
#: would run it, but without a negotiation).
PREDICTED_BYTES = 4 * 1024 * 1024
#: Predicted rounds' staging buffers are kept (one per round of a pattern, each up to
#: PREDICTED_BYTES) up to this many bytes in all; the least recently used goes first.
_STAGING_BYTES = 16 * PREDICTED_BYTES
#: Riders at which a round copies their data in and out with one torch call for all.
_BULK = 4
#: What :meth:`CacheRound.run_one` did with a lone op: its round found that another rank's
#: ops differed; its data rode the round (done); every rank agreed to run it now.
DIFFERED, RODE, AGREED = 0, 1, 2
#: Unnamed ops with counters this large always negotiate in full: the sums of squares that
#: tell the ranks' counters apart must stay exact in float64.
MAX_COUNTER = 1 << 24
#: How long an op that only some members submitted waits for the others in cache rounds
#: before it goes to the full negotiation (where the stall inspector sees it, and a mismatch
#: is named): a burst split differently over the ranks' cycles meets again within cycles.
HOLD_SECONDS = 1.0
#: At most this many rounds of full negotiation after cache rounds failed in a row.
MAX_BACKOFF = 16
#: Rounds of full negotiation after a burst of small allreduces too large to ride.
BURST_ROUNDS = 16
_RIDER_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
#: The cache round's first slot holds the dirty members plus this many times the members
#: that raised the accounting's flag (exact in float64 for any job size below it).
FLAG_WEIGHT = float(1 << 24)
#: Riders whose data the flag may follow: one more element than one or two would cost Gloo's
#: allreduce one more step (with three or more their sum is an allgather already).
_FLAG_AFTER = 3


@dataclass(frozen=True)
class _Rider:
    index: int  # cache index
    key: Key
    numel: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def kept_in(self, cache: ResponseCache) -> bool:
        """Whether its cache entry still holds its op (not evicted and reused since)."""
        return cache.keys[self.index] == self.key


class _Staging:
    """The predicted round's vector, kept from round to round for one layout of riders:
    each rider's slice viewed in its tensor's shape, so that a round copies the inputs in
    and the results out without allocating (a fresh tensor per round also costs a GIL
    round trip when Gloo's thread drops the last reference to it). With no riders, its one
    element is the accounting's flag (see :mod:`.insight`) and where NaN goes; behind three
    or more riders' elements the flag takes one more (``flag``: its index; None: no flag)."""

    def __init__(self, layout: list[_Rider]) -> None:
        self.layout = layout
        # In the riders' own dtype when they share float32 or float64 (no cast on the way in
        # or out, the same collective as an allreduce of the tensor itself), else float64.
        dtypes = {r.dtype for r in layout}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float64
        if dtype not in (torch.float32, torch.float64):
            dtype = torch.float64
        riders = sum(r.numel for r in layout)
        self.flag = riders if riders == 0 or riders >= _FLAG_AFTER else None
        numel = riders if self.flag is None else riders + 1
        # Over a bytearray: Python reads the first element (the NaN test) and the flag
        # without a torch call.
        raw = bytearray(numel * dtype.itemsize)
        self.nbytes = len(raw)
        self.vector = torch.frombuffer(raw, dtype=dtype)
        self.data = self.vector[:riders]  # the riders' part
        self.first = memoryview(raw).cast("f" if dtype == torch.float32 else "d")
        self.dtype = dtype
        self.parts: list[torch.Tensor] = []
        offset = 0
        for rider in layout:
            self.parts.append(self.vector[offset : offset + rider.numel].view(rider.shape))
            offset += rider.numel
        self.counts = [rider.numel for rider in layout]
        self.same_dtype = all(rider.dtype == dtype for rider in layout)
        self.flat = all(len(rider.shape) == 1 for rider in layout)

    def load(self, requests: Sequence[Request]) -> None:
        """The riders' inputs (``requests`` in layout order) into the vector, cast and
        prescaled: one torch call for a burst of riders in the vector's dtype."""
        if (
            len(requests) >= _BULK
            and self.same_dtype
            and all(request.reduction.prescale == 1.0 for request in requests)
        ):
            inputs = [request.inputs[0] for request in requests]
            if self.flat:
                # cat resizes its output to fit when an input was resized in flight (a
                # shrink silently; a growth fails): the data keeping its size proves none was.
                numel = self.data.numel()
                try:
                    torch.cat(inputs, out=self.data)
                except RuntimeError:
                    _check_inputs(requests)  # (names the op, if that is why)
                    raise
                if self.data.numel() != numel:
                    self.data = self.vector[:numel]
                    _check_inputs(requests)
                return
            _check_inputs(requests)  # (a copy would broadcast a resized input silently)
            torch._foreach_copy_(self.parts, inputs)
            return
        _check_inputs(requests)
        for part, request in zip(self.parts, requests, strict=True):
            request.reduction.stage(part, request.inputs[0])

    def unload(self, requests: Sequence[Request], size: int) -> None:
        """Completes the riders (``requests`` in layout order) from the summed vector; no
        result aliases the vector, which the next round reuses."""
        if len(requests) >= _BULK and self.same_dtype and self._unload_burst(requests, size):
            return
        for part, request in zip(self.parts, requests, strict=True):
            _finish_rider(request, part, size)

    def _unload_burst(self, requests: Sequence[Request], size: int) -> bool:
        """One torch call or two for a burst of riders alike (False: they are not)."""
        reduction = requests[0].reduction
        if any(request.reduction != reduction for request in requests):
            return False
        outputs = [request.outputs[0] for request in requests]
        if reduction.plain_sum and all(
            out is not None and out.dtype == self.dtype and out.shape == part.shape
            for out, part in zip(outputs, self.parts, strict=True)
        ):
            torch._foreach_copy_(outputs, self.parts)
            return True
        if any(out is not None for out in outputs):
            return False
        result = self.data.clone()
        reduction.finish(result, size)
        pieces = result.split(self.counts)
        for request, rider, piece in zip(requests, self.layout, pieces, strict=True):
            request.outputs[0] = piece if len(rider.shape) == 1 else piece.view(rider.shape)
        return True


class _Round:
    """A clean round, as the pattern's history keeps it: its ops as (cache index, counter) in
    cache order; how far each counter moved from the same round one period before (``steps``,
    once a pattern holds it); the riders' layout planned from its ops, whether counted rounds
    the cache's evictions when it was planned; the hot lane's print of its lone
    op once that ran in a lane (``hot``, see :mod:`.lanes`)."""

    __slots__ = ("evictions", "hot", "layout", "ops", "steps")

    def __init__(self, ops: list[tuple[int, int]], layout: list[_Rider], evictions: int) -> None:
        self.ops = ops
        self.steps: list[int] = []
        self.layout = layout
        self.evictions = evictions
        self.hot: Any = None


class _Patterns:
    """The clean rounds since the last full negotiation (at most 2 * MAX_PERIOD) and, once
    they repeat a pattern, its rounds (``pattern``, in the order they run), which of them
    runs next (``at``) and the ops predicted for it (``prediction``: that round's ops again,
    unnamed ones' counters moved on by its steps). Fed only what every member agreed on."""

    def __init__(self) -> None:
        self.history: list[_Round] = []
        #: The latest round of the history by its ops' cache indices.
        self._latest: dict[tuple[int, ...], _Round] = {}
        self.pattern: list[_Round] = []
        self.at = 0
        self.prediction: list[tuple[int, int]] | None = None

    def forget(self) -> None:
        self.history = []
        self._latest = {}
        self.pattern = []
        self.prediction = None

    def earlier(self, ops: list[tuple[int, int]]) -> _Round | None:
        """The latest clean round that held the same ops (its riders are these ops' too)."""
        return self._latest.get(_indices(ops))

    def add(self, added: _Round) -> _Round:
        """After a clean round: the shortest pattern the history repeats (its last ``p``
        rounds held the ops of the ``p`` before them), predicted from here on. Returns the
        round whose riders the next round carries: the one predicted, else ``added``."""
        history, latest = self.history, self._latest
        history.append(added)
        latest[_indices(added.ops)] = added
        if len(history) > 2 * MAX_PERIOD:
            gone = history.pop(0)
            key = _indices(gone.ops)
            if latest.get(key) is gone:
                del latest[key]
        last = added.ops
        for period in range(1, min(MAX_PERIOD, len(history) // 2) + 1):
            # (most periods fail at once: the last round's ops differ from those p before)
            before = history[-1 - period].ops
            if len(before) != len(last) or (last and before[0][0] != last[0][0]):
                continue
            found = _repeated_steps(history, period)
            if found is None:
                continue
            pattern = history[-period:]
            for round_, steps in zip(pattern, found, strict=True):
                round_.steps = steps
            self.pattern, self.at = pattern, 0
            self.prediction = _moved(pattern[0].ops, pattern[0].steps)
            return pattern[0]
        self.prediction = None
        return added

    def advance(self, ops: list[tuple[int, int]]) -> _Round | None:
        """The predicted round ran, holding ``ops``; the pattern's next round is predicted.
        Returns that round when the pattern spans several (None: the same one again)."""
        pattern = self.pattern
        round_ = pattern[self.at]
        round_.ops = ops
        following = None
        if len(pattern) > 1:
            self.at = (self.at + 1) % len(pattern)
            round_ = following = pattern[self.at]
        steps = round_.steps
        if len(steps) == 1:
            ((index, counter),) = round_.ops
            self.prediction = [(index, counter + steps[0])]
        else:
            self.prediction = _moved(round_.ops, steps)
        return following


def rides(request: Request) -> bool:
    """Whether a request's data can ride a cache round."""
    if request.kind != ALLREDUCE or len(request.specs) != 1:
        return False
    spec = request.specs[0]
    return (
        spec.device_type == "cpu"
        and spec.dtype in _RIDER_DTYPES
        and 0 < spec.numel <= RIDER_ELEMENTS
        and request.reduction.sums
    )


class _CountSlots:
    """Where a counted round's vector holds each cache entry's count (after slot 0, the dirty
    count), and an unnamed op's two counter sums after its count: derived from the cache's
    keys, kept until they change (a walk over a full cache's keys cost more than the round
    itself)."""

    def __init__(self, cache: ResponseCache) -> None:
        self._cache = cache
        self._of = -1  # the cache's ``changes`` the slots were derived at
        self.starts: list[int] = [1]  # each entry's first slot, then where the counts end
        self._index_at: dict[int, int] = {}  # entry index by first slot

    def current(self) -> _CountSlots:
        cache = self._cache
        if self._of != cache.changes:
            starts, at = [], 1
            for key in cache.keys:
                starts.append(at)
                at += 3 if is_unnamed(key) else 1
            starts.append(at)
            self.starts = starts
            self._index_at = {start: index for index, start in enumerate(starts[:-1])}
            self._of = cache.changes
        return self

    @property
    def end(self) -> int:
        return self.starts[-1]

    def write(self, slots: memoryview[float], mine: dict[int, tuple[Request, int]]) -> None:
        """This member's ops (by cache index: request, counter) into the vector's slots."""
        starts = self.starts
        for index, (_request, counter) in mine.items():
            at = starts[index]
            slots[at] = 1.0
            if starts[index + 1] - at == 3:
                slots[at + 1] = counter
                slots[at + 2] = counter * counter

    def agreed(
        self, vector: torch.Tensor, mine: dict[int, tuple[Request, int]], size: int
    ) -> tuple[list[int], bool] | None:
        """From the summed vector: the cache indices every member submitted (with the same
        counters), in cache order, and whether some named op was submitted by some members
        only (held back until the others submit it too); None when the members' unnamed
        ops differ. Only the slots some member set are read (a few of a full cache's)."""
        submitted = torch.nonzero(vector[1 : self.end]).flatten() + 1
        counts = dict(zip(submitted.tolist(), vector[submitted].tolist(), strict=True))
        starts, index_at = self.starts, self._index_at
        agreed: list[int] = []
        partial = False
        for at, count in counts.items():
            index = index_at.get(at)
            if index is None:
                continue  # (an unnamed op's counter slot)
            unnamed = starts[index + 1] - at == 3
            if count != size:
                # (an unnamed op's place in its round is part of its key: ranks that
                # split a burst differently would not meet again)
                if unnamed:
                    return None
                partial = True
                continue
            if unnamed:
                counter = mine[index][1]
                sums = counts.get(at + 1, 0.0), counts.get(at + 2, 0.0)
                if sums != (size * counter, size * counter**2):
                    return None
            agreed.append(index)
        return agreed, partial


def _rider(index: int, key: Key, request: Request) -> _Rider:
    spec = request.specs[0]
    return _Rider(index, key, spec.numel, spec.shape, spec.dtype)


class _RecentRiders:
    """The riders of counted rounds: the small Sum/Average allreduces that counted rounds
    agreed on in their last RECENT_ROUNDS (up to RIDER_ELEMENTS in all, the latest first),
    in cache order. Derived from agreed ops only, so alike on every member. Ranks whose
    cycles split a burst differently agree on a different part of it each round; with a
    slot for each part, every part rides whichever round agrees on it."""

    def __init__(self, cache: ResponseCache) -> None:
        self._cache = cache
        self._rounds = 0
        self._last: dict[int, tuple[_Rider, int]] = {}  # by index: rider, round last agreed
        self._layout: list[_Rider] = []
        self._evictions = cache.evictions

    def note(self, ops: list[tuple[int, Request, int]]) -> None:
        """A counted round agreed on ``ops`` (index, request, counter)."""
        self._rounds = at = self._rounds + 1
        last, keys = self._last, self._cache.keys
        changed = False
        for index, request, _ in ops:
            held = last.get(index)
            if held is not None:
                last[index] = (held[0], at)
            elif rides(request):
                last[index] = (_rider(index, keys[index], request), at)
                changed = True
        if last and at % RECENT_ROUNDS == 0:  # (aged in steps, not every round)
            stale = [index for index, (_, seen) in last.items() if seen <= at - RECENT_ROUNDS]
            for index in stale:
                del last[index]
            changed = changed or bool(stale)
        if changed:
            self._derive()

    def current(self) -> list[_Rider]:
        cache = self._cache
        if self._evictions != cache.evictions:  # (indices stay valid but for these)
            last = self._last
            for index in [i for i, (rider, _) in last.items() if not rider.kept_in(cache)]:
                del last[index]
            self._evictions = cache.evictions
            self._derive()
        return self._layout

    def _derive(self) -> None:
        latest = sorted(self._last.values(), key=lambda held: -held[1])
        layout, total = [], 0
        for rider, _ in latest:
            if total + rider.numel <= RIDER_ELEMENTS:
                layout.append(rider)
                total += rider.numel
        layout.sort(key=lambda rider: rider.index)
        self._layout = layout


class CacheRound:
    """Builds and reads the cache round's vector; holds the riders' layout between rounds
    (derived only from what every rank saw alike)."""

    def __init__(self, cache: ResponseCache, size: int, arrivals: Arrivals | None = None) -> None:
        self.cache = cache
        self.size = size
        self.arrivals = arrivals if arrivals is not None else Arrivals(0, size)
        self._layout: list[_Rider] = []  # the next round's riders
        self._patterns = _Patterns()
        self.predicted_rounds = 0  # rounds the prediction agreed
        # Set (alike everywhere) when a clean round held more small allreduce data than a
        # cache round carries: the next BURST_ROUNDS rounds negotiate in full, where such
        # bursts ride the allgather whole (see :mod:`eager`): one collective instead of a
        # cache round and a fused allreduce.
        self._full_left = 0
        self._misses = 0  # cache rounds that failed in a row
        self._staging: _Staging | None = None  # the last one staged
        self._stagings: dict[int, _Staging] = {}  # by id of their layout (one per round)
        self._recent = _RecentRiders(cache)  # what counted rounds carry
        self._layout_evictions = 0  # the cache's evictions when the layout was last checked
        self._sums = Sums()
        self._count_slots = _CountSlots(cache)

    def forget(self) -> None:
        """A full negotiation ran, a predicted round failed, or a round held ops back:
        predict nothing until the pattern repeats again."""
        self._patterns.forget()

    def run(
        self, group: Any, new: Sequence[Request], dirty: bool, timeout: float | None
    ) -> tuple[list[Request], list[Request]] | None:
        """One cache round. Returns (ops agreed, in cache order; riders among them, already
        complete but for their handles), or None when the cycle must fall back to the full
        negotiation (every rank decides alike). Ops of ``new`` not agreed wait for a later
        round: some member has not submitted them yet."""
        if self._full_left:
            self._full_left -= 1
            return None
        layout = self._valid_layout()
        if self._patterns.prediction is not None:
            # A pattern that stopped repeating goes straight to the full negotiation: at
            # most one small extra collective.
            outcome = self._predicted(group, new, dirty, timeout, layout)
            if outcome is not None:
                self.predicted_rounds += 1
            return outcome
        outcome = self._counted(group, new, dirty, timeout, self._recent.current())
        if outcome is None:
            # Back off while cache rounds keep failing (ops that arrive split differently
            # over the ranks' cycles): each failure costs a collective.
            self._misses += 1
            self._full_left = min(1 << self._misses, MAX_BACKOFF)
        else:
            self._misses = 0
        return outcome

    def _valid_layout(self) -> list[_Rider]:
        """The riders' layout, without riders whose cache entry was evicted since."""
        cache = self.cache
        if self._layout_evictions != cache.evictions:  # (indices stay valid but for these)
            kept = [r for r in self._layout if r.kept_in(cache)]
            if len(kept) != len(self._layout):
                self._layout = kept
            self._layout_evictions = cache.evictions
        return self._layout

    def _use(self, round_: _Round) -> None:
        """The next round's riders are the ones planned from ``round_``'s ops."""
        if self._layout is not round_.layout:
            self._layout = round_.layout
            self._layout_evictions = round_.evictions

    def _stage(self, layout: list[_Rider]) -> _Staging:
        staging = self._staging
        if staging is None or staging.layout is not layout:
            stagings = self._stagings
            staging = stagings.pop(id(layout), None)  # (put back as the most recent)
            if staging is None or staging.layout is not layout:
                staging = _Staging(layout)
                kept = staging.nbytes + sum(s.nbytes for s in stagings.values())
                while stagings and (kept > _STAGING_BYTES or len(stagings) >= 2 * MAX_PERIOD):
                    kept -= stagings.pop(next(iter(stagings))).nbytes
            stagings[id(layout)] = staging
            self._staging = staging
        return staging

    def predicts_one(self) -> bool:
        """Whether the next round is a predicted round of exactly one op (every rank alike)."""
        prediction = self._patterns.prediction
        return prediction is not None and len(prediction) == 1 and not self._full_left

    def run_one(self, group: Any, request: Request) -> int | None:
        """The predicted round for a lone blocking op (see :mod:`.lanes`), when it is the one
        op predicted: None when it is not (nothing ran); DIFFERED when another rank's ops
        differed (NaN: every rank falls back to the full negotiation of this cycle); RODE
        when its data rode the round (its result is in its output); AGREED when every rank
        runs it now (the caller runs its collectives, as a cycle would)."""
        key, counter = request_key(request)
        index = self._lone(counter)
        if index is None or self.cache.lookup(key) != index:
            return None
        outcome, part = self._lone_op(
            group, index, counter, request.inputs[0], request.reduction, request.name
        )
        if part is not None:
            _finish_rider(request, part, self.size)
        return outcome

    def run_lone(
        self,
        group: Any,
        want: int,
        tensor: torch.Tensor,
        reduction: Reduction,
        name: str | None = None,
    ) -> int | None:
        """:meth:`run_one` for the engine's hot lane, which vouches that no other round ran
        since the last one of this lane (the prediction is this lone op's, its layout and
        staging stand): the op is ``tensor``, reduced in place with ``reduction``, with
        counter ``want`` (0 for a named op, ``name``). Returns as run_one does (RODE: the
        tensor holds the result). Only the checks are its own; the round is run_one's (the
        lane's time counts as busy: no cycle counts it)."""
        ((index, predicted),) = self._patterns.prediction or ((-1, -1),)
        if predicted != want or want >= MAX_COUNTER:
            return None
        outcome, part = self._lone_op(group, index, want, tensor, reduction, name, lane=True)
        if part is not None:
            _finish_out(tensor, part, reduction, self.size)
        return outcome

    def next_hot(self, hot: Any) -> Any:
        """The lone op that just ran in a lane, as the hot lane prints it (``hot``, None
        when it cannot take the hot lane), noted for its round of the pattern. Returns the
        print of the op predicted next (the same one in a pattern of one round), or None
        when its round has not run in a lane yet: what the hot lane must match next."""
        pattern, at = self._patterns.pattern, self._patterns.at
        if not pattern:
            return None
        pattern[at - 1].hot = hot  # (the round before ``at``: the one that just ran)
        return pattern[at].hot

    def _lone(self, counter: int) -> int | None:
        """The cache index of the one riding op predicted next, if its counter is
        ``counter`` (0 for a named op); else None."""
        if not self.predicts_one():
            return None
        assert self._patterns.prediction is not None
        ((index, predicted),) = self._patterns.prediction
        if predicted != counter or counter >= MAX_COUNTER:
            return None
        layout = self._valid_layout()
        if layout and (len(layout) != 1 or layout[0].index != index):
            return None
        return index

    def _sum(self, group: Any, vector: torch.Tensor, timeout: float | None = None) -> None:
        """Sums a round's vector over the members. A set of one rank has no one to agree
        with: its vector is the sum, and the round costs no collective (on a GPU machine the
        Gloo round of one rank cost more than the NCCL op it negotiated)."""
        if self.size > 1:
            self._sums.start(group, self.size, vector, timeout).wait()

    def _lone_op(
        self,
        group: Any,
        index: int,
        counter: int,
        source: torch.Tensor,
        reduction: Reduction,
        label: str | None,
        lane: bool = False,
    ) -> tuple[int, torch.Tensor | None]:
        """The predicted round of the lone op ``index`` (with ``counter``), its data
        (``source``, staged with ``reduction``) riding it when the round's layout holds it:
        DIFFERED, AGREED (nothing rode), or RODE with the vector's part holding its sum."""
        staging = self._stage(self._layout)  # (the predicted round's, in a longer pattern)
        part = staging.parts[0] if staging.parts else None
        if part is not None:
            reduction.stage(part, source)
        if not self._lone_round(group, label, lane):
            return DIFFERED, None
        self._repeated([(index, counter)])
        self.predicted_rounds += 1
        return (AGREED, None) if part is None else (RODE, part)

    def _lone_round(self, group: Any, label: str | None, lane: bool) -> bool:
        """The allreduce of a lone op's round; False when another rank's ops differed."""
        staging = self._staging
        assert staging is not None
        first, flag, arrivals = staging.first, staging.flag, self.arrivals
        if flag is not None:
            first[flag] = 1.0 if arrivals.want else 0.0
        started = time.perf_counter()
        self._sum(group, staging.vector)
        ended = time.perf_counter()
        arrivals.note(started, ended, label)
        if lane:
            arrivals.busy += ended - started
        agreed = not math.isnan(first[0])
        arrivals.after(group, agreed and flag is not None and first[flag] > 0.5)
        if not agreed:
            self.forget()
        return agreed

    def _repeated(self, ops: list[tuple[int, int]]) -> None:
        """Bookkeeping of a predicted round that agreed (alike on every rank): ``ops`` as
        (cache index, counter) in cache order, the pattern's round as predicted."""
        cache = self.cache
        for index, _ in ops:
            cache.use(cache.keys[index])
        following = self._patterns.advance(ops)
        if following is not None:
            self._use(following)

    def _counted(
        self,
        group: Any,
        new: Sequence[Request],
        dirty: bool,
        timeout: float | None,
        layout: list[_Rider],
    ) -> tuple[list[Request], list[Request]] | None:
        """The round with a count per cached op (see the module's docstring)."""
        cache = self.cache
        count_slots = self._count_slots.current()
        data_at = count_slots.end
        length = data_at + sum(r.numel for r in layout)
        # Over a bytearray: the counts are written by Python, without a torch call each.
        raw = bytearray(length * 8)
        vector = torch.frombuffer(raw, dtype=torch.float64)
        slots = memoryview(raw).cast("d")
        mine: dict[int, tuple[Request, int]] = {}
        for request, (key, counter) in zip(new, keys_of(new), strict=True):
            index = cache.lookup(key)
            if (
                index is None
                or index in mine
                or request.kind > REDUCESCATTER
                or counter >= MAX_COUNTER
            ):
                dirty = True
                break
            mine[index] = (request, counter)
        if dirty:
            slots[0] = 1.0
        else:
            count_slots.write(slots, mine)
            offset = data_at
            for rider in layout:
                held = mine.get(rider.index)
                if held is not None:
                    request = held[0]
                    check_unchanged(request, 0)
                    part = vector[offset : offset + rider.numel]
                    request.reduction.stage(part, request.inputs[0].reshape(-1))
                offset += rider.numel
        arrivals = self.arrivals
        if arrivals.want:
            slots[0] += FLAG_WEIGHT
        started = time.perf_counter()
        self._sum(group, vector, timeout)
        arrivals.note(started, time.perf_counter(), new[0].name if new else IDLE)
        first = slots[0]
        flags = first // FLAG_WEIGHT
        size = self.size
        # (None: dirty members, or unnamed ops that differ; the caller's full round follows)
        outcome = None if first != flags * FLAG_WEIGHT else count_slots.agreed(vector, mine, size)
        # (stuck: a clean round that made nothing ready; where it was not clean, the full
        # round that follows in this cycle judges, so a late member's wait here counts)
        arrivals.after(group, flags > 0, timeout, progress=outcome is None or bool(outcome[0]))
        if outcome is None:
            return None
        agreed, partial = outcome
        # Agreed on every rank alike: run in cache order; the riders complete here. Ops
        # that only some members submitted wait for the next round (the caller holds them
        # back), as Horovod's bit vector keeps them; a round that had any is no part of a
        # pattern.
        every = set(agreed) if partial else mine
        riders: list[Request] = []
        offset = data_at
        for rider in layout:
            submitted = mine.get(rider.index)
            if submitted is not None and rider.index in every:
                request = submitted[0]
                _finish_rider(request, vector[offset : offset + rider.numel], size)
                riders.append(request)
            offset += rider.numel
        ops = [(index, mine[index][0], mine[index][1]) for index in agreed]
        self._recent.note(ops)
        return self._agreed(ops, riders, not partial)

    def _agreed(
        self, ops: list[tuple[int, Request, int]], riders: list[Request], clean: bool
    ) -> tuple[list[Request], list[Request]]:
        """Bookkeeping of a round (alike on every rank): ``ops`` as (index, request,
        counter) in cache order; ``clean``: every op submitted was agreed (a round that
        may start or go on with a pattern; one that held ops back ends any)."""
        cache = self.cache
        for index, _, _ in ops:
            cache.use(cache.keys[index])
        requests = [request for _, request, _ in ops]
        if not clean:
            self.forget()
        elif ops:
            current = [(index, counter) for index, _, counter in ops]
            earlier = self._patterns.earlier(current)
            if earlier is not None:  # (the same ops again keep their riders)
                round_ = _Round(current, earlier.layout, earlier.evictions)
            else:
                layout = self._plan_riders([(index, request) for index, request, _ in ops])
                round_ = _Round(current, layout, cache.evictions)
            self._use(self._patterns.add(round_))
        return requests, riders

    def _predicted(
        self,
        group: Any,
        new: Sequence[Request],
        dirty: bool,
        timeout: float | None,
        layout: list[_Rider],
    ) -> tuple[list[Request], list[Request]] | None:
        """The round of a repeating pattern: one allreduce of just the riders' data (one
        element when there are none). A rank whose ops are not exactly the predicted ones
        sends NaN: the sum is NaN on every rank, and all fall back to the cache round.
        (A NaN in the data itself only costs that fallback.)"""
        prediction = self._patterns.prediction
        assert prediction is not None
        cache = self.cache
        ops: list[tuple[int, Request, int]] = []
        by_index: dict[int, Request] = {}
        if not dirty and len(new) == len(prediction):
            wanted = dict(prediction)
            for request, (key, counter) in zip(new, keys_of(new), strict=True):
                index = cache.lookup(key)
                if index is None or wanted.pop(index, -1) != counter or counter >= MAX_COUNTER:
                    ops = []
                    by_index = {}
                    break
                ops.append((index, request, counter))
                by_index[index] = request
        staging = self._stage(layout)
        riders: list[Request] = []
        arrivals = self.arrivals
        if ops and all(r.index in by_index for r in layout):
            riders = [by_index[rider.index] for rider in layout]
            if riders:
                staging.load(riders)
            if staging.flag is not None:
                staging.first[staging.flag] = 1.0 if arrivals.want else 0.0
        else:
            staging.vector.fill_(math.nan)
        started = time.perf_counter()
        self._sum(group, staging.vector, timeout)
        arrivals.note(started, time.perf_counter(), new[0].name if new else IDLE)
        flag = staging.flag
        agreed = not math.isnan(staging.first[0])
        arrivals.after(group, agreed and flag is not None and staging.first[flag] > 0.5, timeout)
        if not agreed:
            self.forget()
            return None
        staging.unload(riders, self.size)
        if len(ops) > 1:
            ops.sort(key=_FIRST)
        self._repeated([(index, counter) for index, _, counter in ops])
        return [request for _, request, _ in ops], riders

    def _plan_riders(self, ops: Sequence[tuple[int, Request]]) -> list[_Rider]:
        """The riders a predicted round of a round's ops carries: its small Sum/Average
        allreduces (the same list on every rank: the same agreed ops, in cache order). Up
        to RIDER_ELEMENTS in all, or a larger burst in float32 or float64 alone up to
        PREDICTED_BYTES; a burst larger still negotiates in full for BURST_ROUNDS rounds
        (where it rides the allgather, see :mod:`eager`)."""
        keys = self.cache.keys
        layout = [_rider(index, keys[index], request) for index, request in ops if rides(request)]
        total = sum(rider.numel for rider in layout)
        if total > RIDER_ELEMENTS:
            dtypes = {rider.dtype for rider in layout}
            dtype = dtypes.pop() if len(dtypes) == 1 else None
            if (
                dtype is None
                or dtype not in (torch.float32, torch.float64)
                or total * dtype.itemsize > PREDICTED_BYTES
            ):
                self._full_left = BURST_ROUNDS
                layout = []
        return layout


_FIRST = operator.itemgetter(0)  # (a C call per op, where a def would be a Python one)


def _indices(ops: list[tuple[int, int]]) -> tuple[int, ...]:
    """A round's ops as their cache indices (counters left out): what its riders follow."""
    return tuple(map(_FIRST, ops))


def _steps(last: list[tuple[int, int]], current: list[tuple[int, int]]) -> list[int] | None:
    """How far each op's counter moved from the ``last`` round to the ``current`` one, when
    they held the same ops (0 for named ops; more than 0 for unnamed ones); else None."""
    if len(last) != len(current):
        return None
    steps = []
    for (index, counter), (last_index, last_counter) in zip(current, last, strict=True):
        step = counter - last_counter
        if index != last_index or (step <= 0 if counter else last_counter != 0):
            return None
        steps.append(step)
    return steps


def _repeated_steps(history: list[_Round], period: int) -> list[list[int]] | None:
    """How far each of the last ``period`` rounds' counters moved from the round ``period``
    before it; None unless each held that round's ops (see :func:`_steps`)."""
    found = []
    for earlier, round_ in zip(history[-2 * period : -period], history[-period:], strict=True):
        steps = _steps(earlier.ops, round_.ops)
        if steps is None:
            return None
        found.append(steps)
    return found


def _moved(ops: list[tuple[int, int]], steps: list[int]) -> list[tuple[int, int]]:
    """The ops of the round after ``ops``: unnamed ones' counters moved on by ``steps``."""
    return [(index, counter + step) for (index, counter), step in zip(ops, steps, strict=True)]


_SUM = int(ReduceOp.SUM)


def _check_inputs(requests: Sequence[Request]) -> None:
    for request in requests:
        check_unchanged(request, 0)


def _finish_rider(request: Request, summed: torch.Tensor, size: int) -> None:
    """Completes a rider from its summed data (float32 or 64; in its shape or flat, and
    possibly a buffer that is reused: the result never aliases it)."""
    out = request.outputs[0]
    if out is not None:
        _finish_out(out, summed, request.reduction, size)
        return
    spec = request.specs[0]
    result = summed.to(spec.dtype, copy=True)
    request.reduction.finish(result, size)
    request.outputs[0] = result.view(spec.shape)


def _finish_out(out: torch.Tensor, summed: torch.Tensor, reduction: Reduction, size: int) -> None:
    """A rider's result from its summed data into its given output."""
    if reduction.op == _SUM and reduction.postscale == 1.0:  # (plain_sum, without a call)
        out.copy_(summed if summed.shape == out.shape else summed.view(out.shape))  # casts
        return
    result = summed.to(out.dtype, copy=True)
    reduction.finish(result, size)
    out.copy_(result.view(out.shape))
