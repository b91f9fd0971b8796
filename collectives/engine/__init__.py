"""The engine core: the background machinery that negotiates, fuses and runs every op.

Horovod's semantics live here: named ops submitted from any thread in any order, a
negotiation round per cycle in which the ranks learn what the others submitted and check that
they agree, fusion of ready small tensors into one buffer, and one collective per bucket.

* :mod:`.core` -- the :class:`~collectives.engine.core.Engine`: its thread, its cycles,
  readiness, failures, process sets;
* :mod:`.config` -- the tuning it runs with (``HVDRUN_*``/``HOROVOD_*`` variables);
* :mod:`.requests` -- what a rank submits and the text that describes it to the others;
* :mod:`.handles` -- completions of submitted ops, and Horovod's integer handles;
* :mod:`.negotiation` -- the per-cycle exchange and the table of announced ops;
* :mod:`.fusion` -- which ready tensors travel together;
* :mod:`.execute` -- runs the planned buckets on torch.distributed groups;
* :mod:`.eager` -- small allreduces whose data rides along with the negotiation;
* :mod:`.cache` -- the response cache: repeated ops agreed in one small allreduce;
* :mod:`.autotune` -- Bayesian optimisation of the tuning, online;
* :mod:`.stall` -- finds ops that some ranks never submit;
* :mod:`.timeline` -- the Chrome-trace timeline.

Why it is a layer of its own: the engine is the part with the subtle concurrency, and it is
tested on its own (``tests/collectives/test_engine_parts.py``) without a job around it. So it
depends only downward: torch, the standard library, ``collectives.errors``,
``collectives.common`` and ``rendezvous.worker_env`` (for its configuration). It never
imports the process runtime or the public API: the runtime creates the engine and hands it
what it needs, its process groups and the functions that make and destroy more of them.
"""
