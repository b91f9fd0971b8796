"""The worker runtime users import: ``import collectives.torch as hvd``."""
