"""The hvdrun side of bench/launch.py: init, allreduce one scalar, exit."""

import torch

import collectives.torch as hvd

hvd.init()
total = hvd.allreduce(torch.tensor(1.0), op=hvd.Sum)
assert total.item() == hvd.size()
hvd.shutdown()
