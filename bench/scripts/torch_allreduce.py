"""The torch.distributed side of bench/launch.py (torchrun or bare processes, env:// init)."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
value = torch.tensor(1.0)
dist.all_reduce(value)
assert value.item() == dist.get_world_size()
dist.destroy_process_group()
