"""What an agent can tell about its host without importing torch: the installed versions.

Versions come from package metadata (the ``dist-info`` directories), which costs a
millisecond, where ``import torch`` costs seconds. Addresses and interfaces are
:mod:`rendezvous.addresses`' (the worker runtime needs them too).
"""

from __future__ import annotations

import os
import platform
import sys


def dist_version(name: str) -> str | None:
    """The installed version of distribution ``name``, as ``importlib.metadata`` finds it.

    Reads the ``NAME-VERSION.dist-info`` directory names on ``sys.path`` first: importing
    ``importlib.metadata`` alone costs more than the agent's whole start-up otherwise does.
    """
    prefix = name.lower().replace("-", "_") + "-"
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for candidate in names:
            if candidate.endswith(".dist-info") and candidate.lower().startswith(prefix):
                return candidate[len(prefix) : -len(".dist-info")]
    from importlib import metadata  # egg-info and other layouts

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def installed_versions() -> dict[str, str | None]:
    """This interpreter's Python version and the hvdrun and torch versions it would import."""
    return {
        "python": platform.python_version(),
        "executable": sys.executable,
        "hvdrun": dist_version("hvdrun"),
        "torch": dist_version("torch"),
    }
