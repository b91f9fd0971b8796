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
* :func:`ready` is what a submission records: the submitting stream, and for an op that
  runs later (asynchronous) an event at its position. A blocking op records no event: its
  caller waits on it at once and queues nothing behind it, so the stream's position when
  the op runs is its position at submission (see ``Executor`` in :mod:`.execute`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["current", "ready", "switch"]

#: (device index, raw stream) -> torch.cuda.Stream. Bounded: streams are pooled by torch,
#: so a program uses few; external streams could come and go.
_known: dict[tuple[int, int], Any] = {}
_KNOWN_MAX = 256

_raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)


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


def ready(tensor: torch.Tensor, blocking: bool) -> tuple[Any, Any]:
    """(the submitting stream, the event recorded on it or None when ``blocking``) for an
    op on the CUDA tensor ``tensor``."""
    stream = current(tensor.get_device())
    if blocking:
        return stream, None
    event = torch.cuda.Event()
    event.record(stream)
    return stream, event
