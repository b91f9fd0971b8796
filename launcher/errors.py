"""The launcher's one error base, so that callers can catch every user-facing launcher error.

Each error class lives next to the code that raises it and derives from
:class:`LauncherError` (keeping ``ValueError`` where it had it, so existing ``except``
clauses still work). Their messages are written for the user and shown as they are:

* ``HostSpecError``, ``EnvSpecError``: a host list, hostfile or ``-x`` that cannot be used
* ``SSHConnectError``: a host hvdrun could not log in to
* ``AgentStartError``: a host whose agent could not be started
* ``LaunchError``: hosts that could not be started, each with its reason
* ``RendezvousListenError``: the rendezvous server cannot listen where it was told to
* ``LaunchInterrupted``: a signal arrived while the agents were starting
* ``DiscoveryError``: an elastic job's host discovery script failed
"""

from __future__ import annotations


class LauncherError(Exception):
    """A launcher error whose message is for the user (no traceback needed)."""
