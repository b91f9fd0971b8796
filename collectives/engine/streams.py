"""CUDA streams and events on the engine's hot path, at a fraction of ``torch.cuda``'s cost.

``torch.cuda.current_stream()`` and the ``torch.cuda.stream()`` context cost 8-10 µs of
Python each on a GPU machine (device checks, lazy-init checks, a new Stream object per
call), as much as an NCCL launch. The engine asks for the current stream on every CUDA op
and switches streams around every bucket, so here:

* :func:`current` answers from the raw ``cudaStream_t`` of the thread's current stream
  (one C call), with the Stream object kept per (device, raw stream);
* :func:`switch` makes a stream current and returns the one it replaced, for
  :func:`switch` back (no context object, no device check: the engine's streams are its
  own, on the device of the bucket);
* :func:`wait` orders the current stream after an op's event, once per event and stream;
* :func:`ready` is what a submission records: the submitting stream, and for an op that
  runs later (asynchronous) an event at its position (a bucket waits only for the last
  such event of each submitting stream). A blocking op records no event: its
  caller waits on it at once and queues nothing behind it, so the stream's position when
  the op runs is its position at submission;
* :class:`EngineStreams` decides where a bucket runs. Blocking ops submitted from the
  current stream of the thread that runs the bucket (a synchronous ``hvd.allreduce`` run
  by its caller's own thread) run on that stream: it is ordered after their inputs already.
  Any other bucket runs on the engine's own stream of the device, which first waits for
  each op's position on its submitting stream, so that communication overlaps the kernels
  the user queues next. A bucket that runs on another stream than the device's previous
  bucket first waits for that one's end (:func:`after_previous`): buckets share the
  executor's fusion buffer. The tensors a bucket used on the engine's stream stay
  referenced until its kernels ended (:meth:`EngineStreams.keep`), instead of a
  ``record_stream`` call per tensor.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collectives.engine.requests import Request

__all__ = ["EngineStreams", "computed", "current", "ready", "switch", "used_on", "wait"]

#: (device index, raw stream) -> torch.cuda.Stream. Bounded: streams are pooled by torch,
#: so a program uses few; external streams could come and go.
_known: dict[tuple[int, int], Any] = {}
_KNOWN_MAX = 256

_raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_device = getattr(torch._C, "_cuda_getDevice", None)  # (current_device() without its checks)


def current(device: int) -> Any:
    """The current stream of this thread on CUDA device ``device`` (an index)."""
    if _raw is None:  # (a torch without the raw lookup)
        return torch.cuda.current_stream(device)
    key = (device, _raw(device))
    stream = _known.get(key)
    if stream is None:
        if len(_known) >= _KNOWN_MAX:
            _known.clear()
        stream = _known[key] = torch.cuda.current_stream(device)
    return stream


def switch(stream: Any) -> Any:
    """Makes ``stream`` current on its device for this thread; returns the stream that was
    current there before (to switch back to)."""
    before = current(stream.device_index)
    if before is not stream:
        torch.cuda.set_stream(stream)
    return before


def wait(event: Any) -> None:
    """Orders this thread's current stream (of the current device) after ``event``. A
    stream that already waits for it costs no call: the handles of one bucket share its
    event, and a burst's waiter waits on each handle in turn."""
    device = _device() if _device is not None else torch.cuda.current_device()
    stream = current(device)
    if getattr(event, "waiter", None) is stream:
        return
    event.wait(stream)
    event.waiter = stream  # (an engine's event is recorded once: its waiters stay waiting)


#: At most this many buckets' tensors are held for the GPU (:meth:`EngineStreams.keep`):
#: a bound for a GPU that stopped, far above what a training step keeps in flight (a
#: gradient bucket is 4 MiB), so that the host never waits for the GPU in a step.
KEEP_MAX = 4096

#: Per device: events that marked a submission's position and were waited for already, to
#: record again (cudaStreamWaitEvent captures the event's last record at the call, so a later
#: record does not move a wait already queued). Creating an event cost 2 us of the 3 an op's
#: event took on an H100. Bounded, and any thread pops or appends (atomic under the GIL).
_spare: dict[int, list[Any]] = {}
_SPARE_MAX = 1024


