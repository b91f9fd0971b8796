"""The agent side of hvdrun: what runs on every host of a job (``python -m launcher.agent``).

* :mod:`launcher.agent.session` - one agent's life: hello, one request, the workers, done
* :mod:`launcher.agent.workers` - starting one host's workers, draining and stopping them
* :mod:`launcher.agent.probe` - ``--check-hosts``' description of the host

The agent starts on every host before any worker, so it must start fast: it imports neither
paramiko, grpc nor torch (only ``python -m launcher.agent.probe``, a child of the probe,
imports torch). From the rest of the launcher it uses only the light leaf modules it shares
with hvdrun's side: the wire protocol (:mod:`launcher.transport.protocol`), host facts
(:mod:`launcher.transport.hostinfo`), the environment rules (:mod:`launcher.spec.environment`)
and the line splitter (:mod:`launcher.output`).
"""
