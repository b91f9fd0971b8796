"""hvdrun: Horovod-style distributed training launcher on torch.distributed.

``hvdrun.run(fn, num_proc=N, ...)`` runs a Python function on many processes and returns
what each returned (Horovod's ``horovod.run``; :mod:`hvdrun.api`). It is imported when first
used, so that ``import hvdrun`` stays as light as the CLI needs.
"""

from typing import TYPE_CHECKING, Any

from hvdrun.version import __version__

if TYPE_CHECKING:
    from hvdrun.api import JobFailed, run

__all__ = ["JobFailed", "__version__", "run"]


def __getattr__(name: str) -> Any:
    if name in ("run", "JobFailed"):
        from hvdrun import api

        return getattr(api, name)
    raise AttributeError(f"module 'hvdrun' has no attribute {name!r}")
