"""The worker side of hvdrun: Horovod's API on one engine over torch.distributed.

Users import a frontend: ``import collectives.torch as hvd`` (PyTorch). The package is in
layers that import only downward (``tests/test_layers.py`` checks it on the source):

=================== =========================================================================
frontends           ``torch/`` (Horovod's ``horovod.torch`` API: ops with autograd, the
                    optimizers, SyncBatchNorm, elastic state); frontends sit side by side and
                    never import each other
process sets        ``process_sets``: registering and removing sets (a negotiated op)
submission          ``ops``: argument checks and requests over torch tensors, the
                    framework-neutral way every frontend reaches the engine
runtime             ``runtime/``: joining the job (hvdrun's rendezvous, another launcher, or
                    alone), the rank queries, the engine's process groups
engine              ``engine/``: the one engine of the process: negotiation, fusion,
                    execution, response cache, autotune, stall inspector, timeline; torch
                    tensors are its buffer type and it knows no frontend's API
leaves              ``errors`` (Horovod's exceptions), ``common`` (``ReduceOp``,
                    ``ProcessSet``), ``adasum`` (the math)
=================== =========================================================================

A process that uses two frameworks has one runtime and one engine: every frontend asks the
runtime for the same running engine.
"""
