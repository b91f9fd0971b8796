"""How a running job is watched: from the agents' events to hvdrun's exit code.

* :mod:`launcher.supervision.core` - what fixed and elastic jobs share
* :mod:`launcher.supervision.fixed` - a fixed job: every rank runs once, the first failure
  stops the job
* :mod:`launcher.supervision.elastic` - an elastic job: hosts fail, join and leave while it runs
* :mod:`launcher.supervision.membership` - the elastic driver's decisions, free of I/O
* :mod:`launcher.supervision.discovery` - host discovery and the blacklist of failed hosts
* :mod:`launcher.supervision.report` - what hvdrun says after a failed job

``launcher.run.run_job`` picks the fixed supervisor or the elastic driver; neither imports
the other.
"""
