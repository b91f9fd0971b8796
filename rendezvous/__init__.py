"""hvdrun's rendezvous: the gRPC control plane of a job.

The launcher runs a :class:`~rendezvous.server.RendezvousServer` in-process; workers talk to
it through :class:`~rendezvous.client.RendezvousClient`, and torch.distributed bootstraps its
process groups through :class:`~rendezvous.store.RendezvousStore` (the only module here that
imports torch). This package imports neither ``launcher`` nor ``collectives``.
"""

TOKEN_METADATA_KEY = "x-hvdrun-token"
JOB_METADATA_KEY = "x-hvdrun-job"
