"""A ``torch.distributed.Store`` on top of the rendezvous server's key-value service.

torch.distributed bootstraps its process groups through a store: Gloo publishes each rank's
address under keys like ``0//cpu//0/<rank>`` and reads its peers'; NCCL passes its unique ID
the same way. Pointing ``init_process_group(store=...)`` at the rendezvous means workers need
no extra port, no MASTER_ADDR, and no TCPStore of their own: the launcher's server already is
the job's meeting point, and it already checks the job secret.

What torch 2.13's C++ side (the ``PythonStore`` trampoline) expects of a Python store, and so
what this class provides:

* ``set``/``get``/``add``/``compare_set``/``check``/``wait``/``clone`` are called by their
  Python names; the key count and deletion by their C++ names ``getNumKeys``/``deleteKey``.
  Both spellings are defined so Python callers (``num_keys``/``delete_key``) work too.
* ``wait(keys)`` and ``wait(keys, timedelta)`` both happen: ``timeout`` is optional.
* ``get`` must block until the key exists (NCCL reads its unique ID with ``get`` alone) and
  give up after the store's timeout (``self.timeout``, changed with ``set_timeout``).
* Values arrive as ``bytes`` from C++ and sometimes as ``str`` from Python (torch's
  ``_store_based_barrier`` sets ``"1"``); both are stored as bytes.
* ``multi_get``/``multi_set`` are one batched call each (``MultiGet``/``MultiSet``);
  ``append`` is built from compare-and-set; ``has_extended_api`` stays False so Gloo takes
  its plain bootstrap path.
* NCCL calls the store from C++ background threads (its watchdog and heartbeat monitor,
  which poll for a "dump" flag), so the store is thread-safe (a thread-safe client, an
  immutable prefix) and never raises into those threads: a call from a thread Python did
  not start that fails (the rendezvous stopped, gone, or the client closed at shutdown) is
  logged once and gets a neutral answer (``check`` False, ``get`` empty, ``wait`` returns),
  which torch's callers take as "no flag set". The runtime also turns that polling off
  (``TORCH_NCCL_DUMP_ON_TIMEOUT=0`` unless the user set it) and destroys the process groups
  before it closes the client, so no C++ thread is inside the store while the interpreter
  shuts down (a C++ thread entering Python then aborts the process).

**Gloo's full mesh in few calls.** torch 2.13's Gloo bootstraps a group of N ranks on a
Python store with ``wait([p/i])`` then ``get(p/i)`` for every i in 0..N-1, one key at a time
(it never asks for ``multi_get``): 2N calls per rank, 2N^2 for the job. So a single-key
``wait`` here reads the value, and with it the values of the key's numbered siblings after it
(``p/i+1``, ``p/i+2``, ... that are set at that moment, up to the first absent one: the
server's read-ahead). The rule, per store object and per thread:

* ``get(k)`` right after ``wait([k])`` returns the value the wait read;
* ``wait([k])`` for a sibling read ahead returns at once (the key was set when it was read);
* any other call on that thread, or a ``get``/``wait`` of another key, drops what was read.

So a rank's whole sweep costs one call per gap it meets (usually one). Observably this
differs from asking the server each time only when one of those keys is rewritten or
deleted between the read and its ``wait``/``get`` — which torch's bootstrap keys never are:
each is written once, by its rank, under a prefix of its own group (a store that reused a
group's keys would race the same way on a TCPStore).

Every key gets ``prefix`` prepended: a new prefix per generation keeps a re-initialised job
from reading the previous generation's keys (torch's group counter restarts at 0).

Keep a Python reference to the store for as long as its process group lives.
"""

from __future__ import annotations

import datetime
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from rendezvous.client import (
    RendezvousClient,
    RendezvousError,
    RendezvousTimeout,
    RendezvousUnavailable,
)

__all__ = ["RendezvousStore"]

logger = logging.getLogger(__name__)

# torch raises DistStoreError (a RuntimeError) on store timeouts; older versions lack it.
_StoreError: type[RuntimeError] = getattr(dist, "DistStoreError", RuntimeError)
_NetworkError: type[RuntimeError] = getattr(dist, "DistNetworkError", _StoreError)

# torch's Store::kNoTimeout (0 ms) means "wait without limit"; we wait this long instead.
_NO_TIMEOUT_SECONDS = 365 * 24 * 3600.0

# How many numbered siblings a single-key wait asks the server to read ahead (the server also
# stops at the first absent key and at its value-size limit).
_READ_AHEAD = 65536


def _as_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    return bytes(value)


def _seconds(timeout: datetime.timedelta | float | None, default: datetime.timedelta) -> float:
    if timeout is None:
        timeout = default
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    return _NO_TIMEOUT_SECONDS if seconds <= 0 else float(seconds)


