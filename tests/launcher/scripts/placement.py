"""Reports where this rank runs and checks two collectives across hosts (needs torch)."""

import json
import os
import socket

import torch

import collectives.torch as hvd

hvd.init()
host, port = os.environ["HVDRUN_RENDEZVOUS_ADDR"].rsplit(":", 1)
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
    probe.connect((host.strip("[]"), int(port)))
    address = probe.getsockname()[0]
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
gathered = hvd.allgather(torch.tensor([hvd.rank()]))
report = {
    "rank": hvd.rank(),
    "size": hvd.size(),
    "local_rank": hvd.local_rank(),
    "local_size": hvd.local_size(),
    "cross_rank": hvd.cross_rank(),
    "cross_size": hvd.cross_size(),
    "hostname": socket.gethostname(),
    "address": address,
    "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    "nccl_ifname": os.environ.get("NCCL_SOCKET_IFNAME"),
    "rendezvous": os.environ["HVDRUN_RENDEZVOUS_ADDR"],
    "sum": total.item(),
    "gathered": gathered.tolist(),
}
print("placement " + json.dumps(report), flush=True)
hvd.shutdown()
