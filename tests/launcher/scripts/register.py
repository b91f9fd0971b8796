"""Registers with the rendezvous like hvd.init() does, without torch (starts fast)."""

import os
import socket
import time

from rendezvous.client import RendezvousClient

rank = int(os.environ["HVDRUN_RANK"])
time.sleep(float(os.environ.get("REGISTER_DELAY", "0")) * rank)
client = RendezvousClient.from_environment()  # relay, or the server (TLS where it speaks it)
info = client.register(os.environ["HVDRUN_HOSTNAME"], int(os.environ["HVDRUN_LOCAL_RANK"]))
print(f"registered rank {info.rank} on {socket.gethostname()}", flush=True)
if os.environ.get("SHOW_SECRET"):  # (a test that looks for it everywhere else)
    print(f"the secret is {os.environ['HVDRUN_SECRET']}", flush=True)
time.sleep(float(os.environ.get("STAY", "0")))
client.close()