def _siblings(prefix: str, full_key: str, values: Sequence[bytes]) -> dict[str, bytes]:
    """``{k: value}`` for the store keys ``k`` (under ``prefix``) of the server's read-ahead
    ``values``: those of ``p/i+1``, ``p/i+2``, ... for ``full_key`` = ``p/i``. Numbered from
    the full key, as the server numbers them: a prefix that ends in digits (``run/1``) makes
    the number span prefix and key, and its later siblings (``run/20``) are another prefix's
    keys, not this store's."""
    last = full_key.rpartition("/")[2]
    if not values or not (last.isascii() and last.isdigit()):
        return {}
    base, number, skip = full_key[: len(full_key) - len(last)], int(last), len(prefix)
    found: dict[str, bytes] = {}
    for j, value in enumerate(values, 1):
        sibling = f"{base}{number + j}"
        if not sibling.startswith(prefix):
            break  # (the numbers only grow: none after it is this store's either)
        found[sibling[skip:]] = value
    return found


_DummyThread: type = getattr(threading, "_DummyThread", type(None))


def _python_thread() -> bool:
    """Whether Python started the calling thread (torch's C++ threads show up as dummies)."""
    return not isinstance(threading.current_thread(), _DummyThread)


def _neutral_to_torch_threads(answer: Any) -> Callable[[Any], Any]:
    """Wraps a store method so that, called from a thread Python did not start (NCCL's
    watchdog or monitor), a failure is logged once and returns ``answer`` (called, when it
    is a type) instead of raising into C++."""

    def wrap(method: Any) -> Any:
        @functools.wraps(method)
        def call(self: RendezvousStore, *args: Any, **kwargs: Any) -> Any:
            if _python_thread():
                return method(self, *args, **kwargs)
            try:
                return method(self, *args, **kwargs)
            except Exception as error:
                self._note_background_failure(method.__name__, error)
                return answer() if isinstance(answer, type) else answer

        return call

    return wrap


