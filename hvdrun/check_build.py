"""``hvdrun --check-build``: what this installation can run, Horovod-style.

The only part of the CLI that imports torch (the launcher itself must start fast).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

from hvdrun.version import __version__
from rendezvous import launchers


def _mark(available: bool) -> str:
    return "[X]" if available else "[ ]"


def _version(*distributions: str) -> str | None:
    """The installed version of the first distribution found (read from its metadata:
    TensorFlow takes seconds to import, its version nothing)."""
    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _keras_backend() -> str:
    """Keras 3's backend as it would pick it: KERAS_BACKEND, else its config file."""
    name = os.environ.get("KERAS_BACKEND")
    if name:
        return name
    config = Path(os.environ.get("KERAS_HOME", Path.home() / ".keras")) / "keras.json"
    try:
        return str(json.loads(config.read_text()).get("backend", "tensorflow"))
    except (OSError, ValueError):
        return "tensorflow"


def framework_lines() -> Iterator[str]:
    """TensorFlow and Keras, as collectives.tensorflow and collectives.keras see them."""
    tf_version = _version("tensorflow", "tensorflow-cpu", "tensorflow_cpu")
    keras_version = _version("keras")
    tf_keras = _version("tf_keras", "tf-keras")
    if tf_version:
        yield f"    [X] TensorFlow {tf_version} (collectives.tensorflow)"
    else:
        yield (
            "    [ ] TensorFlow (not installed: pip install 'hvdrun[tensorflow]', for "
            "collectives.tensorflow)"
        )
    if keras_version:
        backend = _keras_backend() if keras_version.split(".")[0] == "3" else "tensorflow"
        where = f"backend {backend}" if keras_version.startswith("3.") else "on TensorFlow"
        note = "collectives.keras"
        if backend not in ("tensorflow", "torch"):
            note = "collectives.keras needs its tensorflow or torch backend"
        elif backend == "tensorflow" and tf_version is None:
            note = "collectives.keras: this backend needs TensorFlow"
        usable = note == "collectives.keras"
        yield f"    {_mark(usable)} Keras {keras_version}, {where} ({note})"
    else:
        yield "    [ ] Keras (not installed: pip install 'hvdrun[keras]', for collectives.keras)"
    if tf_keras:
        yield f"    [X] tf_keras {tf_keras} (Keras 2, with TF_USE_LEGACY_KERAS=1)"


def build_report() -> Iterator[str]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        if isinstance(exc, ModuleNotFoundError) and exc.name == "torch":
            why = f"not installed for {sys.executable}: pip install torch; every frontend needs it"
        else:
            why = f"cannot import torch: {exc}"
        yield f"hvdrun v{__version__}:"
        yield ""
        yield "Available Frameworks:"
        yield f"    [ ] PyTorch ({why})"
        yield from framework_lines()
        return

    distributed = dist.is_available()
    gloo = distributed and dist.is_gloo_available()
    nccl = distributed and dist.is_nccl_available()
    mpi = distributed and dist.is_mpi_available()
    nccl_version = ""
    if nccl:
        try:
            version = torch.cuda.nccl.version()
            nccl_version = " " + ".".join(map(str, version)) if isinstance(version, tuple) else ""
        except Exception:  # NCCL present in the build but not loadable on this machine
            nccl_version = " (version unknown)"
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0

    yield f"hvdrun v{__version__}:"
    yield ""
    yield "Available Frameworks:"
    yield f"    [X] PyTorch {torch.__version__}"
    yield from framework_lines()
    yield ""
    yield "Available Controllers:"
    yield f"    {_mark(True)} gRPC rendezvous"
    yield f"    {_mark(gloo)} Gloo"
    yield f"    {_mark(mpi)} MPI"
    mpi4py = _version("mpi4py")
    if mpi4py:
        yield f"    [X] mpi4py {mpi4py} (hvd.init() under mpirun without MASTER_ADDR)"
    else:
        yield (
            "    [ ] mpi4py (not installed: hvd.init() under mpirun needs MASTER_ADDR, or "
            "pip install 'hvdrun[mpi]')"
        )
    yield ""
    yield "Available Tensor Operations:"
    yield f"    {_mark(nccl)} NCCL{nccl_version}"
    yield f"    {_mark(gloo)} Gloo"
    yield f"    {_mark(mpi)} MPI"
    yield ""
    yield "CUDA:"
    cuda_version = torch.version.cuda or "not in this torch build"
    yield f"    {_mark(cuda_devices > 0)} CUDA {cuda_version}, {cuda_devices} device(s)"
    for index in range(cuda_devices):
        yield f"        {index}: {torch.cuda.get_device_name(index)}"
    yield ""
    yield "Launcher of this process (what hvd.init() would join):"
    yield f"    {launchers.describe()}"
