"""The engine: the background machinery that negotiates, fuses and runs every op.

One engine per process, shared by every frontend (PyTorch today; any frontend converts its
tensors to torch tensors, the engine's buffer type). Horovod's semantics live here: named ops
submitted from any thread in any order, a negotiation round per cycle in which the members
of a process set learn what the others submitted and check that they agree, fusion of ready
small tensors into one buffer, and one collective per bucket. Each process set negotiates
among its own members, so an op on a set never waits for a rank outside it.

The parts, bottom up:

* :mod:`.requests` -- what a rank submits and the text that describes it to the others;
  :mod:`.names` -- the counters that name unnamed ops alike on every rank;
  :mod:`.reduction` -- an op and its scaling, and the steps around the collective;
  :mod:`.handles` -- completions of submitted ops, and Horovod's integer handles;
  :mod:`.config` -- the tuning it runs with (``HVDRUN_*``/``HOROVOD_*`` variables);
* :mod:`.negotiation` -- the per-cycle exchange and the table of announced ops;
  :mod:`.fusion` -- which ready tensors travel together;
  :mod:`.execute` -- runs the planned buckets on torch.distributed groups;
  :mod:`.eager` -- small allreduces whose data rides along with the negotiation;
  :mod:`.cache` -- the response cache's table; :mod:`.rounds` -- the rounds that use it
  (ops agreed by one small allreduce, predicted rounds);
  :mod:`.autotune`, :mod:`.stall`, :mod:`.timeline`;
* :mod:`.queue` -- one set's submitted ops; :mod:`.scheduler` -- when its next cycle is due;
  :mod:`.dispatch` -- runs the ops a round made ready; :mod:`.cycle` -- one set's cycles;
  :mod:`.lanes` -- a blocking op's predicted round on the caller's thread;
  :mod:`.controller` -- one set's negotiation: queue, cycles, thread;
* :mod:`.core` -- the :class:`~collectives.engine.core.Engine`: the sets, routing,
  process-set control ops, failure and shutdown.

Who owns which state (each module's docstring says it field by field):

=========================== =================================================================
state                       rule
=========================== =================================================================
a set's queue               every field under the queue's condition (any thread)
a set's cycle runner        whoever holds the set's cycle lock: the set's thread, or a
(table, cache, rounds,      caller that runs the cycle itself; ``pace`` is an immutable
dispatch, executor, stats)  snapshot it publishes for the waiting thread
the table of sets           copy-on-write: replaced whole by the global set's cycle,
                            read as a snapshot by any thread
the timeline                one reference, replaced whole by ``hvd.start_timeline()``,
                            read once per cycle
handles                     completed once by the cycle that ran the op; waited on by callers
=========================== =================================================================

Why it is a layer of its own: the engine is the part with the subtle concurrency, and it is
tested on its own (``tests/collectives/test_engine_parts.py``, ``test_engine_units.py``)
without a job around it. So it depends only downward: torch, the standard library,
``collectives.errors``, ``collectives.common`` and ``rendezvous.worker_env`` (for its
configuration); numpy too, which torch loads anyway (the arrival accounting's arithmetic).
It never imports the runtime or a frontend: the runtime creates the engine and hands it what
it needs, its process groups and the function that makes more of them.
"""