#: Numbers the submissions' events in the order they were recorded (``event.order``), under
#: ``_recording``: threads that share a stream (the default one) record in that order too.
_orders = itertools.count()
_recording = threading.Lock()


def ready(tensor: torch.Tensor, blocking: bool) -> tuple[Any, Any]:
    """(the submitting stream, the event recorded on it or None when ``blocking``) for an
    op on the CUDA tensor ``tensor``."""
    device = tensor.get_device()
    stream = current(device)
    if blocking:
        return stream, None
    spare = _spare.get(device)
    event: Any = spare.pop() if spare else torch.cuda.Event()
    with _recording:
        event.record(stream)
        event.order = next(_orders)
    return stream, event


def computed(event: Any, stream: Any, home: Any, compute: Callable[[], Any]) -> tuple[Any, Any]:
    """Runs ``compute`` (torch calls on what the kernels before ``event`` wrote) on
    ``stream``, the one that ran them (the submitting stream ``home`` goes on with the
    caller's kernels meanwhile), ordered after ``event``; its results are marked as used by
    ``home``, where the caller uses and frees them. Returns the result and the event after
    its kernels, for whoever waits on it."""
    before = switch(stream)
    try:
        stream.wait_event(event)
        result = compute()
        if home is not None and home is not stream:
            used_on(result, home)
        return result, _recorded(stream)
    finally:
        switch(before)


def used_on(result: Any, stream: Any) -> None:
    """Marks the CUDA tensors of ``result`` (a tensor, sparse or dense, or a list or tuple of
    them) as used by ``stream``: the caching allocator reuses their memory only after the
    work queued there by the time they are freed."""
    if isinstance(result, (list, tuple)):
        for item in result:
            used_on(item, stream)
    elif getattr(result, "is_cuda", False):
        if getattr(result, "layout", None) is torch.sparse_coo:
            result._indices().record_stream(stream)
            result._values().record_stream(stream)
        else:
            result.record_stream(stream)


def _wait_for_positions(requests: Sequence[Request], stream: Any) -> None:
    """``stream`` waits for the requests' positions on their submitting streams: for the
    last one recorded on each (a stream runs in order, so the earlier ones are passed by
    then: one wait for a burst, not one per op). Their events are spare from then on."""
    latest: dict[int, Any] = {}  # by id of the submitting stream
    for request in requests:
        event = request.ready
        if event is not None:
            key = id(request.stream)
            held = latest.get(key)
            if held is None or event.order > held.order:
                latest[key] = event
    for event in latest.values():
        stream.wait_event(event)
    if latest:  # (one bucket's submissions are on its device)
        spare = _spare.setdefault(stream.device_index, [])
        spare.extend(r.ready for r in requests if r.ready is not None)
        del spare[_SPARE_MAX:]


def after_previous(stream: Any, previous: tuple[Any, Any] | None) -> None:
    """Orders ``stream`` after the previous bucket of its device (``previous``: the stream it
    ran on and the event after its last kernel), where that ran on another stream: the two
    share the fusion buffer (one round can run a blocking op's bucket on its caller's stream
    and asynchronous ones on the engine's)."""
    if previous is not None and previous[0] is not stream:
        stream.wait_event(previous[1])


