"""The worker of bench/ssh_launch.py: registers with the rendezvous, prints when, exits.

``--init`` registers through ``hvd.init()`` (torch import, process group and all) instead of
the bare rendezvous client (what hvdrun itself costs).
"""

import os
import sys
import time

if "--init" in sys.argv:
    import torch

    import collectives.torch as hvd

    hvd.init()
    print(f"registered_at {time.time():.6f}", flush=True)
    # One collective before leaving: a rank that exits right after init() can cut a slower
    # peer's Gloo connection set-up short.
    hvd.allreduce(torch.tensor(1.0))
    hvd.shutdown()
else:
    from rendezvous.client import RendezvousClient

    client = RendezvousClient.from_environment()  # relay, or the server (TLS where it speaks it)
    client.register(os.environ["HVDRUN_HOSTNAME"], int(os.environ["HVDRUN_LOCAL_RANK"]))
    print(f"registered_at {time.time():.6f}", flush=True)
    client.close()
