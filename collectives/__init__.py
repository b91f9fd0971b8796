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

from __future__ import annotations

import importlib.util as _importlib_util
import os as _os
import sys as _sys

#: what a frontend needs, by module: its name for people, and how to install it
_FRAMEWORKS = {
    "torch": ("PyTorch", "pip install torch (or the build for your CUDA version from pytorch.org)"),
    "tensorflow": (
        "TensorFlow (>= 2.20)",
        "pip install 'hvdrun[tensorflow]' (or tensorflow-cpu, or 'tensorflow[and-cuda]' on GPUs)",
    ),
}


def _hidden_package(name: str) -> ImportError | None:
    """The error for a ``name`` (a package of hvdrun that the worker side imports) that Python
    finds somewhere other than beside this package: a user's ``rendezvous.py`` next to the
    training script comes first on ``sys.path`` and hides hvdrun's own."""
    ours = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
    spec = _importlib_util.find_spec(name)
    if spec is None or spec.origin is None:
        return None  # not found (its import says so), or a namespace: never hides a package
    where = spec.origin  # a module file; a package's __init__.py:
    if spec.submodule_search_locations:
        where = _os.path.dirname(where)
        if _os.path.dirname(_os.path.realpath(where)) == ours:
            return None
    return ImportError(
        f"collectives needs hvdrun's package {name!r} ({_os.path.join(ours, name)}), but Python "
        f"finds {where} first: a file or folder of that name in the script's directory (which "
        "Python puts first on sys.path) or on PYTHONPATH hides it; rename it",
        name=name,
    )


if _hidden := _hidden_package("rendezvous"):
    raise _hidden


def missing_framework(module: str, frontend: str) -> ModuleNotFoundError | None:
    """The error ``frontend`` raises before its own imports when ``module`` (``torch`` or
    ``tensorflow``) cannot be imported by this Python: one line that names the Python and
    what to install, rather than a traceback ending in some inner module's import."""
    if _importlib_util.find_spec(module) is not None:
        return None
    name, install = _FRAMEWORKS[module]
    return ModuleNotFoundError(
        f"{frontend} needs {name}, which this Python ({_sys.executable}) cannot import: {install}",
        name=module,
    )
