"""The optimizer family behind ``hvd.DistributedOptimizer`` (:mod:`collectives.torch.optimizer`).

* :mod:`.base` -- :class:`~collectives.torch.optim.base.DistributedOptimizerBase`, the class
  mixed in front of the wrapped optimizer's class, and :func:`~collectives.torch.optim.base.wrap`;
* :mod:`.gradient_buckets` -- which gradients travel together, and under which names;
* :mod:`.adasum_optimizer` -- the Adasum optimizer, a subclass of the base.

Why a package apart from the public module: ``optimizer.py`` picks one of these classes, so
they must not import it (the Adasum optimizer used to subclass a private class of the module
that imported it back). These modules sit above the op layer: they submit through
:mod:`collectives.ops` and ask the runtime whether it is initialized; nothing below
imports them.
"""
