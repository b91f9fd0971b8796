"""The rendezvous server: one job's control plane, run inside the launcher process.

Why it looks the way it does:

* It runs a ``grpc.aio`` server on a background asyncio loop in a daemon thread (one loop
  per process, shared by all servers in it). Every blocking call (``Get``/``Wait``/
  ``Barrier``/``Register``/``Watch``) is then a suspended coroutine, not a parked thread, so
  thousands of workers blocked in ``get`` cost a few KB each and no thread pool can run dry.
* Every call is authenticated before its request is even parsed: the job secret (compared
  in constant time) and the job id travel as metadata. A rejected call changes nothing.
* Elastic jobs change membership while they run: the launcher publishes generation after
  generation of the slot table. Survivors of a failure re-register and wait for the next
  one; running workers learn of it on their Watch stream; store calls still waiting on keys
  of an older generation fail at once instead of waiting for their timeout.
* This package must not import torch: the CLI imports it and has to start fast.

The parts, each a module:

* :mod:`.serving` -- :class:`RendezvousServer`, the public API: start, stop, publish, and
  the launcher's thread-safe questions;
* :mod:`.loop` -- the process's one asyncio loop thread, which owns all job state;
* :mod:`.guard` -- the interceptor that checks secret and job id, and the handlers that
  answer requests that do not parse;
* :mod:`.servicer` -- the gRPC servicer: one thin handler per RPC, delegating to the parts;
* :mod:`.kv` -- the key-value store and its barriers;
* :mod:`.membership` -- registration, the slot table and its generations;
* :mod:`.watch` -- the Watch streams and their shared heartbeat pulse;
* :mod:`.common` -- refusals (a part's way to end a call with a status) and quoting.

The rule for threads: all job state (store, barriers, membership, watches) is touched only
on the server's loop, so it needs no lock. Other threads never reach into it: they run a
coroutine on the loop (:meth:`rendezvous.server.loop.LoopThread.run`) and wait for the
answer. The only locks left guard the server's own life cycle (its port, loop and stopped
flag) and the process's loop thread, and the fields they guard are touched under them alone.
Each module's docstring says which thread owns which of its fields.
"""

from rendezvous.server.serving import RendezvousServer

__all__ = ["RendezvousServer"]
