"""``hvdrun --check-build``: what this installation can run, Horovod-style.

The only part of the CLI that imports torch (the launcher itself must start fast).
"""

from __future__ import annotations

from collections.abc import Iterator

from hvdrun import __version__
from rendezvous import launchers


def _mark(available: bool) -> str:
    return "[X]" if available else "[ ]"


def build_report() -> Iterator[str]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        yield f"hvdrun v{__version__}:"
        yield ""
        yield "Available Frameworks:"
        yield f"    [ ] PyTorch (cannot import torch: {exc})"
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
    yield ""
    yield "Available Controllers:"
    yield f"    {_mark(True)} gRPC rendezvous"
    yield f"    {_mark(gloo)} Gloo"
    yield f"    {_mark(mpi)} MPI"
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