class EngineStreams:
    """The engine's own CUDA stream per device (one process set's executor), and where each
    bucket runs (see the module's docstring)."""

    def __init__(self) -> None:
        self._own: dict[torch.device, Any] = {}
        #: Per device: (stream, event after the last kernel) of the latest bucket.
        self._previous: dict[torch.device, tuple[Any, Any]] = {}
        #: (an event, its stream, what it keeps alive until it passed): see :meth:`keep`.
        self._in_use: collections.deque[tuple[Any, Any, Any]] = collections.deque()

    def keep(self, event: Any, stream: Any, held: Any) -> None:
        """Keeps ``held`` (a tensor, or requests holding tensors) referenced until ``event``
        (recorded on ``stream``) has passed on the GPU. The caching allocator hands a freed
        tensor's memory to the next allocation on the stream it was allocated on, so a
        tensor that the engine's stream still reads or writes must stay referenced until
        then. That costs one ``query()`` per bucket, where ``record_stream`` cost a call of
        about 1 µs per tensor (torch's NCCL backend does the same under
        ``TORCH_NCCL_AVOID_RECORD_STREAMS``). What passed is let go at the next bucket or
        cycle (:meth:`let_go`); past ``KEEP_MAX`` buckets the host waits for the oldest."""
        self.let_go()
        in_use = self._in_use
        if len(in_use) >= KEEP_MAX:
            in_use.popleft()[0].synchronize()
        in_use.append((event, stream, held))

    def let_go(self) -> None:
        """Drops what the passed events kept (oldest first: one stream's events pass in
        order)."""
        in_use = self._in_use
        while in_use and in_use[0][0].query():
            in_use.popleft()

    def retire(self, device: torch.device, tensor: torch.Tensor) -> None:
        """``tensor`` (a fusion buffer being replaced) is no longer used after the latest
        bucket of ``device``: kept until that bucket's end."""
        previous = self._previous.get(device)
        if previous is not None:
            self.keep(previous[1], previous[0], tensor)

    def release(self) -> None:
        """The owner is done with its streams (its process group goes): what is still held
        is marked in use by its stream instead (``record_stream``), so that letting it go
        cannot free memory that kernels still use, without waiting for them (a collective
        of a failed job may never end)."""
        self.let_go()
        while self._in_use:
            _, stream, held = self._in_use.popleft()
            used_on(_tensors(held), stream)

    @contextlib.contextmanager
    def running(self, requests: Sequence[Request], device: torch.device) -> Iterator[list[Any]]:
        """Runs the body (one bucket of ``requests`` on CUDA ``device``) on its stream;
        yields a list that then holds the event after the bucket's last kernel."""
        done: list[Any] = []
        here = current(device.index if device.index is not None else torch.cuda.current_device())
        own = not all(r.ready is None and r.stream is here for r in requests)
        stream, before = here, None
        if own:
            stream = self._own.get(device)
            if stream is None:
                stream = self._own[device] = torch.cuda.Stream(device)
            before = switch(stream)
        try:
            after_previous(stream, self._previous.get(device))
            if own:
                _wait_for_positions(requests, stream)
                for request in requests:
                    submitted = request.stream
                    if request.ready is None and submitted is not None and submitted is not stream:
                        # A blocking op from another thread: its caller waits and queues
                        # nothing, so its stream's position now is its position at submission.
                        stream.wait_stream(submitted)
                    # Later buckets of the op run on this stream too, with nothing to wait for.
                    request.stream, request.ready = stream, None
            yield done
        finally:
            # Also when the bucket failed partway: the kernels it queued may still run.
            # On its own stream, the requests hold the tensors that stream used (inputs and
            # outputs), which were allocated on other streams.
            self._ended(device, stream, requests if own else None, done)
            if before is not None:
                switch(before)

    def _ended(
        self, device: torch.device, stream: Any, held: Sequence[Request] | None, done: list[Any]
    ) -> None:
        """A bucket on ``stream`` ended (or failed): the event after its kernels goes to
        ``done``, becomes the device's latest, and keeps ``held`` until it passed."""
        try:
            end = _recorded(stream)
        except RuntimeError:  # (CUDA itself failed: nothing queued runs any more)
            return
        done.append(end)
        self._previous[device] = (stream, end)
        if held is not None:
            self.keep(end, stream, held)


def _tensors(held: Any) -> Any:
    """The tensors that :meth:`EngineStreams.keep` holds in ``held`` (with CPU tensors, and
    an allgather's outputs, None until it ran: :func:`used_on` passes over them)."""
    if isinstance(held, torch.Tensor):
        return held
    # (in place, the outputs are the inputs' list: one use each)
    return [
        tensor
        for request in held
        for tensor in (
            request.inputs
            if request.outputs is request.inputs
            else (*request.inputs, *request.outputs)
        )
    ]


def _recorded(stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event
