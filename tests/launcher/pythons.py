"""Python installations for tests of how a host starts hvdrun's agent: a venv at a path of
the test's choosing, and one whose interpreter starts only with ``LD_LIBRARY_PATH`` set, as
the Python of an Lmod or Spack ``module load python`` does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

#: The name the interpreter of :func:`venv_needing_library_path` loads its libpython by
#: (the same length as ``libpython``, so the name fits where the old one was).
_RENAMED = b"libhvdtpy"


def make_venv(path: Path, with_hvdrun: bool) -> Path:
    """A venv of this interpreter's base Python at ``path``, hvdrun importable through a
    .pth file (``with_hvdrun``); returns its python."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(path)], check=True, timeout=60)
    if with_hvdrun:
        site = Path(sysconfig.get_paths()["purelib"])
        (next(path.glob("lib/python*/site-packages")) / "hvdrun-tests.pth").write_text(
            f"import site; site.addsitedir({str(site)!r})\n"
        )
    return path / "bin" / "python"


def venv_needing_library_path(path: Path, libdir: Path) -> Path:
    """A venv at ``path`` with hvdrun whose python starts only with ``LD_LIBRARY_PATH``
    naming ``libdir``: a copy of the base interpreter that loads its libpython by another
    name, which only ``libdir`` holds (elsewhere the loader says ``error while loading
    shared libraries``). Skips the test where the interpreter has no libpython to load."""
    soname = sysconfig.get_config_var("INSTSONAME") or ""
    base = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    binary = base.read_bytes()
    needed = soname.encode() + b"\0"
    if not sysconfig.get_config_var("Py_ENABLE_SHARED") or needed not in binary:
        pytest.skip(f"{base} loads no libpython (a Python built without --enable-shared)")
    renamed = soname.encode().replace(b"libpython", _RENAMED, 1)
    python = make_venv(path, with_hvdrun=True)
    python.unlink()  # (a link to the base interpreter)
    python.write_bytes(binary.replace(needed, renamed + b"\0"))
    python.chmod(0o755)
    libdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(sysconfig.get_config_var("LIBDIR")) / soname, libdir / renamed.decode())
    return python
