"""How hvdrun reaches its hosts: one agent per host, started and spoken to the same way.

* :mod:`launcher.transport.protocol` - the wire protocol: requests and typed events
* :mod:`launcher.transport.connection` - :class:`AgentConnection`, the template every
  transport fills in (reading events, writing requests, heartbeats, start-up errors)
* :mod:`launcher.transport.local` - an agent for this machine, as a subprocess
* :mod:`launcher.transport.remote` - an agent for another host, over one SSH connection
* :mod:`launcher.transport.ssh`, :mod:`launcher.transport.ssh_config` - paramiko connections
  and OpenSSH-style settings
* :mod:`launcher.transport.startup` - starting every host's agent at once, version checks,
  and where the workers reach the rendezvous
* :mod:`launcher.transport.hostinfo` - versions and interfaces, shared with the agent

Another way of starting agents (srun inside a Slurm allocation, for example) is one more
:class:`AgentConnection` variant here; supervision does not change. Only ``remote`` and
``ssh`` import paramiko, and only when a host is remote.
"""
