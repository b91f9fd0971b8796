"""hvdrun: Horovod-style distributed training launcher on torch.distributed."""

__version__ = "0.1.0"
