"""hvdrun's rendezvous: the gRPC control plane of a job.

The launcher runs a :class:`~rendezvous.server.RendezvousServer` in-process; workers talk to
it through :class:`~rendezvous.client.RendezvousClient`, and torch.distributed bootstraps its
process groups through :class:`~rendezvous.store.RendezvousStore` (the only module here that
imports torch). This package imports neither ``launcher`` nor ``collectives``.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

TOKEN_METADATA_KEY = "x-hvdrun-token"
JOB_METADATA_KEY = "x-hvdrun-job"

#: gRPC's tracers that print every header's value, the job's token included (tried on
#: gRPC 1.85: ``GRPC_TRACE=all`` printed it in full through these two and no other).
HEADER_TRACERS = ("api", "chttp2_hpack_parser")


def _load_grpc_without_header_tracers() -> None:
    """Where ``GRPC_TRACE`` is set (to debug gRPC), imports gRPC with
    :data:`HEADER_TRACERS` turned off: gRPC reads the variable once, at its import, and
    every process of a job (hvdrun, its relays, the workers) imports this package before
    gRPC. The variable is changed only for the import, so children see the job's own."""
    trace = os.environ.get("GRPC_TRACE", "")
    if not trace.strip():
        return
    if "grpc" in sys.modules:
        logging.getLogger(__name__).warning(
            "GRPC_TRACE is set and gRPC was imported before hvdrun's rendezvous: its %s "
            "tracers, where on, print the job's token",
            " and ".join(HEADER_TRACERS),
        )
        return
    os.environ["GRPC_TRACE"] = ",".join([trace, *(f"-{name}" for name in HEADER_TRACERS)])
    try:
        importlib.import_module("grpc")
    finally:
        os.environ["GRPC_TRACE"] = trace


_load_grpc_without_header_tracers()