class RendezvousStore(dist.Store):
    """torch.distributed Store backed by a :class:`RendezvousClient`, keys under ``prefix``."""

    def __init__(
        self,
        client: RendezvousClient,
        prefix: str = "",
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
    ) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix
        self._read = threading.local()  # per thread: see "Gloo's full mesh" above
        self._background_failed = threading.Event()  # (logged once)
        self._clones: list[RendezvousStore] = []  # (see clone)
        self.set_timeout(timeout)

    def __repr__(self) -> str:
        return f"RendezvousStore(prefix={self._prefix!r}, client={self._client!r})"

    @property
    def prefix(self) -> str:
        return self._prefix

    def _store_timeout(self) -> datetime.timedelta:
        """The store timeout, kept by torch's C++ base class (``set_timeout`` changes it)."""
        timeout: datetime.timedelta = self.timeout  # type: ignore[attr-defined]
        return timeout

    def _key(self, key: str) -> str:
        return self._prefix + key

    # ---- values read by a wait (the rule in the module docstring) -------------------------

    def _forget(self) -> None:
        """Drops what this thread's last wait read (every call but wait/get does this)."""
        self._read.__dict__.clear()

    def _waited_value(self, key: str) -> bytes | None:
        """The value a ``wait([key])`` just read for this thread (taken once), else None;
        drops everything read when the key is another one."""
        read = self._read.__dict__
        if read.get("waited") == key:
            del read["waited"]
            value: bytes = read.pop("value")
            return value
        read.clear()
        return None

    def _wait_one(self, key: str, seconds: float) -> None:
        read = self._read.__dict__
        ahead: dict[str, bytes] = read.get("ahead", {})
        value = ahead.pop(key, None)
        read.clear()
        if value is None:
            full_key = self._key(key)
            value, values = self._client.get_ahead(full_key, seconds, _READ_AHEAD)
            ahead = _siblings(self._prefix, full_key, values)
        read.update(waited=key, value=value, ahead=ahead)

    def _note_background_failure(self, call: str, error: Exception) -> None:
        if not self._background_failed.is_set():
            self._background_failed.set()
            logger.info(
                "a torch background thread's %s on the rendezvous store (prefix %r) failed "
                "(%s); such calls get a neutral answer",
                call,
                self._prefix,
                error,
            )

    def _fail(self, error: RendezvousError) -> RuntimeError:
        """The torch-style exception for a failed rendezvous call (the client's message names
        the call, the full key and the timeout)."""
        # Timeouts are DistStoreError, as with torch's own stores.
        cls = _NetworkError if isinstance(error, RendezvousUnavailable) else _StoreError
        return cls(f"rendezvous store (prefix {self._prefix!r}): {error}")

    # ---- the basic Store API -----------------------------------------------------------

    @_neutral_to_torch_threads(None)
    def set(self, key: str, value: bytes | str) -> None:
        self._forget()
        try:
            self._client.set(self._key(key), _as_bytes(value))
        except RendezvousError as error:
            raise self._fail(error) from error

    @_neutral_to_torch_threads(b"")
    def get(self, key: str) -> bytes:
        """The key's value; blocks until it is set, up to the store timeout."""
        value = self._waited_value(key)
        if value is not None:
            return value
        timeout = _seconds(None, self._store_timeout())
        try:
            return self._client.get(self._key(key), timeout)
        except RendezvousError as error:
            raise self._fail(error) from error

    @_neutral_to_torch_threads(0)
    def add(self, key: str, value: int) -> int:
        self._forget()
        try:
            return self._client.add(self._key(key), int(value))
        except RendezvousError as error:
            raise self._fail(error) from error

    @_neutral_to_torch_threads(b"")
    def compare_set(
        self, key: str, expected_value: bytes | str, desired_value: bytes | str
    ) -> bytes:
        self._forget()
        try:
            return self._client.compare_set(
                self._key(key), _as_bytes(expected_value), _as_bytes(desired_value)
            )
        except RendezvousError as error:
            raise self._fail(error) from error

    @_neutral_to_torch_threads(False)
    def check(self, keys: Sequence[str]) -> bool:
        self._forget()
        try:
            return self._client.check([self._key(key) for key in keys])
        except RendezvousError as error:
            raise self._fail(error) from error

    @_neutral_to_torch_threads(None)
    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | float | None = None) -> None:
        """Blocks until every key is set, up to ``timeout`` (default: the store timeout)."""
        keys = list(keys)
        seconds = _seconds(timeout, self._store_timeout())
        try:
            if len(keys) == 1:
                self._wait_one(keys[0], seconds)
                return
            self._forget()
            self._client.wait([self._key(key) for key in keys], seconds)
        except RendezvousError as error:
            raise self._fail(error) from error

    @_neutral_to_torch_threads(False)
    def delete_key(self, key: str) -> bool:
        self._forget()
        try:
            return self._client.delete(self._key(key))
        except RendezvousError as error:
            raise self._fail(error) from error

    def deleteKey(self, key: str) -> bool:  # the name torch's C++ side calls
        return self.delete_key(key)

    @_neutral_to_torch_threads(0)
    def num_keys(self) -> int:
        """Keys in the whole rendezvous store (every prefix), like a shared TCPStore."""
        self._forget()
        try:
            return self._client.num_keys()
        except RendezvousError as error:
            raise self._fail(error) from error

    def getNumKeys(self) -> int:  # the name torch's C++ side calls
        return self.num_keys()

    def clone(self) -> RendezvousStore:
        """A new store object sharing the client, prefix and timeout (torch clones a group's
        store to split the group: ``ProcessGroup.split_group``, ``dist.split_group``). Kept
        referenced by this store: torch holds only the clone's C++ half, and a Python store
        whose Python object is gone fails on its first call (see the module docstring)."""
        clone = RendezvousStore(self._client, self._prefix, self._store_timeout())
        self._clones.append(clone)
        return clone

    # ---- the extended API, on top of the basic calls -----------------------------------

    def has_extended_api(self) -> bool:
        # torch 2.13's Gloo never asks a Python store (it reads peer by peer regardless), and
        # False keeps the plain bootstrap path that every torch version takes.
        return False

    @_neutral_to_torch_threads(list)
    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """Every key's value, in one call; blocks like :meth:`get` until all are set."""
        self._forget()
        timeout = _seconds(None, self._store_timeout())
        try:
            return self._client.multi_get([self._key(key) for key in keys], timeout)
        except RendezvousError as error:
            raise self._fail(error) from error

    @_neutral_to_torch_threads(None)
    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        self._forget()
        if len(keys) != len(values):  # (a DistStoreError, as torch's own stores raise)
            raise _StoreError(f"multi_set: {len(keys)} keys but {len(values)} values")
        try:
            self._client.multi_set(
                [self._key(key) for key in keys], [_as_bytes(value) for value in values]
            )
        except RendezvousError as error:
            raise self._fail(error) from error

    @_neutral_to_torch_threads(None)
    def append(self, key: str, value: bytes | str) -> None:
        """Appends to the key's value (creating it), by compare-and-set retries.

        The proto has no append, so this reads the value and swaps in the longer one until no
        other writer came in between. (Two concurrent appends that produce identical bytes can
        still be taken for one: compare-and-set cannot tell them apart.)
        """
        self._forget()
        suffix = _as_bytes(value)
        full_key = self._key(key)
        try:
            try:
                current = self._client.get(full_key, 0)
            except RendezvousTimeout:
                current = b""
            while True:
                desired = current + suffix
                result = self._client.compare_set(full_key, current, desired)
                if result == desired:
                    return
                # An answer equal to `expected` means the key has vanished (TCPStore rules).
                current = b"" if result == current else result
        except RendezvousError as error:
            raise self._fail(error) from error
